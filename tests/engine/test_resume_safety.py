"""--resume of a FINISHED run: refused unless --fork (a new linked run) or --extend (more steps, same run)."""

from __future__ import annotations

import re
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, quickstart_raw
from rlpipe.cli import main
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError

pytestmark = pytest.mark.slow  # whole tracked runs, resumed: make test, not test-fast


def config(out: Path, steps: int, uri: str | None):
    tracking = {"uri": uri, "experiment": "resume-safety", "sample_trajectories": 2} if uri else {"enabled": False}
    return validate_config(quickstart_raw(
        name="safe", data={"prompts_per_step": 4}, tracking=tracking,
        trainer={"total_steps": steps, "output_dir": str(out), "checkpoint_every": 1},
    ))


def model_bytes(folder: Path) -> bytes:
    return (folder / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_safety")
    uri = f"sqlite:///{root}/mlflow.db"
    result = run_pipeline(config(root / "out", 2, uri), "", inline=True)
    return root, uri, result


def test_a_finished_run_is_not_resumed_silently(finished):
    root, uri, first = finished
    final = Path(first.output_dir) / "final"
    before = model_bytes(final)
    end = Path(first.output_dir) / "checkpoints" / "step_2"  # written at the end of the run, for --extend
    assert (end / "manifest.json").is_file()
    for ckpt in (end, end.parent / "step_1"):
        with pytest.raises(ConfigError, match=r"is FINISHED \(2 steps.*Pass --fork .* or --extend"):
            run_pipeline(config(root / "out", 2, uri), "", inline=True, resume_from=str(ckpt))
    assert model_bytes(final) == before
    assert MlflowClient(uri).get_run(first.run_id).info.status == "FINISHED"
    with pytest.raises(ConfigError, match=r"raise it \(e.g. -o trainer.total_steps=4\)"):
        run_pipeline(config(root / "out", 2, uri), "", inline=True, resume_from=str(end), extend=True)
    with pytest.raises(ConfigError, match="exclude each other"):
        run_pipeline(config(root / "out", 3, uri), "", inline=True, resume_from=str(end), extend=True, fork=True)


def test_fork_starts_a_new_run_linked_to_the_old_one(finished):
    root, uri, first = finished
    final_before = model_bytes(Path(first.output_dir) / "final")
    ckpt = Path(first.output_dir) / "checkpoints" / "step_1"
    fork = run_pipeline(config(root / "out", 3, uri), "", inline=True, resume_from=str(ckpt), fork=True)
    assert fork.run_id != first.run_id and fork.output_dir != first.output_dir
    assert fork.steps == 2  # steps 1 and 2
    client = MlflowClient(uri)
    tags = client.get_run(fork.run_id).data.tags
    assert tags["rlpipe.forked_from"] == first.run_id and tags["rlpipe.forked_from_checkpoint"] == str(ckpt)
    assert sorted(m.step for m in client.get_metric_history(fork.run_id, "reward/mean")) == [1, 2]
    assert model_bytes(Path(first.output_dir) / "final") == final_before  # the old run is untouched
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "reward/mean")) == [0, 1]


def rlpipe_run(root: Path, uri: str, steps: int, *extra: str) -> tuple[int, str, str]:
    """``rlpipe run`` of the quickstart as the fixture configured it (in this process); exit code, stdout, stderr."""
    args = ["run", str(ROOT / "pipelines" / "quickstart.yaml"), "--inline", "-o", "name=safe",
            "-o", "data.prompts_per_step=4", "-o", f"trainer.total_steps={steps}", "-o", f"trainer.output_dir={root / 'out'}",
            "-o", "trainer.checkpoint_every=1", "-o", f"tracking.uri={uri}", "-o", "tracking.experiment=resume-safety",
            "-o", "tracking.sample_trajectories=2", *extra]
    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), " ".join(err.getvalue().split())


def test_the_cli_refuses_with_exit_2_and_says_what_to_pass(finished):
    root, uri, first = finished
    ckpt = Path(first.output_dir) / "checkpoints" / "step_2"
    code, out, err = rlpipe_run(root, uri, 2, "--resume", str(ckpt))
    assert code == 2 and "is FINISHED (2 steps" in err and "--fork" in err and "--extend" in err
    assert "done:" not in out


def test_extend_adds_steps_to_the_same_run_and_keeps_its_old_model(finished):
    root, uri, first = finished
    out = Path(first.output_dir)
    old_final = model_bytes(out / "final")
    code, printed, _ = rlpipe_run(root, uri, 3, "--resume", str(out / "checkpoints" / "step_2"), "--extend")
    assert code == 0
    assert re.search(r"^done: 1 steps in ", printed, re.M), printed  # only step 2 ran, and the summary says so
    assert f"MLflow run id: {first.run_id}" in printed
    assert model_bytes(out / "final_step_2") == old_final and (out / "final").is_dir()
    run = MlflowClient(uri).get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlpipe.extended_to"] == "3"
    assert sorted(m.step for m in MlflowClient(uri).get_metric_history(first.run_id, "reward/mean")) == [0, 1, 2]


def test_without_tracking_the_final_model_marks_a_finished_run(tmp_path):
    first = run_pipeline(config(tmp_path, 1, None), "", inline=True)
    with pytest.raises(ConfigError, match=r"is FINISHED \(1 steps"):
        run_pipeline(config(tmp_path, 1, None), "", inline=True,
                     resume_from=str(Path(first.output_dir) / "checkpoints" / "step_1"))


def test_a_default_pipeline_crashed_mid_run_resumes_with_resume_latest(tmp_path):
    """issue 23 item 5: checkpoints are on by default (every DEFAULT_CHECKPOINT_EVERY steps); a run that crashes
    after step 52 goes on with `--resume latest` from step 50, in the same output folder."""
    from rlpipe.schemas.config import DEFAULT_CHECKPOINT_EVERY

    args = ["run", str(ROOT / "pipelines" / "quickstart.yaml"), "--inline", "-o", "name=crashy",
            "-o", "data.prompts_per_step=2", "-o", "stages.generate.params.n=2", "-o", "tracking.enabled=false",
            "-o", "trainer.total_steps=55", "-o", f"trainer.output_dir={tmp_path}"]
    err = StringIO()
    with redirect_stdout(StringIO()), redirect_stderr(err):
        assert main([*args, "--resume", "latest"]) == 2  # nothing to resume yet: one line saying so
    assert "--resume latest: no complete checkpoint of pipeline 'crashy'" in " ".join(err.getvalue().split())

    raw = quickstart_raw(name="crashy", data={"prompts_per_step": 2}, tracking={"enabled": False},
                         trainer={"total_steps": 55, "output_dir": str(tmp_path)})
    raw["stages"][0]["params"] = {**raw["stages"][0]["params"], "n": 2}
    config = validate_config(raw)
    assert config.trainer.checkpoint_every == DEFAULT_CHECKPOINT_EVERY == 50

    def crash(step, metrics):
        if step == 52:
            raise RuntimeError("the machine went away")

    with pytest.raises(RuntimeError, match="went away"):
        run_pipeline(config, "", inline=True, on_step=crash)
    [run_dir] = tmp_path.glob("crashy-*")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_50"]

    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*args, "--resume", "latest"])
    printed = out.getvalue() + err.getvalue()
    assert code == 0, printed
    assert f"resuming from {run_dir / 'checkpoints' / 'step_50'}" in " ".join(printed.split())
    assert re.search(r"done: 5 steps in ", printed), printed  # steps 50-54: at most the interval was lost
    assert (run_dir / "final").is_dir() and (run_dir / "checkpoints" / "step_55").is_dir()
