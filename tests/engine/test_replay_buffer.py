"""The replay buffer on hand-built tables: states, exact refills, drop / wait, DAPO, checkpoints."""

from __future__ import annotations

import heapq
import itertools
import pickle

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.engine.state.replay_buffer import ReplayBuffer, ReplayBufferParams
from rlpipe.engine.state.replay_records import ReplayBufferError
from rlpipe.registry import registry
from rlpipe.stage import StageContext
from rlpipe.stages.staleness_guard import StalenessGuardParams, staleness_guard


def prompts(*uids: str) -> pa.Table:
    n = len(uids)
    return pa.table({
        "uid": list(uids),
        "data_source": ["digits"] * n,
        "ground_truth": ["1"] * n,
        "prompt_ids": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
        "prompt_step": pa.array([0] * n, pa.int32()),
    })  # fmt: skip


def group(uid: str, step: int, rewards: list, status: list[str] | None = None, versions=None) -> pa.Table:
    n = len(rewards)
    versions = versions if versions is not None else [[step, step]] * n
    return pa.table({
        "uid": [uid] * n,
        "sample_index": pa.array(range(n), pa.int32()),
        "status": status or ["ok"] * n,
        "prompt_step": pa.array([step] * n, pa.int32()),
        "token_versions": pa.array(versions, pa.list_(pa.int32())),
        "reward": pa.array(rewards, pa.float32()),
    })  # fmt: skip


def buffer(**kw) -> ReplayBuffer:
    kw = {"group_size": 2, "groups_per_step": 1, **kw}
    return ReplayBuffer(ReplayBufferParams(**kw))


def submit_and_finish(buf: ReplayBuffer, uid: str, step: int, rewards=(0.0, 1.0)) -> None:
    buf.add_prompts(prompts(uid), step)
    assert buf.next_pending(1)["uid"].to_pylist() == [uid]
    buf.add_trajectories(group(uid, step, list(rewards)))


def test_registered_as_sampler():
    assert registry("sampler").get("replay_buffer") is ReplayBuffer
    with pytest.raises(ValueError):
        ReplayBufferParams(max_off_policy_threshold=0)
    with pytest.raises(ValueError):
        ReplayBufferParams(strategy="evict")


def test_prompt_states_and_partial_groups():
    buf = buffer()
    buf.add_prompts(prompts("a", "b"), submit_step=3)
    assert buf.counts() == {"pending": 2, "running": 0, "finished": 0}
    pulled = buf.next_pending(1)
    assert pulled["uid"].to_pylist() == ["a"] and pulled["prompt_step"].to_pylist() == [3]  # stamped
    assert buf.counts() == {"pending": 1, "running": 1, "finished": 0}
    assert buf.add_trajectories(group("a", 3, [1.0, 0.0]).slice(0, 1)) == 0  # partial group waits
    assert buf.sample(1, consuming_step=3) is None
    assert buf.add_trajectories(group("a", 3, [1.0, 0.0]).slice(1, 1)) == 1
    assert buf.counts() == {"pending": 1, "running": 0, "finished": 1}
    batch = buf.sample(1, consuming_step=3)
    assert batch["uid"].to_pylist() == ["a", "a"] and batch["reward"].to_pylist() == [1.0, 0.0]
    assert buf.counts() == {"pending": 1, "running": 0, "finished": 0}
    assert buf.next_pending(5)["uid"].to_pylist() == ["b"] and buf.next_pending(5).num_rows == 0


def test_all_failed_group_is_evicted_and_refilled_once():
    buf = buffer(capacity_steps=1)
    buf.add_prompts(prompts("a"), 0)
    buf.next_pending(1)
    assert buf.refill_needed() == 0
    buf.add_trajectories(group("a", 0, [None, None], status=["failed", "failed"]))
    assert buf.counts()["finished"] == 0 and buf.refill_needed() == 1
    assert buf.metrics()["sampler/evicted_failed_total"] == 1.0


