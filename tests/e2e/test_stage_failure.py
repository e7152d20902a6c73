"""A stage failing mid-run: the error names kind, impl and step; nothing produced so far is lost."""

from __future__ import annotations

import re

import pytest
from mlflow.tracking import MlflowClient

from rlpipe import error_log
from rlpipe.engine.tracking import runs, traces
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import StageError
from rlpipe.stage import stage
from rlpipe.stages.weight_sync import WeightSyncParams, push_weights

from conftest import Recorder, quickstart_raw

pytestmark = pytest.mark.e2e


# A driver stage runs in this process, so a test can register it; it fails at step 1.
@stage("weight_sync", "breaks_at_step_1", placement="driver", params=WeightSyncParams, reads={}, writes={})
def breaks_at_step_1(batch, params, ctx):
    if ctx.step == 1:
        raise ConnectionError("transport to the rollout engine lost")
    return push_weights(batch, params, ctx)


@stage("weight_sync", "interrupted_at_step_1", placement="driver", params=WeightSyncParams, reads={}, writes={})
def interrupted_at_step_1(batch, params, ctx):
    if ctx.step == 1:
        raise KeyboardInterrupt  # Ctrl-C while the driver runs this node: not a stage failure, the run stops
    return push_weights(batch, params, ctx)


def test_an_interrupt_mid_step_keeps_the_records_of_the_nodes_that_ran(ray_session, tmp_path):
    """On Ray a node's record is written while the driver waits on the next call; a step that ends otherwise than
    by a stage failure (here an interrupt before the weight push waited on anything) still writes them."""
    raw = quickstart_raw(data={"prompts_per_step": 4}, tracking={"enabled": False},
                         trainer={"total_steps": 3, "output_dir": str(tmp_path)})
    raw["stages"] = [{**s, "impl": "interrupted_at_step_1"} if s["kind"] == "weight_sync" else s
                     for s in raw["stages"]]
    observer = Recorder()
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(validate_config(raw), "", observer=observer)
    assert [(r.step, r.node) for r in observer.records if r.step == 1] == [
        (1, node) for node in ("generate", "reward", "balance", "old_log_prob", "advantage", "update")]


