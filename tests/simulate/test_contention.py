"""Shared cores: a trainer node and a decoding replica slow each other down, with known answers."""

from __future__ import annotations

import pytest

from rlpipe.simulate.contention import Contention
from rlpipe.simulate.kernel import Kernel
from rlpipe.simulate.replica import Group, Replica


def _beside(share: float, node_s: float, node_starts_at: float = 0.0):
    """1 s of decoding (one request of 100 iterations of 10 ms) from 0 s, and a node of ``node_s`` seconds of its
    own starting at ``node_starts_at``; returns (the contention, the node's seconds, when it ended, when the
    replica's request ended)."""
    kernel = Kernel()
    contention = Contention.from_share(kernel, share)
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
    return contention, node["took"], node["at"], finished["at"]


def test_a_node_and_a_replica_computing_together_each_run_at_the_share():
    """share 0.5: both at half speed while both run. A 1 s node beside 1 s of decoding: both end at 2 s."""
    _, took, _, decoded = _beside(0.5, 1.0)
    assert took == pytest.approx(2.0) and decoded == pytest.approx(2.0)


def test_the_one_left_goes_back_to_its_own_speed():
    """A 0.5 s node beside 1 s of decoding, share 0.5: both at half speed until the node ends at 1 s (the replica
    has done half its work), then the replica alone at full speed ends at 1.5 s."""
    _, _, ended, decoded = _beside(0.5, 0.5)
    assert ended == pytest.approx(1.0) and decoded == pytest.approx(1.5)


def test_a_node_starting_mid_decode_slows_only_what_is_left():
    """1 s of decoding; at 0.4 s a 0.3 s node starts (share 0.75: 1.5 cores for two, each at 0.75): it ends at
    0.8 s, the replica's remaining 0.6 s of work runs 0.4 s at 0.75 then 0.3 s alone: done at 1.1 s."""
    _, _, ended, decoded = _beside(0.75, 0.3, node_starts_at=0.4)
    assert ended == pytest.approx(0.8) and decoded == pytest.approx(1.1)


def test_without_a_measured_share_nothing_slows():
    contention, _, ended, decoded = _beside(1.0, 1.0)
    assert contention.cores is None and ended == pytest.approx(1.0) and decoded == pytest.approx(1.0)


def test_three_computing_share_the_cores_two_measured():
    """share 0.6 measured for two (1.2 effective cores): with a second replica decoding too, three share them, each
    at 0.4. Two replicas of 1 s and a 1 s node: all end at 2.5 s."""
    kernel = Kernel()
    contention = Contention.from_share(kernel, 0.6)
    done = []
    replicas = [Replica(kernel, i, 0.01, 0.0, lambda g, r: done.append(kernel.now), contention=contention)
                for i in range(2)]
    contention.replicas = replicas
    for i, r in enumerate(replicas):
        r.submit(Group(i, 0, [100]), [0.0])
    node = {}

    def run_node():
        yield from contention.run(1.0)
        node["at"] = kernel.now

    kernel.process(run_node())
    kernel.run(lambda: "at" in node and len(done) == 2)
    assert node["at"] == pytest.approx(2.5) and done == pytest.approx([2.5, 2.5])
