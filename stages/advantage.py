"""The ``advantage`` stage: one implementation per registered advantage estimator.

Each estimator of :mod:`rlpipe.stages.algos.advantages` (gae, grpo, dr_grpo,
grpo_passk, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo,
gpg, gdpo) and :mod:`rlpipe.stages.algos.advantages_otb` (optimal_token_baseline,
tir_optimal_token_baseline) becomes the impl of the same name. The stage reads
``token_rewards``, ``response_mask`` and ``uid`` (plus ``values`` for gae,
``reward_baseline`` for remax, the ``reward_keys`` columns for gdpo, ``old_logprobs`` and
``sum_pi_squared`` — and ``is_weights`` with ``use_is_weights`` — for the optimal token
baselines) and writes ``advantages`` and ``returns``.

Infra-failure rows (``status == "failed"``) are left out of every group
statistic and get zero advantages (``exclude_failed``); their ``token_rewards``
may be null. With
``use_kl_in_reward`` the rewards first lose ``kl_coef · KL(π_old‖π_ref)`` per
token (verl's ``apply_kl_penalty``; reads ``old_logprobs`` and ``ref_logprobs``).
The adaptive controller's coefficient is carried across steps by the engine:
the stage uses the coefficient it carried from its previous step (``ctx.carry``,
else ``kl_ctrl.kl_coef``) and carries the next one forward (``StageResult.carry``,
kept by the engine between steps); both are reported as metrics.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, field_validator

from rlpipe.errors import ConfigError, RlpipeError
from rlpipe.schemas.batch import ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, RESPONSE_MASK, RETURNS, STATUS, TOKEN_REWARDS
from rlpipe.schemas.batch import IS_WEIGHTS, SUM_PI_SQUARED, UID, VALUES
from rlpipe.stage import StageContext, StageParams, StageResult, cols, stage
from rlpipe.stages.algos import advantages_otb  # noqa: F401  (registers the optimal token baselines)
from rlpipe.stages.algos import batch_io as io
from rlpipe.stages.algos.advantages import BUILTIN_ESTIMATORS, Estimator
from rlpipe.stages.algos.critic_loss import explained_variance
from rlpipe.stages.algos.kl import KLControlConfig, check_kl_name, kl_in_reward, next_kl_coef
from rlpipe.stages.algos.ops import group_ids, masked_mean

REWARD_BASELINE = "reward_baseline"
"""ReMax: score of the greedy response of the row's prompt (float32 scalar column)."""
_EXTRA_COLUMNS = {  # an estimator's extra input → the columns it reads (given the params)
    "values": lambda p: cols(VALUES),
    "reward_baselines": lambda p: {REWARD_BASELINE: pa.float32()},
    "reward_components": lambda p: {key: pa.float32() for key in p.reward_keys},
    "old_log_probs": lambda p: cols(OLD_LOGPROBS),
    "sum_pi_squared": lambda p: cols(SUM_PI_SQUARED),
    "is_weights": lambda p: cols(IS_WEIGHTS) if p.use_is_weights else {},
}
_EXTRA_INPUTS = {  # an estimator's extra input → its tensor (None: not given)
    "values": lambda batch, p, width: io.padded(batch, VALUES, width),
    "reward_baselines": lambda batch, p, width: io.scalar(batch, REWARD_BASELINE),
    "reward_components": lambda batch, p, width: (
        torch.stack([io.scalar(batch, key) for key in p.reward_keys], dim=-1) if p.reward_keys else None),
    "old_log_probs": lambda batch, p, width: io.padded(batch, OLD_LOGPROBS, width),
    "sum_pi_squared": lambda batch, p, width: io.padded(batch, SUM_PI_SQUARED, width),
    "is_weights": lambda batch, p, width: io.padded(batch, IS_WEIGHTS, width) if p.use_is_weights else None,
}


class AdvantageStageParams(StageParams):
    """Settings shared by every advantage impl."""

    exclude_failed: bool = True
    """Rows with status "failed" (infra failures) get zero advantages and stay out of group statistics."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef · KL(π_old‖π_ref) from the token rewards first (needs a `ref` stage)."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3 ('+' variants allowed)."""
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    """Fixed or adaptive coefficient of the reward penalty."""

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl(cls, name: str) -> str:
        if name == "full":
            raise ValueError(
                "kl_penalty 'full' needs full-vocabulary log-probs, which a batch does not carry; use k1, k2 or k3"
            )
        try:
            return check_kl_name(name)
        except RlpipeError as exc:
            raise ValueError(str(exc)) from None


def _reads(est: Estimator):
    def reads(p: AdvantageStageParams) -> dict[str, pa.DataType]:
        out = cols(TOKEN_REWARDS, RESPONSE_MASK, UID)
        for need in est.needs:
            out.update(_EXTRA_COLUMNS[need](p))
        if p.exclude_failed:
            out.update(cols(STATUS))
        if p.use_kl_in_reward:
            out.update(cols(OLD_LOGPROBS, REF_LOGPROBS))
        return out

    return reads


