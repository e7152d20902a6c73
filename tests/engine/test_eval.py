"""Evaluation during training (eval:): the eval DAG is planned from the step DAG, its metrics are the hand formulas,
eval reward rises on the quickstart task, and no eval row ever reaches an update. On Ray: sync in
tests/engine/test_plugin_kind.py (one Ray run checks the plugin kind and the eval DAG), separate_async in
tests/e2e/test_async_pipeline.py, colocate_async here."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from conftest import ROOT, Recorder, quickstart_raw, with_staleness_guard
from rlpipe.engine.evaluation import eval_metrics
from rlpipe.engine.planning.config_io import load_pipeline, validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError
from rlpipe.jagged import from_flat

EVAL = {"data": {"source": "digits", "params": {"task": "reverse", "num_digits": 2, "size": 64}, "prompts_per_step": 32},
        "every": 10, "before_training": True, "params": {"generate": {"n": 4, "temperature": 0.6}}}


def _raw(tmp_path, steps: int, **eval_changes) -> dict:
    raw = quickstart_raw(trainer={"total_steps": steps, "output_dir": str(tmp_path)}, tracking={"enabled": False})
    raw["eval"] = {**EVAL, **eval_changes}
    return raw


def test_eval_metrics_are_the_hand_formulas():
    # two prompts of source a (k=2 samples each), one of source b; one failed row counts in no mean
    table = pa.table({
        "uid": ["p0", "p0", "p1", "p1", "q0", "q0"],
        "data_source": ["a", "a", "a", "a", "b", "b"],
        "reward": pa.array([1.0, 0.0, 0.5, 0.25, 0.0, 1.0], pa.float32()),
        "status": ["ok", "ok", "ok", "ok", "ok", "failed"],
        "response_ids": from_flat(np.arange(12, dtype=np.int32), np.array([1, 2, 3, 1, 2, 3]), pa.int32()),
    })
    m = eval_metrics(table, k=2, pass_threshold=1.0)
    assert m["eval/prompts"] == 3 and m["eval/failed_rows"] == 1
    assert m["eval/reward/mean"] == pytest.approx((1 + 0 + 0.5 + 0.25 + 0) / 5)
    assert m["eval/response_length/mean"] == pytest.approx((1 + 2 + 3 + 1 + 2) / 5)
    assert m["eval/a/mean@2"] == pytest.approx(((1 + 0) / 2 + (0.5 + 0.25) / 2) / 2)
    assert m["eval/a/pass@2"] == pytest.approx(0.5)  # p0 has a 1.0, p1 none
    assert (m["eval/b/mean@2"], m["eval/b/pass@2"]) == (0.0, 0.0)  # q0's passing row failed


def test_the_eval_dag_is_generate_and_the_scorers_with_their_own_params(tmp_path):
    plan = build_plan(validate_config(_raw(tmp_path, 2)))
    assert [n.name for n in plan.eval.nodes] == ["eval.generate", "eval.reward"]
    assert (plan.eval.samples_per_prompt, plan.eval.temperature) == (4, 0.6)
    assert plan.eval.nodes[1].providers["response_text"] == "eval.generate"
    assert plan.node("generate").params.n == 8  # the training node keeps its own
    penalty = load_pipeline(ROOT / "pipelines" / "quickstart_length_penalty.yaml")[0]
    with_node = build_plan(penalty.model_copy(update={"eval": validate_config(
        {**_raw(tmp_path, 2), "eval": {**EVAL, "nodes": ["length_penalty"]}}).eval}))
    assert [n.name for n in with_node.eval.nodes] == ["eval.generate", "eval.reward", "eval.length_penalty"]


@pytest.mark.parametrize("change, error", [
    ({"nodes": ["lenght"]}, r"eval: names node 'lenght', which the pipeline does not have"),
    ({"nodes": ["update"]}, r"eval: node\(s\) update would change the weights"),
    ({"params": {"generate": {"temprature": 0.6}}}, r"eval\.params\.generate\.temprature: unknown param"),
])
def test_bad_eval_settings_are_refused_naming_the_field(tmp_path, change, error):
    with pytest.raises(ConfigError, match=error):
        build_plan(validate_config(_raw(tmp_path, 2, **change)))


def _async_raw(tmp_path, mode: str, mode_params: dict, steps: int, **eval_changes) -> dict:
    return with_staleness_guard({**_raw(tmp_path, steps, **eval_changes), "mode": mode, "mode_params": mode_params})


@pytest.mark.parametrize("mode, mode_params", [
    ("separate_async", {"max_off_policy_threshold": 2, "strategy": "drop", "capacity_steps": 2}),
    ("colocate_async", {}),
])
def test_an_async_run_evaluates_beside_training_and_no_eval_row_reaches_an_update(tmp_path, mode, mode_params):
    """The eval prompts go to the rollout service on a lane of their own while the trainer goes on; their metrics
    are logged at the step whose push they evaluate (as in sync), tagged with the weight versions of their tokens."""
    recorder = Recorder()
    run_pipeline(validate_config(_async_raw(tmp_path, mode, mode_params, 24, every=8)), "", observer=recorder,
                 inline=True)
    evaluated = {s: m for s, m in recorder.metrics.items() if "eval/reward/mean" in m}
    assert sorted(evaluated) == [7, 15, 23] and "eval_start/reward/mean" in recorder.metrics[0]
    first = recorder.metrics[0]
    assert first["eval_start/policy_version"] == 0 and first["eval_start/prompts"] == 64
    for step, m in evaluated.items():  # generated with the weights that step pushed (or later ones)
        assert m["eval/prompts"] == 64 and step + 1 <= m["eval/policy_version"] <= m["eval/policy_version_max"]
    last = evaluated[23]
    assert last["eval/policy_version"] == 24 and last["eval/skipped"] == 0  # the last push, nothing skipped
    assert last["eval/digits/mean@4"] > first["eval_start/digits/mean@4"] + 0.1, (first, last)
    evals = [r for r in recorder.records if r.node.startswith("eval.")]
    assert {r.node for r in evals} == {"eval.generate", "eval.reward"}
    assert sum(r.rows_out for r in evals if r.node == "eval.generate") == 4 * 64 * 4  # 4 evaluations × 64 × n=4
    for step in range(24):
        assert not any(uid.startswith("eval") for uid in recorder.batches[step].column("uid").to_pylist())
        update = next(r for r in recorder.records if r.step == step and r.node == "update")
        assert update.rows_in == 16 * 8


def _training_chain_is_clean(recorder: Recorder, steps: int, rows: int) -> None:
    """Every update took the step's own rows, chained from the step's advantage, never an eval row."""
    for step in range(steps):
        by_node = {r.node: r for r in recorder.records if r.step == step}
        assert by_node["update"].rows_in == rows
        assert by_node["update"].input_fingerprint == by_node["advantage"].output_fingerprint
        assert not any(uid.startswith("eval") for uid in recorder.batches[step].column("uid").to_pylist())


def test_eval_reward_rises_on_the_quickstart_task_and_no_eval_row_reaches_an_update(tmp_path):
    recorder = Recorder()
    run_pipeline(validate_config(_raw(tmp_path, 40)), "", observer=recorder, inline=True)
    start, end = recorder.metrics[0], recorder.metrics[39]
    assert start["eval_start/policy_version"] == 0 and end["eval/policy_version"] == 40
    assert start["eval_start/prompts"] == end["eval/prompts"] == 64
    assert end["eval/digits/mean@4"] > start["eval_start/digits/mean@4"] + 0.2, (start, end)
    assert [s for s, m in recorder.metrics.items() if "eval/reward/mean" in m] == [9, 19, 29, 39]
    evals = [r for r in recorder.records if r.node.startswith("eval.")]
    assert {(r.node, r.kind) for r in evals} == {("eval.generate", "generate"), ("eval.reward", "reward")}
    assert {r.rows_out for r in evals if r.node == "eval.generate"} == {32 * 4}
    _training_chain_is_clean(recorder, 40, 16 * 8)


def test_colocate_async_on_ray_evaluates_on_the_rollout_worker_and_no_eval_row_reaches_an_update(ray_session,
                                                                                                  tmp_path):
    """The one colocate_async run on Ray in the suite: evaluation beside training (before step 0 and after steps 1
    and 3) on the rollout worker, staleness within the mode's bound of 2."""
    eval_data = {**EVAL["data"], "params": {**EVAL["data"]["params"], "size": 8}, "prompts_per_step": 8}
    raw = _async_raw(tmp_path, "colocate_async", {}, 4, every=2, data=eval_data)
    raw["data"] = {**raw["data"], "prompts_per_step": 4}
    recorder = Recorder()
    run_pipeline(validate_config(raw), "", observer=recorder)
    assert recorder.status == "FINISHED"
    assert recorder.metrics[0]["eval_start/policy_version"] == 0 and recorder.metrics[0]["eval_start/prompts"] == 8
    evaluated = {s: m for s, m in recorder.metrics.items() if "eval/reward/mean" in m}
    assert sorted(evaluated) == [1, 3]
    assert evaluated[1]["eval/policy_version"] >= 2 and evaluated[3]["eval/policy_version"] == 4
    evals = [r for r in recorder.records if r.node.startswith("eval.")]
    assert {r.node for r in evals} == {"eval.generate", "eval.reward"}
    assert all(r.worker.startswith("rollout") for r in evals if r.node == "eval.generate"), {r.worker for r in evals}
    for step in range(4):
        assert recorder.metrics[step]["staleness_guard/staleness/max"] <= 2
        assert not any(uid.startswith("eval") for uid in recorder.batches[step].column("uid").to_pylist())
        update = next(r for r in recorder.records if r.step == step and r.node == "update")
        assert update.rows_in == 4 * 8