def test_exact_refill_counts():
    buf = buffer(groups_per_step=2, capacity_steps=2, filter_groups=True)
    assert buf.refill_needed() == 4
    for uid in "abcd":
        buf.add_prompts(prompts(uid), 0)  # one at a time, as the async modes do
    assert buf.refill_needed() == 0
    buf.next_pending(4)
    buf.add_trajectories(group("a", 0, [0.0, 1.0]))
    buf.add_trajectories(group("b", 0, [1.0, 0.0]))
    assert buf.sample(2, 0) is not None
    assert buf.refill_needed() == 2  # one per consumed group
    buf.add_trajectories(group("c", 0, [1.0, 1.0]))  # DAPO: zero variance
    assert buf.refill_needed() == 2 + 2  # refill_factor × evicted
    buf.add_trajectories(group("d", 0, [None, None], status=["failed", "failed"]))
    assert buf.refill_needed() == 2 + 2 + 1
    buf.add_prompts(prompts("e", "f", "g"), 1)
    assert buf.refill_needed() == 2
    m = buf.metrics()
    totals = [m[f"sampler/{k}_total"] for k in ("evicted_dapo", "evicted_failed", "consumed", "submitted")]
    assert totals == [1, 1, 2, 7]


def test_dapo_bonus_is_forgotten_once_a_batch_is_served():
    buf = buffer(capacity_steps=1, filter_groups=True)
    buf.add_prompts(prompts("a"), 0)
    buf.next_pending(1)
    buf.add_trajectories(group("a", 0, [1.0, 1.0]))
    assert buf.refill_needed() == 2
    buf.add_prompts(prompts("b", "c"), 0)
    buf.next_pending(2)
    buf.add_trajectories(group("b", 0, [0.0, 1.0]))
    assert buf.sample(1, 0)["uid"].to_pylist() == ["b", "b"]
    assert buf.refill_needed() == 0  # c still fills the one-group capacity: no growth


def test_drop_evicts_exactly_the_stale_groups():
    buf = buffer(max_off_policy_threshold=2, capacity_steps=4)
    for step, uid in enumerate(["s0", "s1", "s2"]):
        submit_and_finish(buf, uid, step)
    buf.add_prompts(prompts("inflight"), 0)
    buf.next_pending(1)  # stale but running: drop leaves in-flight prompts alone
    batch = buf.sample(1, consuming_step=2)  # staleness 3, 2, 1 → only s0 exceeds 2
    assert batch["uid"].to_pylist() == ["s1", "s1"]  # oldest remaining first
    m = buf.metrics(2)
    assert m["sampler/evicted_stale"] == 1.0 and m["sampler/staleness/max"] == 2.0
    assert m["sampler/staleness/hist_2"] == 2.0 and m["sampler/inflight_staleness/max"] == 3.0
    assert buf.counts() == {"pending": 0, "running": 1, "finished": 1}
    assert buf.refill_needed() == 4 - 2  # s0 and s1 replaced


def test_wait_blocks_on_an_inflight_prompt_at_the_threshold_and_never_drops():
    buf = buffer(max_off_policy_threshold=2, strategy="wait", capacity_steps=2)
    buf.add_prompts(prompts("old"), 0)
    buf.next_pending(1)
    assert buf.sample(1, 0) is None  # not ready
    submit_and_finish(buf, "new", 1)
    assert buf.sample(1, consuming_step=1) is None  # "old" has staleness 2 at step 1: wait for it
    assert buf.metrics()["sampler/blocked_total"] == 1.0
    buf.add_trajectories(group("old", 0, [0.0, 1.0]))
    assert buf.sample(1, 1)["uid"].to_pylist() == ["old", "old"]
    assert buf.sample(1, 2)["uid"].to_pylist() == ["new", "new"]
    m = buf.metrics()
    assert m["sampler/evicted_stale_total"] == 0.0 and m["sampler/staleness/max"] == 2.0


def test_wait_looks_ahead_when_groups_come_due_together():
    # One group per step, threshold 3. b and c (step 0) are still running at step 1, d (step 1) is ready.
    # Serving d now would leave b and c both reaching staleness 3 at step 2, with one slot there:
    # verl's rule (block only once an in-flight prompt has reached the threshold) would then overrun.
    buf = buffer(max_off_policy_threshold=3, strategy="wait", capacity_steps=4)
    buf.add_prompts(prompts("a", "b", "c"), 0)
    buf.next_pending(3)
    buf.add_trajectories(group("a", 0, [0.0, 1.0]))
    assert buf.sample(1, 0)["uid"][0].as_py() == "a"
    submit_and_finish(buf, "d", 1)
    assert buf.sample(1, 1) is None  # blocked although no in-flight prompt has reached the threshold yet
    buf.add_trajectories(group("b", 0, [0.0, 1.0]))
    assert buf.sample(1, 1)["uid"][0].as_py() == "b"
    assert buf.sample(1, 2) is None  # c is due now: wait for it rather than serve d
    buf.add_trajectories(group("c", 0, [0.0, 1.0]))
    assert [buf.sample(1, s)["uid"][0].as_py() for s in (2, 3)] == ["c", "d"]