def _extra_inputs(est: Estimator, batch: pa.Table, params, width: int) -> dict[str, torch.Tensor]:
    given = {need: _EXTRA_INPUTS[need](batch, params, width) for need in est.needs}
    return {need: tensor for need, tensor in given.items() if tensor is not None}


def _penalize(batch, p, ctx, rewards, mask) -> tuple[torch.Tensor, dict[str, float]]:
    width = mask.shape[1]
    coef = float(ctx.carry.get("kl_coef", p.kl_ctrl.kl_coef))
    old, ref = io.padded(batch, OLD_LOGPROBS, width), io.padded(batch, REF_LOGPROBS, width)
    rewards, current_kl = kl_in_reward(rewards, old, ref, mask, p.kl_penalty, coef)
    nxt = next_kl_coef(p.kl_ctrl, coef, current_kl, n_steps=batch.num_rows)
    return rewards, {"reward_kl_penalty": current_kl, "kl_coef": coef, "kl_coef_next": nxt}


def _make_impl(name: str, est: Estimator):
    def run(batch: pa.Table, params: AdvantageStageParams, ctx: StageContext) -> StageResult:
        lens = io.response_lengths(batch)
        mask = io.mask_tensor(batch)
        rewards = io.padded(batch, TOKEN_REWARDS, mask.shape[1], allow_null=True)
        metrics: dict[str, float] = {}
        if params.use_kl_in_reward:
            rewards, metrics = _penalize(batch, params, ctx, rewards, mask)
        failed = io.failed_rows(batch) if params.exclude_failed else np.zeros(batch.num_rows, bool)
        rows = torch.from_numpy(np.flatnonzero(~failed))
        extra = {k: v[rows] for k, v in _extra_inputs(est, batch, params, mask.shape[1]).items()}
        group = group_ids(io.uids(batch)[~failed])
        adv, ret = torch.zeros_like(mask), torch.zeros_like(mask)
        if rows.numel():
            adv[rows], ret[rows] = est(rewards[rows], mask[rows], group, params, **extra)
        metrics.update(_summary(adv, ret, mask, failed))
        if "values" in extra:
            metrics["vf_explained_var"] = explained_variance(extra["values"], ret[rows], mask[rows])
        columns = {ADVANTAGES: io.jagged(adv, lens), RETURNS: io.jagged(ret, lens)}
        carry = {"kl_coef": metrics["kl_coef_next"]} if "kl_coef_next" in metrics else {}
        return StageResult(columns=columns, metrics={f"advantage/{k}": v for k, v in metrics.items()}, carry=carry)

    run.__name__ = run.__qualname__ = f"advantage_{name}"
    run.__doc__ = est.fn.__doc__  # what `rlpipe stages` says of the impl
    # Its fields and their docstrings come from the two bases; reading docstrings again would make pydantic search
    # every loaded module for this class's source (inspect.getmodule), in every process that imports the builtins.
    params = type(f"{name.title().replace('_', '')}AdvantageParams", (est.params, AdvantageStageParams), {
        "__doc__": f"Params of the `{name}` advantage estimator.", "__module__": __name__,
        "model_config": {**AdvantageStageParams.model_config, "use_attribute_docstrings": False},
    })  # fmt: skip
    check = _needs_groups(name) if est.grouped else None
    stage("advantage", name, reads=_reads(est), writes=cols(ADVANTAGES, RETURNS), params=params, check=check)(run)
    return run


def _needs_groups(name: str):
    def check(params, config, plan) -> None:
        generate = plan.node("generate")
        n = getattr(generate.params, "n", None) if generate else None
        if isinstance(n, int) and n < 2:
            raise ConfigError(
                f"advantage {name!r} compares each sample with the other samples of its prompt, but "
                f"stages[{generate.name}].params.n is {n}: set it to 2 or more "
                "(or pick a non-group estimator: gae, reinforce_plus_plus, remax)"
            )

    return check


def _summary(adv, ret, mask, failed) -> dict[str, float]:
    valid = mask.clone()
    valid[torch.from_numpy(failed)] = 0
    has = bool(valid.sum() > 0)
    return {
        "advantages_mean": float(masked_mean(adv, valid)),
        "advantages_max": float(adv[valid.bool()].max()) if has else 0.0,
        "advantages_min": float(adv[valid.bool()].min()) if has else 0.0,
        "returns_mean": float(masked_mean(ret, valid)),
        "failed_rows": float(failed.sum()),
    }


IMPLS = {name: _make_impl(name, est) for name, est in BUILTIN_ESTIMATORS.items()}
