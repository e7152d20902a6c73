"""Shared cores: a replica decodes at its measured share; a trainer node runs at its share while a replica decodes
and at its own speed otherwise — with known answers."""

from __future__ import annotations

import pytest

from rlpipe.simulate.contention import Contention
from rlpipe.simulate.kernel import Kernel
from rlpipe.simulate.replica import Group, Replica


def _beside(node_share: float, decode_share: float, node_s: float, node_starts_at: float = 0.0):
    """1 s of decoding of its own (one request of 100 iterations of 10 ms) from 0 s, and a node of ``node_s``
    seconds of its own starting at ``node_starts_at``; returns (the node's seconds, when it ended, when the
    replica's request ended)."""
    kernel = Kernel()
    contention = Contention(kernel, node_share, decode_share)
    finished, node = {}, {}
    replica = Replica(kernel, 0, 0.01, 0.0, lambda g, r: finished.setdefault("at", kernel.now), contention=contention)
    contention.replicas = [replica]
    replica.submit(Group(0, 0, [100]), [0.0])

    def run_node():
        yield node_starts_at
        node["took"] = yield from contention.run(node_s)
        node["at"] = kernel.now

    kernel.process(run_node())
    kernel.run(lambda: "at" in node and "at" in finished)
    return node["took"], node["at"], finished["at"]


def test_a_node_beside_decoding_runs_at_its_share_and_the_replica_at_its_own():
    """node share 0.5, decode share 0.8: 1 s of decoding takes 1.25 s; a 0.5 s node beside it takes 1 s."""
    took, _, decoded = _beside(0.5, 0.8, 0.5)
    assert took == pytest.approx(1.0) and decoded == pytest.approx(1.25)


def test_a_node_goes_back_to_its_own_speed_when_decoding_stops():
    """1 s of decoding at share 1; a 1 s node at share 0.5 beside it does half its work by 1 s, the rest alone:
    it ends at 1.5 s."""
    _, ended, decoded = _beside(0.5, 1.0, 1.0)
    assert decoded == pytest.approx(1.0) and ended == pytest.approx(1.5)


def test_a_node_starting_after_decoding_ended_runs_at_its_own_speed():
    _, ended, _ = _beside(0.5, 1.0, 0.3, node_starts_at=2.0)
    assert ended == pytest.approx(2.3)


def test_with_both_shares_one_nothing_slows():
    took, ended, decoded = _beside(1.0, 1.0, 1.0)
    assert took == pytest.approx(1.0) and ended == pytest.approx(1.0) and decoded == pytest.approx(1.0)


def test_a_node_waits_on_two_replicas_until_the_last_stops():
    """Replicas decoding 0.5 s and 1 s of their own (share 1), a 1 s node at share 0.5: it runs at half speed
    while either decodes (until 1 s: half its work), then alone: ends at 1.5 s."""
    kernel = Kernel()
    contention = Contention(kernel, 0.5, 1.0)
    done = []
    replicas = [Replica(kernel, i, 0.01, 0.0, lambda g, r: done.append(kernel.now), contention=contention)
                for i in range(2)]
    contention.replicas = replicas
    for i, (r, n) in enumerate(zip(replicas, (50, 100))):
        r.submit(Group(i, 0, [n]), [0.0])
    node = {}

    def run_node():
        yield from contention.run(1.0)
        node["at"] = kernel.now

    kernel.process(run_node())
    kernel.run(lambda: "at" in node and len(done) == 2)
    assert done == pytest.approx([0.5, 1.0]) and node["at"] == pytest.approx(1.5)


def test_a_push_re_prefills_the_requests_it_stopped():
    """One request of 100 tokens at 10 ms an iteration (all per running request). Paused at 0.5 s (50 tokens
    decoded) and resumed at once on new weights: its 50 tokens are prefilled again, 50 × 10 ms, before it decodes
    on — done at 1.5 s; resumed on the same weights (a pause that loads nothing), at 1.0 s."""
    for version, ends in ((1, 1.5), (None, 1.0)):
        kernel = Kernel()
        done = {}
        replica = Replica(kernel, 0, 0.0, 0.01, lambda g, r: done.setdefault("at", kernel.now))
        replica.submit(Group(0, 0, [100]), [0.0])

        def push():
            yield 0.5
            replica.pause()
            replica.resume(version)

        kernel.process(push())
        kernel.run(lambda: "at" in done)
        assert done["at"] == pytest.approx(ends)
