"""Checkpoint and resume: a run interrupted after step 2 and resumed equals the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import Recorder, quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError



def _config(tmp_path: Path, steps: int, shared_filesystem: bool | None = None, **trainer):
    raw = quickstart_raw(data={"prompts_per_step": 4},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path), **trainer})
    raw["resources"] = {"shared_filesystem": shared_filesystem}
    raw["tracking"] = {"enabled": False, "sample_trajectories": 100000}
    raw["stages"].insert(4, {"kind": "ref", "impl": "reference"})
    raw["stages"][-2]["params"] = {**raw["stages"][-2]["params"], "use_kl_loss": True}
    return validate_config(raw)


def _final_weights(result) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(result.output_dir) / "final", local_files_only=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("inline", [True, pytest.param(False, marks=pytest.mark.e2e)])
def test_resumed_run_equals_the_uninterrupted_run(tmp_path, inline, request):
    """The run that wrote the step-2 checkpoint went on, uninterrupted, to step 4: the resumed run equals it.
    In process a third run, with no checkpoints, equals both (writing checkpoints changes nothing). On Ray that
    third run is left out: a checkpoint-free Ray sync run (whose next step's generation starts before the driver
    ends the step) equals the in-process run node by node, checked in tests/engine/test_worker_chains.py.
    On Ray both runs set resources.shared_filesystem: false, as a cluster without shared storage does: the
    trainer's checkpoint files reach the driver, and the resumed trainer, through the object store."""
    if not inline:
        request.getfixturevalue("ray_session")
    shared = None if inline else False
    first = Recorder()
    first_result = run_pipeline(_config(tmp_path / "b", 4, shared, checkpoint_every=2), "", observer=first,
                                inline=inline)
    checkpoint = Path(first_result.output_dir) / "checkpoints" / "step_2"
    assert (checkpoint / "manifest.json").is_file() and (checkpoint / "actor_rank0.safetensors").is_file()
    assert not list(checkpoint.glob("*.pkl")) and not list(checkpoint.glob("*.pt"))

    resumed = Recorder()
    resumed_result = run_pipeline(_config(tmp_path / "c", 4, shared), "", observer=resumed, inline=inline,
                                  resume_from=str(checkpoint))
    assert sorted(resumed.batches) == [2, 3]
    references = [(first, first_result)]
    if inline:
        straight = Recorder()
        references.append((straight, run_pipeline(_config(tmp_path / "a", 4), "", observer=straight, inline=True)))
    resumed_weights = _final_weights(resumed_result)
    for reference, reference_result in references:
        for step in (2, 3):
            for column in ("uid", "response_ids", "reward", "advantages", "old_logprobs", "token_versions"):
                expected = reference.batches[step].column(column)
                assert resumed.batches[step].column(column).equals(expected), (step, column)
            assert resumed.metrics[step]["actor/grad_norm"] == pytest.approx(reference.metrics[step]["actor/grad_norm"])
            assert resumed.metrics[step]["policy_version"] == reference.metrics[step]["policy_version"]
        expected_weights = _final_weights(reference_result)
        assert all(torch.equal(expected_weights[k], resumed_weights[k]) for k in expected_weights)


def test_resume_from_a_folder_that_is_not_a_checkpoint_says_what_to_pass(tmp_path):
    with pytest.raises(ConfigError, match="not a complete rlpipe checkpoint"):
        run_pipeline(_config(tmp_path, 2), "", inline=True, resume_from=str(tmp_path))


@pytest.mark.parametrize("mode,params", [
    ("separate_async", {"max_off_policy_threshold": 2, "strategy": "drop"}),
    ("colocate_async", {}),
])
def test_async_runs_resume_with_in_flight_prompts_reissued(mode, params, tmp_path):
    def config(out, **trainer):
        raw = quickstart_raw(mode=mode, mode_params=params, data={"prompts_per_step": 4},
                             trainer={"total_steps": 4, "output_dir": str(out), **trainer})
        raw["tracking"] = {"enabled": False, "sample_trajectories": 100000}
        raw["stages"].insert(2, {"kind": "staleness_guard", "impl": "max_staleness"})
        return validate_config(raw)

    first = run_pipeline(config(tmp_path / "a", checkpoint_every=2), "", observer=Recorder(), inline=True)
    checkpoint = Path(first.output_dir) / "checkpoints" / "step_2"
    resumed = Recorder()
    run_pipeline(config(tmp_path / "b"), "", observer=resumed, inline=True, resume_from=str(checkpoint))
    assert sorted(resumed.batches) == [2, 3]
    bound = params.get("max_off_policy_threshold", 2)
    for step, batch in resumed.batches.items():
        assert batch.num_rows == 4 * 8
        assert max(step - batch.column("prompt_step").to_numpy() + 1) <= bound