def test_wait_admits_only_what_can_be_consumed_in_time():
    buf = buffer(max_off_policy_threshold=2, strategy="wait", groups_per_step=1, capacity_steps=5)
    assert buf.refill_needed(0) == 2  # threshold × groups per step, not the capacity of 5
    with pytest.raises(ReplayBufferError, match="refill_needed"):
        buf.add_prompts(prompts("a", "b", "c"), 0)
    buf.add_prompts(prompts("a", "b"), 0)
    assert buf.refill_needed(0) == 0 and buf.refill_needed(1) == 1


def test_dapo_ignores_infra_failures():
    buf = buffer(group_size=3, filter_groups=True, capacity_steps=4)
    buf.add_prompts(prompts("flat", "split", "single", "plain"), 0)
    buf.next_pending(4)
    # flat: valid rewards 1, 1 (the failed 0 must not count as a contrast) → evicted
    buf.add_trajectories(group("flat", 0, [1.0, 0.0, 1.0], status=["ok", "failed", "ok"]))
    # split: valid 1, 0 plus a failure → informative, kept with its failed row
    buf.add_trajectories(group("split", 0, [1.0, 0.0, None], status=["ok", "ok", "failed"]))
    # single: one valid trajectory → no baseline → evicted
    buf.add_trajectories(group("single", 0, [1.0, None, None], status=["ok", "failed", "failed"]))
    buf.add_trajectories(group("plain", 0, [0.5, 0.5, 0.5]))
    assert buf.counts()["finished"] == 1
    assert buf.metrics()["sampler/evicted_dapo_total"] == 3.0
    assert buf.refill_needed() == 4 - 1 + 3  # capacity − live + (2 − 1) × 3
    assert buf.sample(1, 0)["status"].to_pylist() == ["ok", "ok", "failed"]


def test_dapo_needs_the_reward_column():
    buf = buffer(filter_groups=True)
    buf.add_prompts(prompts("a"), 0)
    buf.next_pending(1)
    with pytest.raises(ReplayBufferError, match="reward stage"):
        buf.add_trajectories(group("a", 0, [0.0, 1.0]).drop_columns(["reward"]))


def test_checkpoint_reissues_inflight_prompts_with_their_steps():
    buf = buffer(capacity_steps=4)
    buf.add_prompts(prompts("pend"), 0)
    buf.add_prompts(prompts("run", "done"), 1)
    buf.next_pending(3)
    buf.requeue(["pend"])
    buf.add_trajectories(group("run", 1, [1.0, 0.0]).slice(0, 1))  # partial: regenerated on resume
    buf.add_trajectories(group("done", 1, [1.0, 0.0]))
    state = pickle.loads(pickle.dumps(buf.state()))

    again = buffer(capacity_steps=4)
    again.load_state(state)
    assert again.counts() == {"pending": 2, "running": 0, "finished": 1}
    reissued = again.next_pending(5)
    assert reissued["uid"].to_pylist() == ["pend", "run"] and reissued["prompt_step"].to_pylist() == [0, 1]
    assert again.refill_needed() == buf.refill_needed() == 1
    assert again.sample(1, 1).equals(buf.sample(1, 1))
    with pytest.raises(ReplayBufferError, match="group_size"):
        buffer(group_size=4).load_state(state)


def test_requeue_drops_partial_samples_and_late_rows_are_counted():
    buf = buffer()
    buf.add_prompts(prompts("a"), 0)
    buf.next_pending(1)
    buf.add_trajectories(group("a", 0, [1.0, 0.0]).slice(0, 1))
    buf.requeue(["a"])
    buf.add_trajectories(group("a", 0, [1.0, 0.0]).slice(1, 1))  # the aborted request answered late
    assert buf.counts() == {"pending": 1, "running": 0, "finished": 0}
    buf.next_pending(1)
    aborted = group("a", 0, [1.0, 0.0]).slice(0, 1).set_column(2, "status", pa.array(["aborted"]))
    assert buf.add_trajectories(aborted) == 0
    assert buf.add_trajectories(group("a", 0, [1.0, 0.0])) == 1
    m = buf.metrics()
    assert m["sampler/late_rows_total"] == 1.0 and m["sampler/aborted_rows_total"] == 1.0
    with pytest.raises(ReplayBufferError, match="no such prompt"):
        buf.requeue(["zzz"])


