"""Checkpoints are safe and checked (issue 14, part 3): no pickle, a manifest verified before
anything starts, refusals that name the file or both pipelines, keep-last-K, free disk."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import Recorder, quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.engine.state import checkpoint
from rlpipe.engine.state.checkpoint import CheckpointError
from rlpipe.engine.state.safe_io import blake2b_file
from rlpipe.errors import RlpipeError


def _config(out: Path, steps: int = 2, name: str = "quickstart", tracking=None, **trainer):
    raw = quickstart_raw(name=name, data={"prompts_per_step": 4},
                         trainer={"total_steps": steps, "output_dir": str(out), **trainer})
    raw["tracking"] = tracking or {"enabled": False}
    return validate_config(raw)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A real checkpoint (step_1 of a 2-step run)."""
    out = tmp_path_factory.mktemp("ckpt")
    result = run_pipeline(_config(out, checkpoint_every=1), "", observer=Recorder(), inline=True)
    return Path(result.output_dir) / "checkpoints" / "step_1"


@pytest.fixture
def copy(written, tmp_path) -> Path:
    target = tmp_path / "step_1"
    shutil.copytree(written, target)
    return target


def _reseal(folder: Path, name: str) -> None:
    """Update the manifest for a replaced file, as an attacker who controls the folder would."""
    manifest = json.loads((folder / "manifest.json").read_text())
    file = folder / name
    manifest["files"][name] = {"bytes": file.stat().st_size, "blake2b": blake2b_file(file)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # what a crafted pickle does when loaded: run code
        return (Path.touch, (self.marker,))


def test_the_checkpoint_holds_no_pickle_and_a_manifest_of_every_file(written):
    names = sorted(p.name for p in written.iterdir())
    assert "manifest.json" in names and "actor_rank0.safetensors" in names and "engine.json" in names
    assert not [n for n in names if n.endswith((".pkl", ".pt", ".tmp"))]
    manifest = json.loads((written / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(n for n in names if n != "manifest.json")
    assert manifest["pipeline"] == "quickstart" and manifest["next_step"] == 1
    assert checkpoint.read_engine_state(written, _config(Path("elsewhere")))["next_step"] == 1


@pytest.mark.parametrize("name", ["engine.json", "actor_rank0.safetensors", "actor_rank0.json"])
def test_a_crafted_pickle_is_refused_unread_never_executed(copy, tmp_path, name):
    marker = tmp_path / "pwned"
    (copy / name).write_bytes(pickle.dumps(_Payload(marker)))
    _reseal(copy, name)
    with pytest.raises(CheckpointError, match=rf"{name} is not a valid .* refused unread"):
        run_pipeline(_config(tmp_path / "out"), "", observer=Recorder(), inline=True, resume_from=str(copy))
    assert not marker.exists()


def test_a_truncated_file_is_refused_naming_it(copy, tmp_path):
    file = copy / "actor_rank0.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"damaged: .*actor_rank0\.safetensors is \d+ bytes instead of \d+ "
                                              r"\(truncated\?\).*another checkpoint"):
        run_pipeline(_config(tmp_path / "out"), "", observer=Recorder(), inline=True, resume_from=str(copy))


def test_an_altered_file_is_refused_naming_it(copy, tmp_path):
    file = copy / "engine.json"
    file.write_text(file.read_text().replace('"next_step": 1', '"next_step": 0'))
    with pytest.raises(CheckpointError, match=r"engine\.json is altered"):
        checkpoint.read_engine_state(copy, _config(tmp_path))


def test_a_missing_manifest_means_an_incomplete_checkpoint(copy, tmp_path):
    (copy / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"not a complete rlpipe checkpoint \(no manifest\.json\)"):
        checkpoint.read_engine_state(copy, _config(tmp_path))


def test_another_pipelines_checkpoint_is_refused_naming_both(copy, tmp_path):
    other = _config(tmp_path, name="other-pipeline", optimizer={"lr": 1e-3})
    with pytest.raises(CheckpointError, match=r"written by pipeline 'quickstart' \(identity hash [0-9a-f]+\), not by "
                                              r"this one, 'other-pipeline' \(identity hash [0-9a-f]+;.*\): resume with"):
        run_pipeline(other, "", observer=Recorder(), inline=True, resume_from=str(copy))
    raw = quickstart_raw(data={"prompts_per_step": 4}, model={"architecture": {"hidden_size": 32}})
    raw["tracking"] = {"enabled": False}
    with pytest.raises(CheckpointError, match=r"written by pipeline 'quickstart' .* not by this one, 'quickstart'"):
        checkpoint.read_engine_state(copy, validate_config(raw))  # same name, another model


def test_a_changed_config_of_the_same_pipeline_resumes_with_a_warning(copy, tmp_path, caplog):
    fixed = _config(tmp_path, optimizer={"lr": 1e-3})  # e.g. the runbook's "fix, then --resume"
    assert checkpoint.read_engine_state(copy, fixed)["next_step"] == 1
    assert any("changed config of pipeline 'quickstart' (changed: trainer" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_refused_resume_leaves_the_original_mlflow_run_as_it_was(tmp_path):
    import mlflow

    tracking = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "ckpt-safety", "sample_trajectories": 0}
    first = run_pipeline(_config(tmp_path / "out", tracking=tracking, checkpoint_every=1), "", inline=True)
    folder = Path(first.output_dir) / "checkpoints" / "step_1"
    file = folder / "engine.json"
    file.write_bytes(file.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="engine.json"):
        run_pipeline(_config(tmp_path / "out", tracking=tracking), "", inline=True, resume_from=str(folder))
    run = mlflow.MlflowClient(tracking["uri"]).get_run(first.run_id)
    assert run.info.status == "FINISHED"


def test_only_the_newest_k_checkpoints_are_kept(tmp_path):
    result = run_pipeline(_config(tmp_path, steps=5, checkpoint_every=1, keep_checkpoints=2), "",
                          observer=Recorder(), inline=True)
    folders = sorted(p.name for p in (Path(result.output_dir) / "checkpoints").iterdir())
    assert folders == ["step_4", "step_5"]  # step_5: the checkpoint every run writes at its end (for --extend)


def test_a_save_without_enough_free_disk_fails_before_writing(tmp_path, monkeypatch):
    # a full disk cannot be made here without root: the free space is what shutil reports (full under checkpoints/)
    real = shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000)
                        if "checkpoints" in str(path) else real(path))
    with pytest.raises(RlpipeError, match=r"not enough free disk for the checkpoint at .*step_1: about \d+ MiB needed"):
        run_pipeline(_config(tmp_path, checkpoint_every=1), "", observer=Recorder(), inline=True)
    assert not list(tmp_path.glob("*/checkpoints/step_1/*.safetensors"))


def test_a_disk_too_full_for_the_final_model_fails_before_the_first_step(tmp_path, monkeypatch):
    """issue 14: a full disk failed at the final save, after all the training; now before step 0."""
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000))
    observer = Recorder()
    with pytest.raises(RlpipeError, match=r"not enough free disk for the final model at .*: about \d+ MiB needed, "
                                          r"0 MiB free"):
        run_pipeline(_config(tmp_path, steps=3), "", observer=observer, inline=True)
    assert observer.metrics == {} and observer.status == "FAILED"  # no step was trained for nothing


def test_cli_refuses_a_damaged_checkpoint_in_one_line_with_exit_2(copy, capsys, tmp_path):
    from conftest import ROOT
    from rlpipe.cli import main

    (copy / "actor_rank0.json").write_text("{}")
    code = main(["run", str(ROOT / "pipelines" / "quickstart.yaml"), "-o", "tracking.enabled=false",
                 "-o", "data.prompts_per_step=4", "-o", f"trainer.output_dir={tmp_path}", "--resume", str(copy)])
    assert code == 2
    err = capsys.readouterr().err
    assert "actor_rank0.json is" in err and "Traceback" not in err