def test_failure_names_the_stage_and_keeps_what_was_produced(ray_session, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = quickstart_raw(
        name="e2e-failure", data={"prompts_per_step": 4},
        trainer={"total_steps": 3, "output_dir": str(tmp_path / "out")},
        tracking={"uri": uri, "experiment": "rlpipe-failure"},
    )
    raw["stages"] = [
        {**s, "impl": "breaks_at_step_1"} if s["kind"] == "weight_sync" else s for s in raw["stages"]
    ]
    with pytest.raises(StageError) as info:
        run_pipeline(validate_config(raw), "name: e2e-failure\n")
    err = info.value
    assert (err.kind, err.impl, err.step) == ("weight_sync", "breaks_at_step_1", 1)
    assert "transport to the rollout engine lost" in str(err)
    details = error_log.write(err, ["run"], str(tmp_path)).read_text()  # what `rlpipe run` keeps in its error log
    assert "Traceback" in details and "in breaks_at_step_1" in details  # the frame where it failed

    run = runs.latest_run(uri, "rlpipe-failure")
    assert run.info.status == "FAILED"
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [0]
    lineage = runs.lineage_table(run.info.run_id, uri).to_pylist()
    # all 7 nodes of step 0, the 6 nodes of step 1 that ran before the failure, and the failure itself
    assert [r["step"] for r in lineage].count(0) == 7
    assert [r["node"] for r in lineage if r["step"] == 1] == [
        "generate", "reward", "balance", "old_log_prob", "advantage", "update", "weight_sync",
    ]
    failed = lineage[-1]
    assert "transport to the rollout engine lost" in failed["error"] and failed["output_fingerprint"] == ""
    assert all(not r["error"] for r in lineage[:-1])
    # the failed step is a trace too, its last span in error
    step_traces = traces.step_traces(run.info.experiment_id, run.info.run_id, uri)
    assert sorted(step_traces) == [0, 1] and step_traces[1].info.state.value == "ERROR"
    last = max(step_traces[1].data.spans, key=lambda s: s.start_time_ns)
    assert last.name == "weight_sync" and last.status.status_code == "ERROR"
    assert "transport to the rollout engine lost" in last.attributes["rlpipe.error"]


@pytest.mark.slow
def test_a_failed_run_resumes_from_its_checkpoint_in_the_same_mlflow_run(tmp_path):
    """In process: what is checked here is the tracking side of resume (one MLflow run, lineage replaced);
    resume on Ray equals the uninterrupted run in tests/engine/test_checkpoint.py."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    raw = quickstart_raw(
        name="e2e-resume", data={"prompts_per_step": 4},
        trainer={"total_steps": 3, "output_dir": str(tmp_path / "out"), "checkpoint_every": 1},
        tracking={"uri": uri, "experiment": "rlpipe-resume"},
    )
    broken = dict(raw, stages=[
        {**s, "impl": "breaks_at_step_1"} if s["kind"] == "weight_sync" else s for s in raw["stages"]
    ])
    with pytest.raises(StageError):
        run_pipeline(validate_config(broken), "name: e2e-resume\n", inline=True)
    run_id = runs.latest_run(uri, "rlpipe-resume").info.run_id
    checkpoint = next((tmp_path / "out").glob("e2e-resume-*/checkpoints/step_1"))

    result = run_pipeline(validate_config(raw), "name: e2e-resume\n", resume_from=str(checkpoint), inline=True)
    assert result.run_id == run_id
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward/mean")) == [0, 1, 2]
    lineage = runs.lineage_table(run_id, uri).to_pylist()
    # step 1's partial records of the failed attempt were replaced by the resumed run's
    assert [r["node"] for r in lineage if r["step"] == 1].count("generate") == 1
    assert {r["step"] for r in lineage} == {0, 1, 2}


def test_a_worker_stage_error_arrives_as_the_stage_error_not_rays_wrapper(ray_session, tmp_path):
    """A stage failing on a Ray actor: the run raises the stage's own error (one line, the worker's traceback in
    ``details`` for ``rlpipe run``'s error log), not Ray's RayTaskError whose text opens with the worker's
    process and traceback (issue 14 part 4: one clear line)."""
    raw = quickstart_raw(data={"prompts_per_step": 4}, tracking={"enabled": False},
                         trainer={"total_steps": 3, "output_dir": str(tmp_path), "optimizer": {"lr": 1e30},
                                  "grad_clip": None})
    with pytest.raises(StageError) as info:
        run_pipeline(validate_config(raw), "")
    err = info.value
    assert str(err).startswith("stage 'update' (impl 'ppo') failed at step ") and "NumericalError: " in str(err)
    assert "ray::" not in str(err) and len(str(err).splitlines()) == 1
    assert err.__cause__ is None and "train_state.py" in err.details  # the actor's frames, carried across Ray
    assert "train_state.py" in error_log.write(err, ["run"], str(tmp_path)).read_text()


def test_a_worker_that_fails_to_start_names_its_real_cause(ray_session, tmp_path, capfd):
    """A model folder that passes validate (config.json, a weight file) but whose weights do not load: the
    workers die in their start-up, and the run's one line is the worker's own exception type and message,
    not Ray's ActorDiedError (issue 23 item 4)."""
    import json

    from rlpipe.errors import RlpipeError

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                    "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 16,
                                                    "num_attention_heads": 4, "intermediate_size": 64,
                                                    "max_position_embeddings": 64}))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    raw = quickstart_raw(data={"prompts_per_step": 4}, tracking={"enabled": False},
                         trainer={"total_steps": 1, "output_dir": str(tmp_path / "out")})
    raw["model"] = {"path": str(folder)}
    with pytest.raises(RlpipeError) as info:
        run_pipeline(validate_config(raw), "")
    line = error_log.one_line(info.value)
    assert "start-up" in line and "ActorDiedError" not in line, line
    assert "safetensors" in line.lower() or "header" in line.lower(), line
    assert re.search(r"\(at \S+\.py:\d+ in \w+\)", line), line  # where the worker's exception was raised
    # and the terminal holds no Ray traceback of a failed creation task above that line (the worker kept its
    # exception for its first call instead of raising it from __init__)
    assert "creation task" not in capfd.readouterr().err