def test_contract_errors_say_what_to_do():
    buf = buffer()
    buf.add_prompts(prompts("a"), 2)
    with pytest.raises(ReplayBufferError, match="unique"):
        buf.add_prompts(prompts("a"), 2)
    buf.next_pending(1)
    with pytest.raises(ReplayBufferError, match="copy prompt_step"):
        buf.add_trajectories(group("a", 1, [1.0, 0.0]))
    with pytest.raises(ReplayBufferError, match="group_size"):
        buf.add_trajectories(group("a", 2, [1.0, 0.0, 1.0]))
    with pytest.raises(ReplayBufferError, match="lack columns"):
        buf.add_trajectories(pa.table({"uid": ["a"]}))
    buf.sample(1, 5)
    with pytest.raises(ReplayBufferError, match="go back"):
        buf.sample(1, 4)


def test_metrics_of_the_last_batch():
    buf = buffer(groups_per_step=2, capacity_steps=2, max_off_policy_threshold=4)
    buf.add_prompts(prompts("a"), 0)
    buf.add_prompts(prompts("b"), 2)
    buf.next_pending(2)
    buf.add_trajectories(group("a", 0, [1.0, 0.0], versions=[[0, 1, 2], [0]]))
    buf.add_trajectories(group("b", 2, [1.0, 0.0], versions=[[2, 3], []]))
    buf.sample(2, consuming_step=3)
    m = buf.metrics()
    assert (m["sampler/staleness/min"], m["sampler/staleness/max"], m["sampler/staleness/mean"]) == (2.0, 4.0, 3.0)
    assert [m[f"sampler/staleness/hist_{k}"] for k in range(1, 5)] == [0.0, 2.0, 0.0, 2.0]
    assert (m["sampler/versions_spanned/max"], m["sampler/versions_spanned/mean"]) == (3.0, 2.0)
    assert m["sampler/refill_needed"] == 4.0  # capacity 2 × 2, nothing left in the buffer


# ---------------------------------------------------------------------------
# discrete-event simulation of an async run: only the timing is simulated, the buffer is the real one


