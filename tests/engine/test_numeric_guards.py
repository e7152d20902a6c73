"""Numbers are guarded (issue 14, part 2): non-finite config numbers are refused by validate, a
diverging update stops the run before its weight push, and failed rows never pass for zero rewards."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import Recorder, quickstart_raw
from rlpipe.cli import main
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError, RlpipeError, StageError
from rlpipe.stages.scorers import SCORERS, ScorerInfraError


@SCORERS.register("test_sandbox_down")
def _sandbox_down(responses, ground_truths):
    raise ScorerInfraError("sandbox unreachable")


@SCORERS.register("test_half_down")
def _half_down(responses, ground_truths):
    n = len(responses)
    failed = np.arange(0, n, 2)
    raise ScorerInfraError("every other sandbox is down", failed=failed, scores=np.ones(n))


def _raw(tmp_path, steps=2, **trainer):
    raw = quickstart_raw(data={"prompts_per_step": 4},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path), **trainer})
    raw["tracking"] = {"enabled": False}
    return raw


# --- config numbers ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_lr_is_refused_naming_the_field(value, tmp_path):
    raw = _raw(tmp_path)
    raw["trainer"]["optimizer"] = {"lr": value}
    with pytest.raises(ConfigError, match=r"trainer\.optimizer\.lr: must be a finite number"):
        validate_config(raw)


def test_validate_refuses_inf_lr_written_in_yaml(capsys):
    assert main(["validate", str(_quickstart()), "-o", "trainer.optimizer.lr=.inf"]) == 2
    assert "trainer.optimizer.lr: must be a finite number" in capsys.readouterr().err


def test_a_non_finite_stage_param_is_refused_naming_the_param(tmp_path):
    raw = _raw(tmp_path)
    raw["stages"][-2]["params"]["clip_ratio"] = float("nan")
    with pytest.raises(ConfigError, match=r"stages\.update\.params\.clip_ratio: must be a finite number|"
                                          r"update.*clip_ratio: must be a finite number"):
        build_plan(validate_config(raw))


def _quickstart():
    from conftest import ROOT

    return ROOT / "pipelines" / "quickstart.yaml"


# --- updates -------------------------------------------------------------------------------------

class PushCounter(Recorder):
    def __init__(self):
        super().__init__()
        self.pushes = 0

    def on_node_end(self, record):
        super().on_node_end(record)
        self.pushes += record.kind == "weight_sync"


@pytest.mark.parametrize("lr,message", [
    # weights blown up by the first update make the next one's gradient norm nan, or already its loss non-finite:
    # which one depends on the CPU's float kernels (the loss on this AVX-512 machine, the gradient on CI's)
    (1e30, r"NumericalError: local update \d+: (the gradient norm is nan|the loss is non-finite)"),
    (1e6, r"NumericalError: the gradient norm was 0 for 3 consecutive updates although the advantages were not all 0"),
])
def test_a_blown_up_update_stops_before_the_weight_push_and_fails_the_run(lr, message, tmp_path):
    observer = PushCounter()
    config = validate_config(_raw(tmp_path, steps=8, optimizer={"lr": lr}, grad_clip=None))
    with pytest.raises(StageError, match=r"stage 'update' \(impl 'ppo'\) failed at step (\d+): " + message
                       + r".*trainer\.optimizer\.lr") as caught:
        run_pipeline(config, "", observer=observer, inline=True)
    assert observer.status == "FAILED"
    assert observer.pushes == caught.value.step  # the failing step pushed nothing: bad weights never reach the rollout
    assert not list(tmp_path.glob("*/final"))
    if lr == 1e6:  # the alarm metric rose on the steps before the one that failed
        streaks = [observer.metrics[step]["actor/zero_grad_streak"] for step in sorted(observer.metrics)]
        assert 0 < streaks[-1] < 3 and streaks == sorted(streaks), streaks


def test_a_nan_loss_fails_naming_the_step_or_is_skipped_with_an_alarm(tmp_path, monkeypatch):
    import rlpipe.stages.update as update

    real = update.actor_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(update, "actor_loss", nan_loss)
    with pytest.raises(StageError, match=r"failed at step 0: NumericalError: local update 0: the loss is non-finite"):
        run_pipeline(validate_config(_raw(tmp_path / "a")), "", observer=Recorder(), inline=True)

    observer = PushCounter()
    run_pipeline(validate_config(_raw(tmp_path / "b", on_nonfinite="skip")), "", observer=observer, inline=True)
    assert observer.status == "FINISHED"
    for step in (0, 1):
        assert observer.metrics[step]["actor/nonfinite_alarm"] == 1.0
    assert observer.metrics[1]["actor/skipped_updates"] == 2.0


# --- failed rows ---------------------------------------------------------------------------------

def _routed(raw, scorer):
    raw["stages"][1]["params"] = {"routes": {"digits": scorer}}
    return raw


def test_reward_mean_averages_valid_rows_only_and_counts_failed_rows(tmp_path):
    observer = Recorder()
    run_pipeline(validate_config(_routed(_raw(tmp_path), "test_half_down")), "", observer=observer, inline=True)
    for step in (0, 1):
        assert observer.metrics[step]["reward/failed_rows"] == 16.0  # 4 prompts × 8 samples, every other one
        assert observer.metrics[step]["reward/mean"] == 1.0  # not 0.5: failed rows are not zeros


def test_all_failed_steps_warn_then_fail_the_run(tmp_path, caplog):
    observer = Recorder()
    config = validate_config(_routed(_raw(tmp_path, steps=5, max_failed_steps=3), "test_sandbox_down"))
    with pytest.raises(RlpipeError, match=r"steps 0-2: every row of 3 consecutive steps is an infrastructure failure"):
        run_pipeline(config, "", observer=observer, inline=True)
    assert observer.status == "FAILED"
    assert sorted(observer.metrics) == [0, 1, 2]  # the third step is recorded, then ends the run
    assert all("reward/mean" not in m and m["reward/failed_rows"] == 32.0 for m in observer.metrics.values())
    assert sum("all 32 rows failed" in r.getMessage() for r in caplog.records) == 3
