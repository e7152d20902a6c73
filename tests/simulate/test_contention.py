"""Shared cores: a trainer node and a decoding replica slow each other down, with known answers."""

from __future__ import annotations

import pytest

from rlpipe.simulate.contention import Contention
from rlpipe.simulate.kernel import Kernel
from rlpipe.simulate.replica import Group, Replica


def _setup(share: float, per_step_s: float = 0.01):
    kernel = Kernel()
    contention = Contention.from_share(kernel, share)
    finished = {}
    replica = Replica(kernel, 0, per_step_s, 0.0, lambda g, r: finished.setdefault("at", kernel.now),
                      contention=contention)
    contention.replicas = [replica]
    return kernel, contention, replica, finished


def _node(kernel, contention, seconds, out):
    took = yield from contention.run(seconds)
    out["took"], out["at"] = took, kernel.now


def test_a_node_and_a_replica_computing_together_each_run_at_the_share():
    """share 0.5: both at half speed while both run. A 1 s node beside 1 s of decoding (100 iterations of 10 ms):
    both end at 2 s."""
    kernel, contention, replica, finished = _setup(0.5)
    replica.submit(Group(0, 0, [100]), [0.0])
    node = {}
    kernel.process(_node(kernel, contention, 1.0, node))
    kernel.run(lambda: "at" in node and "at" in finished)
    assert node["took"] == pytest.approx(2.0) and finished["at"] == pytest.approx(2.0)


def test_the_one_left_goes_back_to_its_own_speed():
    """A 0.5 s node beside 1 s of decoding, share 0.5: both at half speed until the node ends at 1 s (the replica
    has done half its work), then the replica alone at full speed ends at 1.5 s."""
    kernel, contention, replica, finished = _setup(0.5)
    replica.submit(Group(0, 0, [100]), [0.0])
    node = {}
    kernel.process(_node(kernel, contention, 0.5, node))
    kernel.run(lambda: "at" in node and "at" in finished)
    assert node["at"] == pytest.approx(1.0) and finished["at"] == pytest.approx(1.5)


def test_a_node_starting_mid_decode_slows_only_what_is_left():
    """1 s of decoding; at 0.4 s a 0.3 s node starts (share 0.75: 1.5 cores for two, each at 0.75): it ends at
    0.8 s, the replica's remaining 0.6 s of work runs 0.4 s at 0.75 then 0.3 s alone: done at 1.1 s."""
    kernel, contention, replica, finished = _setup(0.75)
    replica.submit(Group(0, 0, [100]), [0.0])
    node = {}

    def later():
        yield 0.4
        yield from _node(kernel, contention, 0.3, node)

    kernel.process(later())
    kernel.run(lambda: "at" in node and "at" in finished)
    assert node["at"] == pytest.approx(0.8) and finished["at"] == pytest.approx(1.1)


def test_without_a_measured_share_nothing_slows():
    kernel, contention, replica, finished = _setup(1.0)
    replica.submit(Group(0, 0, [100]), [0.0])
    node = {}
    kernel.process(_node(kernel, contention, 1.0, node))
    kernel.run(lambda: "at" in node and "at" in finished)
    assert contention.cores is None and node["at"] == pytest.approx(1.0) and finished["at"] == pytest.approx(1.0)


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
    kernel.process(_node(kernel, contention, 1.0, node))
    kernel.run(lambda: "at" in node and len(done) == 2)
    assert node["at"] == pytest.approx(2.5) and done == pytest.approx([2.5, 2.5])
