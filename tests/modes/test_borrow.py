"""separate_async's hybrid borrow (rlpipe.modes.borrow): the trainer generates only when the buffer runs dry.

The decision rule and the driver's side run against a fake buffer and trainer (no Ray, no model); one inline
run with a slow pool (environment latency) checks that borrowed groups reach the trainer with the trainer's
version, within the staleness bound and with their lineage, and a run with a fast pool borrows nothing."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from conftest import Recorder, quickstart_raw, with_staleness_guard
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.engine.tracking.lineage import BORROWED_REPLICA
from rlpipe.errors import ConfigError
from rlpipe.modes.borrow import BorrowParams, TrainerBorrow, borrow_groups

ON = BorrowParams(enabled=True, after_s=1.0, max_groups=3)


@pytest.mark.parametrize("waited,ready,needed,expected", [
    (0.5, 0, 4, 0),  # short of a batch, but not waited long enough
    (1.0, 4, 4, 0),  # waited long, but the buffer holds a batch
    (9.0, 6, 4, 0),  # more than a batch
    (1.0, 3, 4, 1),  # one missing
    (1.0, 0, 4, 3),  # four missing, at most max_groups
])
def test_borrows_only_when_the_buffer_is_short_and_the_wait_passed_the_bound(waited, ready, needed, expected):
    assert borrow_groups(ON, waited, ready, needed) == expected


def test_never_borrows_when_off():
    assert borrow_groups(BorrowParams(), 1e9, 0, 4) == 0


class _FakeMode:
    """What TrainerBorrow uses of SeparateAsyncMode: a buffer (finished count, pending prompts) and a trainer."""

    def __init__(self, finished: int, pending: int, room: int = 1 << 30):
        self.finished, self.room, self.drawn, self.calls = finished, room, [], []
        self.pending = [f"p{i}" for i in range(pending)]
        self.generate_node, self.head, self.gen_params = type("Node", (), {"name": "generate"})(), [], {}
        mode = self

        class Workers:
            def call(self, role, method, prompts, *args, rank=None):
                mode.calls.append((role, method, prompts.column("uid").to_pylist(), rank))
                return [{"records": [], "uids": prompts.column("uid").to_pylist(), "version": 3, "seconds": 0.1}]

            def handle(self, role):
                return role

        class Executor:
            backend, noted = None, []

            def note_replicas(self, uids, replica):
                self.noted.append((uids, replica))

        self.runtime = type("Runtime", (), {"workers": Workers(), "executor": Executor(),
                                            "config": type("C", (), {"seed": 0})()})()

    def sampler(self, method, *args):
        if method == "counts":
            return {"finished": self.finished}
        if method == "room":
            return self.room
        if method == "next_pending":
            taken, self.pending = self.pending[: args[0]], self.pending[args[0]:]
            return pa.table({"uid": pa.array(taken, pa.string())})
        raise AssertionError(method)

    def draw(self, step, count):
        n = count()
        self.drawn.append(n)
        self.pending += [f"new{step}-{i}" for i in range(n)]
        return n


def test_the_driver_never_lends_the_trainer_while_the_buffer_holds_a_batch():
    mode = _FakeMode(finished=4, pending=5)
    borrow = TrainerBorrow(mode, ON)
    assert borrow.maybe(0, 100.0, 4, [], {}) == 0
    assert mode.calls == [] and mode.drawn == [] and len(mode.pending) == 5


def test_the_driver_waits_for_the_bound_before_asking_the_buffer():
    mode = _FakeMode(finished=0, pending=5)
    borrow = TrainerBorrow(mode, ON)
    assert borrow.wait_s(0.25, 1.0) == pytest.approx(0.75)  # the next wait ends at the bound
    assert borrow.maybe(0, 0.9, 4, [], {}) == 0 and mode.calls == []


def test_a_borrow_takes_pending_prompts_first_then_draws_the_rest_at_the_current_step():
    mode = _FakeMode(finished=1, pending=1)
    borrow = TrainerBorrow(mode, ON)
    assert borrow.maybe(5, 1.5, 4, [], {}) == 3
    assert mode.drawn == [2]  # 3 missing: the pending one and two new ones
    assert mode.calls == [("actor", "borrowed_rollout", ["p0", "new5-0", "new5-1"], 0)]
    assert mode.runtime.executor.noted[-1] == (["p0", "new5-0", "new5-1"], BORROWED_REPLICA)
    assert borrow.wait_s(1.6, 1.0) == 0.0  # right after a borrow: look at the buffer again at once
    assert borrow.take() == (3, pytest.approx(0.1)) and borrow.take() == (0, 0.0)


def test_a_borrow_draws_no_more_than_the_buffer_admits():
    mode = _FakeMode(finished=0, pending=0, room=0)  # wait strategy with a full schedule
    assert TrainerBorrow(mode, ON).maybe(0, 2.0, 4, [], {}) == 0
    assert mode.calls == []


def _raw(tmp_path, steps: int, borrow: dict, **gen) -> dict:
    raw = quickstart_raw(mode="separate_async", data={"prompts_per_step": 2}, tracking={"enabled": False},
                         mode_params={"max_off_policy_threshold": 2, "capacity_steps": 2, "borrow": borrow},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path)})
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage["params"] = {**stage["params"], "n": 4, **gen}
        stages.append(stage)
    raw["stages"] = stages
    with_staleness_guard(raw)
    return raw


def test_borrow_is_refused_where_it_cannot_run(tmp_path):
    raw = _raw(tmp_path, 1, {"enabled": True})
    raw["trainer"] = {**raw["trainer"], "backend": "fsdp2"}
    with pytest.raises(ConfigError, match="borrow.enabled: the borrowed engine loads trainer rank 0's whole model"):
        build_plan(validate_config(raw))


def test_a_starved_trainer_borrows_and_a_fed_one_does_not(tmp_path):
    # every request waits 0.3 s for its environment: the pool delivers a batch well after the trainer is done
    slow = _raw(tmp_path / "slow", 4, {"enabled": True, "after_s": 0.1, "max_groups": 1},
                env_latency_s=0.3, env_latency_max_s=0.3)
    rec = Recorder()
    run_pipeline(validate_config(slow), "", observer=rec, inline=True)
    borrowed = [m["rollout/borrowed_groups"] for m in rec.metrics.values()]
    assert sum(borrowed) > 0, borrowed
    for step, m in rec.metrics.items():
        assert m["staleness_guard/staleness/max"] <= 2
        assert m["rollout/borrowed_groups"] == 0 or m["async/guard_wait_s"] >= 0.1  # never before the bound
    gen = [r for r in rec.records if r.kind == "generate" and r.worker == "actor[0] (borrowed)"]
    assert gen and all(r.policy_versions == [r.trainer_version] for r in gen)  # the trainer's version at the time
    assert len([r for r in rec.records if r.kind == "reward" and r.worker == "actor[0] (borrowed)"]) == len(gen)
    consumed = 0
    for step, lineage in rec.trajectory_lineage.items():
        rows = lineage.filter(pa.compute.equal(lineage["replica"], BORROWED_REPLICA))
        consumed += rows.num_rows
        versions = rows["min_version"].to_numpy()
        # one version per trajectory (no push mid-generation), never newer than the consuming step's policy
        assert np.array_equal(versions, rows["max_version"].to_numpy()) and np.all(versions <= step)
    assert consumed > 0
    uids = [u for batch in rec.batches.values() for u in set(batch.column("uid").to_pylist())]
    assert len(uids) == len(set(uids))  # no prompt trained on twice

    fed = _raw(tmp_path / "fed", 3, {"enabled": True, "after_s": 5.0})
    rec = Recorder()
    run_pipeline(validate_config(fed), "", observer=rec, inline=True)
    assert [m["rollout/borrowed_groups"] for m in rec.metrics.values()] == [0.0, 0.0, 0.0]
    assert not [r for r in rec.records if "(borrowed)" in r.worker]