class AsyncRunSim:
    """A rollout pool and a trainer around a real ReplayBuffer, on a fake clock.

    Generation time per trajectory is Pareto-distributed (long tail); every token
    is stamped with the weight version current when it was produced (weights are
    pushed at the end of every training step, so version = steps trained). The
    trainer consumes ``G`` groups per step; prompts are submitted one at a time.
    """

    def __init__(self, strategy: str, threshold: int, seed: int, G: int = 4, n: int = 4, slots: int = 24):
        self.buf = ReplayBuffer(ReplayBufferParams(
            max_off_policy_threshold=threshold, strategy=strategy, filter_groups=True,
            group_size=n, groups_per_step=G, capacity_steps=3,
        ))  # fmt: skip
        self.rng = np.random.default_rng(seed)
        self.G, self.n, self.free = G, n, slots
        self.clock, self.step, self.training = 0.0, 0, False
        self.events: list = []
        self.tiebreak = itertools.count()
        self.push_times: list[float] = []
        self.submitted: dict[str, int] = {}  # uid → step at submission, recorded by the simulation
        self.consumed: list[tuple[int, pa.Table]] = []
        self.completed = 0

    def schedule(self, delay: float, kind: str, payload=None) -> None:
        heapq.heappush(self.events, (self.clock + delay, next(self.tiebreak), kind, payload))

    def submit(self) -> None:
        for _ in range(self.buf.refill_needed(self.step)):
            uid = f"p{len(self.submitted)}"
            self.buf.add_prompts(prompts(uid), self.step)
            self.submitted[uid] = self.step

    def dispatch(self) -> None:
        while self.free >= self.n:
            prompt = self.buf.next_pending(1)
            if prompt.num_rows == 0:
                return
            self.free -= self.n
            success = self.rng.choice([0.0, 0.3, 0.5, 0.7, 1.0])  # 0 and 1 make DAPO evict
            for i in range(self.n):
                duration = 0.15 * (1.0 + self.rng.pareto(1.2))
                self.schedule(duration, "done", (prompt, i, self.clock, duration, success))

    def finish(self, prompt: pa.Table, i: int, start: float, duration: float, success: float) -> None:
        self.free += 1
        length = 1 + min(int(duration * 40), 400)
        times = start + duration * np.arange(1, length + 1) / length
        versions = np.searchsorted(self.push_times, times, side="right").astype(np.int32)
        failed = self.rng.random() < 0.03
        row = pa.table({
            "uid": prompt["uid"],
            "sample_index": pa.array([i], pa.int32()),
            "status": ["failed" if failed else "ok"],
            "prompt_step": prompt["prompt_step"],
            "token_versions": pa.array([versions], pa.list_(pa.int32())),
            "reward": pa.array([None if failed else float(self.rng.random() < success)], pa.float32()),
        })  # fmt: skip
        self.completed += self.buf.add_trajectories(row)

    def train(self) -> None:
        if self.training:
            return
        batch = self.buf.sample(self.G, self.step)
        if batch is not None:
            self.consumed.append((self.step, batch))
            self.training = True
            self.schedule(1.0, "trained")

    def run(self, steps: int) -> AsyncRunSim:
        while self.step < steps:
            self.submit()
            self.dispatch()
            self.train()
            assert self.events, f"deadlock at step {self.step}: {self.buf.counts()}"
            self.clock, *_, kind, payload = heapq.heappop(self.events)
            if kind == "done":
                self.finish(*payload)
            else:  # a training step ends with a weight push
                self.push_times.append(self.clock)
                self.step += 1
                self.training = False
        return self


def check_consumed(sim: AsyncRunSim, threshold: int) -> np.ndarray:
    """Staleness of every consumed trajectory, proved from the simulation's own records."""
    out = []
    for step, batch in sim.consumed:
        uids = batch["uid"].to_pylist()
        assert len(uids) == sim.G * sim.n and all(uids.count(u) == sim.n for u in set(uids))  # whole groups
        submitted = np.array([sim.submitted[u] for u in uids])
        assert np.array_equal(batch["prompt_step"].to_numpy(), submitted)
        oldest_token = np.array([min(v) for v in batch["token_versions"].to_pylist()])
        assert np.all(oldest_token >= submitted)  # a prompt is generated after it is submitted
        assert np.all(step - oldest_token + 1 <= threshold)  # from the recorded token versions
        staleness_guard(batch, StalenessGuardParams(), StageContext(step=step, seed=0, policy_version=step,
                                                                    extras={"max_staleness": threshold}))
        out.append(step - submitted + 1)
    return np.concatenate(out)


def test_simulated_async_run_drop_never_consumes_a_stale_trajectory():
    threshold = 2
    sim = AsyncRunSim("drop", threshold, seed=1).run(steps=40)
    staleness = check_consumed(sim, threshold)
    m = sim.buf.metrics()
    assert staleness.max() <= threshold
    assert m["sampler/evicted_stale_total"] > 0  # the long tail really overran the threshold
    assert m["sampler/evicted_dapo_total"] > 0
    live = sum(sim.buf.counts().values())
    evicted = sum(m[f"sampler/evicted_{r}_total"] for r in ("stale", "dapo", "failed"))
    assert len(sim.submitted) == live + m["sampler/consumed_total"] + evicted  # every prompt accounted for


def test_simulated_async_run_wait_drops_nothing_and_stays_within_the_threshold():
    threshold = 2
    sim = AsyncRunSim("wait", threshold, seed=1).run(steps=40)
    staleness = check_consumed(sim, threshold)
    m = sim.buf.metrics()
    assert staleness.max() <= threshold
    assert m["sampler/evicted_stale_total"] == 0 and m["sampler/blocked_total"] > 0
    # every completed group was either trained on, DAPO/failure-evicted, or is still ready in the buffer
    evicted = m["sampler/evicted_dapo_total"] + m["sampler/evicted_failed_total"]
    assert sim.completed == m["sampler/consumed_total"] + evicted + sim.buf.counts()["finished"]
