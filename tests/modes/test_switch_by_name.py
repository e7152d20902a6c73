"""A pipeline switches advantage estimator and policy loss by name, and each one trains a step."""

from __future__ import annotations

import math

import pytest

from conftest import Recorder, quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline
from rlpipe.registry import registry


ESTIMATORS = ["gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "gdpo", "optimal_token_baseline",
              "tir_optimal_token_baseline"]
LOSSES = ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro",
          "bypass_mode"]
# Params a loss requires besides its name.
LOSS_PARAMS = {"dro": {"dro_beta": 0.1}, "bypass_mode": {"bypass": {"loss_type": "reinforce"}}}

# Params an estimator needs on the quickstart's stages, by kind.
STAGE_PARAMS = {name: {"old_log_prob": {"sum_pi_squared": True}}
                for name in ("optimal_token_baseline", "tir_optimal_token_baseline")}

# Stages an estimator needs besides the quickstart's (what writes the columns it reads).
NEEDS = {
    "gae": [{"kind": "critic_values", "impl": "critic"}, {"kind": "critic_update", "impl": "ppo"}],
    "remax": [{"kind": "reward", "impl": "remax_baseline", "name": "baseline", "params": {"max_tokens": 2}}],
}


def _one_step(tmp_path, advantage: str = "grpo", policy_loss: str = "vanilla") -> dict:
    raw = quickstart_raw(data={"prompts_per_step": 2}, trainer={"total_steps": 1, "output_dir": str(tmp_path)})
    raw["tracking"] = {"enabled": False, "sample_trajectories": 100000}
    stages = []
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage = {**stage, "params": {**stage["params"], "n": 4}}
        extra = STAGE_PARAMS.get(advantage, {}).get(stage["kind"])
        if extra:
            stage = {**stage, "params": {**stage.get("params", {}), **extra}}
        if stage["kind"] == "advantage":
            stage = {"kind": "advantage", "impl": advantage}
        if stage["kind"] == "update":
            stage = {**stage, "params": {"policy_loss": policy_loss, **LOSS_PARAMS.get(policy_loss, {})}}
        stages.append(stage)
    raw["stages"] = stages + NEEDS.get(advantage, [])
    rec = Recorder()
    run_pipeline(validate_config(raw), "", observer=rec, inline=True)
    return rec


def test_the_names_users_know_are_registered():
    assert set(ESTIMATORS) <= set(registry("advantage_estimator").names())
    assert set(LOSSES) <= set(registry("policy_loss").names())


@pytest.mark.parametrize("name", ESTIMATORS)
def test_switch_advantage_estimator(name, tmp_path):
    rec = _one_step(tmp_path, advantage=name)
    advantages = rec.batches[0].column("advantages").combine_chunks().flatten().to_numpy()
    assert advantages.size and all(math.isfinite(a) for a in advantages)
    assert math.isfinite(rec.metrics[0]["actor/grad_norm"])
    if name == "gae":
        assert "critic/vf_loss" in rec.metrics[0] or any(k.startswith("critic/") for k in rec.metrics[0])


@pytest.mark.parametrize("name", LOSSES)
def test_switch_policy_loss(name, tmp_path):
    rec = _one_step(tmp_path, policy_loss=name)
    assert math.isfinite(rec.metrics[0]["actor/pg_loss"])
    assert math.isfinite(rec.metrics[0]["actor/grad_norm"])
