"""The simulator's buffer takes the real replay buffer's decisions: both driven by the same random calls."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.engine.state.replay_buffer import ReplayBuffer, ReplayBufferParams
from rlpipe.engine.state.replay_records import ReplayBufferError
from rlpipe.simulate.buffer import BufferRefused, SimBuffer

N = 2  # samples per group


def _prompts(uids: list[int]) -> pa.Table:
    return pa.table({"uid": pa.array([f"p{u}" for u in uids], pa.string())})


def _group(uid: int, step: int) -> pa.Table:
    return pa.table({"uid": pa.array([f"p{uid}"] * N, pa.string()), "status": pa.array(["completed"] * N),
                     "prompt_step": pa.array([step] * N, pa.int32())})


@pytest.mark.parametrize("strategy,threshold,capacity_steps", [("drop", 1, 2), ("drop", 2, 3), ("wait", 1, 2),
                                                               ("wait", 3, 2), ("wait", 2, 4)])
def test_same_calls_same_decisions(strategy, threshold, capacity_steps):
    groups = 4
    real = ReplayBuffer(ReplayBufferParams(max_off_policy_threshold=threshold, strategy=strategy, group_size=N,
                                           groups_per_step=groups, capacity_steps=capacity_steps))
    sim = SimBuffer(groups, threshold, strategy, capacity_steps)
    rng = np.random.default_rng(0)
    running: list[tuple[int, int]] = []  # (uid, submit step) pulled and not yet back
    step, served = 0, 0
    for _ in range(400):
        op = rng.choice(["refill", "pull", "finish", "sample"])
        if op == "refill":
            need = real.refill_needed(step)
            assert sim.refill_needed(step) == need
            extra = int(rng.integers(0, 2)) if strategy == "drop" else 0  # over-filling is allowed under drop
            made = sim.add_prompts(need + extra, step)
            real.add_prompts(_prompts([p.uid for p in made]), step) if made else None
        elif op == "pull":
            k = int(rng.integers(1, 4))
            picked = sim.next_pending(k)
            assert real.next_pending(k).column("uid").to_pylist() == [f"p{p.uid}" for p in picked]
            running += [(p.uid, p.submit_step) for p in picked]
        elif op == "finish" and running:
            uid, submitted = running.pop(int(rng.integers(len(running))))
            assert real.add_trajectories(_group(uid, submitted)) == int(sim.add_group(uid, object()))
        elif op == "sample":
            if served == groups or (strategy == "drop" and rng.random() < 0.2):  # wait: the modes serve every step
                step, served = step + 1, 0
            got = real.sample(groups, step)
            mine = sim.sample(groups, step)
            assert (got is None) == (mine is None), (step, strategy)
            if got is not None:
                assert sorted(set(got.column("uid").to_pylist())) == sorted(f"p{p.uid}" for p in mine)
                served += groups
        states = [p.state for p in sim.prompts.values()]
        assert real.counts() == {s: states.count(s) for s in ("pending", "running", "finished")}
    assert real.metrics()["sampler/evicted_stale_total"] == sim.counts["evicted_stale"]
    assert sim.counts["consumed"] > 0 and (strategy == "wait" or sim.counts["evicted_stale"] > 0)  # paths ran


def test_wait_refuses_what_its_schedule_cannot_consume_as_the_real_one_does():
    real = ReplayBuffer(ReplayBufferParams(max_off_policy_threshold=1, strategy="wait", group_size=N,
                                           groups_per_step=2))
    sim = SimBuffer(2, 1, "wait", 2)
    with pytest.raises(ReplayBufferError):
        real.add_prompts(_prompts([0, 1, 2]), 0)
    with pytest.raises(BufferRefused):
        sim.add_prompts(3, 0)
