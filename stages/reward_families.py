"""The ``reward`` stage, impl ``weighted``: rule + discriminative RM + generative judge, weighted.

A hybrid reward stack (SPEC R4): each configured family scores every row and writes its
own column, and ``reward = Σ_f weights[f] · score_f`` over the configured families:

=================  ===============  ======================================================
family             column           scorer
=================  ===============  ======================================================
``rule``           reward_rule      the ``rule`` impl's routing by data_source, or a
                                    custom ``function`` (:mod:`rlpipe.stages.reward`)
``reward_model``   reward_rm        one forward pass of a reward model, score at the last
                                    valid token (:mod:`rlpipe.stages.reward_model`)
``judge``          judge_score      a judge model's parsed score, pointwise or group-wise
                   judge_hacked     (:mod:`rlpipe.stages.judge`); group-wise flags feed
                                    the ``grpo_gar`` advantage (:mod:`rlpipe.stages.gar`)
=================  ===============  ======================================================

Each family's mean is reported as ``reward/<family>/mean``. The models live on the
``reward_model`` worker role — the independent reward pool, ``pool_size`` Ray actors of
its own (:mod:`rlpipe.engine.state.reward_pool`), apart from the rollout and the trainer,
so the async modes accept it; in separate_async the rollout feeders call it without
waiting. A row gets ``status = "failed"`` and reward 0 — an infrastructure failure, left
out of DAPO and the advantages and counted in ``reward/infra_failures`` — when its rule
scorer hit an infrastructure failure (a sandbox that died), the reward model missed its
``timeout_s`` or gave a non-finite score, the judge could not grade it (``timeout_s``,
unparsable text), or, in separate_async, its pool worker did not answer within
``call_timeout_s`` or died (:func:`unanswered`, ``reward/pool_unanswered``).

``routes`` picks the families per ``data_source`` (e.g. math rows by the rule only, chat
rows by RM and judge); the rule family routes further to its scorers by data_source.

Left out: overlapping the RM's forward pass with the judge's decoding inside one worker.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, model_validator

from rlpipe.deadline import StageTimeout, call_with_deadline
from rlpipe.jagged import last_token_placement
from rlpipe.schemas.batch import (
    DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, REWARD, STATUS, STATUS_FAILED, TOKEN_REWARDS, UID,
)
from rlpipe.stage import StageContext, StageParams, StageResult, Unreachable, cols, stage
from rlpipe.stages.gar import JUDGE_HACKED, JUDGE_SCORE
from rlpipe.stages.judge import JudgeConfig, groupwise_scores, pointwise_scores
from rlpipe.stages.reward import RuleRewardParams, _rule_reads, rule_reward
from rlpipe.stages.reward_model import RewardModelConfig, decode_pairs

REWARD_RULE = "reward_rule"
"""The rule family's score of a row (float32)."""
REWARD_RM = "reward_rm"
"""The discriminative reward model's score of a row (float32)."""
FAMILIES = ("rule", "reward_model", "judge")
Family = Literal["rule", "reward_model", "judge"]

log = logging.getLogger(__name__)

COUNTS = frozenset({"reward/infra_failures", "reward/pool_unanswered", "reward/judge/ungraded",
                    "reward/reward_model/timeouts", "reward/reward_model/non_finite", "reward/scorer_timeouts"})
"""Metrics of this stage that count rows or calls: summed over the pool's workers."""


class WeightedRewardParams(StageParams):
    """Which reward families score, with what weight, on how many pool workers."""

    rule: RuleRewardParams | None = None
    """Rule-based scoring (routes / scorers / a custom function); None = no rule family."""
    reward_model: RewardModelConfig | None = None
    """Discriminative reward model; None = none."""
    judge: JudgeConfig | None = None
    """Generative judge; None = none."""
    weights: dict[str, float] = Field(default_factory=lambda: {f: 1.0 for f in FAMILIES})
    """Weight per family (rule, reward_model, judge); a configured family missing here weighs 0."""
    routes: dict[str, list[Family]] = Field(default_factory=dict)
    """data_source → the families that score its rows, e.g. {gsm8k: [rule], chat: [reward_model, judge]};
    a data_source not listed is scored by every configured family. Unused families score 0 on a row."""
    pool_size: int = Field(1, ge=1)
    """Reward-pool workers (Ray actors of the `reward_model` role); rows are split evenly among them."""
    call_timeout_s: float = Field(300.0, gt=0)
    """Longest the separate_async rollout feeder waits for one pool call (its share of rows on one worker);
    past it, or when the worker died, those rows are infrastructure failures (status `failed`, counted in
    reward/pool_unanswered) and the rollout goes on. Keep it above judge.timeout_s + reward_model.timeout_s."""

    @model_validator(mode="after")
    def _families(self) -> "WeightedRewardParams":
        unknown = sorted(set(self.weights) - set(FAMILIES))
        if unknown:
            raise ValueError(f"weights name unknown families {unknown}; families: {', '.join(FAMILIES)}")
        if not self.configured:
            raise ValueError("configure at least one reward family: `rule`, `reward_model` or `judge`")
        for source, families in self.routes.items():
            missing = sorted(set(families) - set(self.configured))
            if missing or not families:
                what = f"families {missing} are not configured" if missing else "empty"
                raise ValueError(f"routes.{source}: {what}; list some of the configured families {self.configured} "
                                 "or configure them")
        inner = sum(f.timeout_s for f in (self.judge, self.reward_model) if f is not None)
        if self.call_timeout_s <= inner:
            raise ValueError(f"call_timeout_s={self.call_timeout_s:g} must exceed judge.timeout_s + "
                             f"reward_model.timeout_s = {inner:g} (else every slow-but-answering call is dropped); "
                             "raise call_timeout_s")
        return self

    @property
    def configured(self) -> list[str]:
        return [f for f in FAMILIES if getattr(self, f) is not None]


def _reads(p: WeightedRewardParams) -> dict[str, pa.DataType]:
    routed = (DATA_SOURCE,) if p.routes else ()
    out = cols(STATUS, RESPONSE_MASK, PROMPT_IDS, RESPONSE_IDS, GROUND_TRUTH, UID, *routed)
    return {**out, **(_rule_reads(p.rule) if p.rule is not None else {})}


def _writes(p: WeightedRewardParams) -> dict[str, pa.DataType]:
    out = cols(REWARD, TOKEN_REWARDS, STATUS)
    if p.rule is not None:
        out[REWARD_RULE] = pa.float32()
    if p.reward_model is not None:
        out[REWARD_RM] = pa.float32()
    if p.judge is not None:
        out.update({JUDGE_SCORE: pa.float32(), JUDGE_HACKED: pa.int8()})
    return out


def judge_columns(judge, batch: pa.Table, texts: list[str], tokenizer, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(judge_score with NaN where ungraded, hacked flags) of ``rows`` (others NaN / False)."""
    prompts = [tokenizer.decode(p, skip_special_tokens=True) for p in batch.column(PROMPT_IDS).to_pylist()]
    responses = [t[len(p):] for t, p in zip(texts, prompts)]
    truths = [g or "" for g in batch.column(GROUND_TRUTH).to_pylist()]
    scores, hacked = np.full(batch.num_rows, np.nan, np.float32), np.zeros(batch.num_rows, bool)
    if not rows.size:
        return scores, hacked
    if judge.cfg.mode == "pointwise":
        scores[rows] = pointwise_scores(judge, [prompts[i] for i in rows], [responses[i] for i in rows],
                                        [truths[i] for i in rows])
        return scores, hacked
    uids = np.asarray(batch.column(UID).to_pylist(), dtype=object)[rows]
    groups = [rows[uids == u] for u in dict.fromkeys(uids)]
    return groupwise_scores(judge, groups, prompts, responses, truths)


def family_rows(batch: pa.Table, params: WeightedRewardParams) -> dict[str, np.ndarray]:
    """Per configured family, which rows it scores (``routes`` by data_source; all rows by default)."""
    if not params.routes:
        return {f: np.ones(batch.num_rows, bool) for f in params.configured}
    sources = np.asarray(pc.fill_null(batch.column(DATA_SOURCE), "").to_pylist(), dtype=object)
    out = {}
    for family in params.configured:
        routed_away = [s for s, families in params.routes.items() if family not in families]
        out[family] = ~np.isin(sources, routed_away)
    return out


def unanswered(batch: pa.Table, params: WeightedRewardParams, why: str) -> StageResult:
    """The result for rows no pool worker scored (call past ``call_timeout_s``, worker dead): all failed, 0."""
    log.warning("reward pool: %d rows unscored (%s); they are marked failed", batch.num_rows, why)
    n = batch.num_rows
    zeros = pa.array(np.zeros(n, np.float32))
    columns = {REWARD: zeros, TOKEN_REWARDS: last_token_placement(np.zeros(n, np.float32), batch.column(RESPONSE_MASK)),
               STATUS: pa.array([STATUS_FAILED] * n, pa.string())}
    for family, column in (("rule", REWARD_RULE), ("reward_model", REWARD_RM), ("judge", JUDGE_SCORE)):
        if getattr(params, family) is not None:
            columns[column] = zeros
    if params.judge is not None:
        columns[JUDGE_HACKED] = pa.array(np.zeros(n, np.int8), pa.int8())
    return StageResult(columns=columns, metrics={"reward/infra_failures": float(n), "reward/pool_unanswered": float(n)},
                       counts=COUNTS)


@stage("reward", "weighted", placement="worker", role="reward_model", params=WeightedRewardParams,
       reads=_reads, writes=_writes, unreachable=Unreachable(timeout_s=lambda p: p.call_timeout_s, result=unanswered))
def weighted_reward(pool, batch: pa.Table, params: WeightedRewardParams, ctx: StageContext) -> StageResult:
    """A weighted sum of reward families: rule scorers, a discriminative reward model, a generative judge."""
    status = batch.column(STATUS)
    failed = pc.fill_null(pc.equal(status, STATUS_FAILED), False).to_numpy(zero_copy_only=False).copy()
    columns: dict[str, pa.Array] = {}
    metrics: dict[str, float] = {}
    family_scores: dict[str, np.ndarray] = {}
    uses = family_rows(batch, params)
    if params.rule is not None:
        rows = np.flatnonzero(uses["rule"])
        rule = rule_reward(batch.take(pa.array(rows)), params.rule, ctx)
        family_scores["rule"] = np.zeros(batch.num_rows, np.float32)
        family_scores["rule"][rows] = rule.columns[REWARD].to_numpy(zero_copy_only=False)
        failed[rows] |= np.asarray(rule.columns[STATUS].to_pylist(), dtype=object) == STATUS_FAILED
        metrics.update({k: v for k, v in rule.metrics.items() if k != "reward/mean"})
    live = np.flatnonzero(~failed & uses.get("reward_model", False))
    texts = decode_pairs(batch.column(PROMPT_IDS), batch.column(RESPONSE_IDS), batch.column(RESPONSE_MASK),
                         pool.tokenizer) if (params.reward_model or params.judge) else []
    if params.reward_model is not None:
        rm = np.zeros(batch.num_rows, np.float32)
        try:
            if live.size:
                rm[live] = call_with_deadline(lambda: pool.reward_model.score([texts[i] for i in live]),
                                              params.reward_model.timeout_s, "the reward model")
            metrics["reward/reward_model/timeouts"] = 0.0
        except StageTimeout:  # the forward pass is abandoned (a thread cannot be stopped); its rows fail
            log.warning("reward model gave no scores for %d rows within reward_model.timeout_s=%g s; those rows are "
                        "marked failed", live.size, params.reward_model.timeout_s)
            failed[live] = True
            metrics["reward/reward_model/timeouts"] = 1.0
        bad = ~np.isfinite(rm) & ~failed  # a broken RM (NaN/inf) must not reach the advantage
        failed |= bad
        metrics["reward/reward_model/non_finite"] = float(bad.sum())
        family_scores["reward_model"] = rm
    live = np.flatnonzero(~failed & uses.get("judge", False))
    if params.judge is not None:
        judged, hacked = judge_columns(pool.judge, batch, texts, pool.tokenizer, live)
        ungraded = ~np.isfinite(judged) & ~failed & uses["judge"]  # no score, or a number too long for a float
        failed |= ungraded
        metrics["reward/judge/ungraded"] = float(ungraded.sum())
        family_scores["judge"] = np.where(failed, 0.0, judged).astype(np.float32)
        columns[JUDGE_HACKED] = pa.array(hacked.astype(np.int8), pa.int8())
    total = np.zeros(batch.num_rows, np.float64)
    for family, scores in family_scores.items():
        scores = np.where(failed | ~uses[family], 0.0, scores).astype(np.float32)
        total += params.weights.get(family, 0.0) * scores
        columns[{"rule": REWARD_RULE, "reward_model": REWARD_RM, "judge": JUDGE_SCORE}[family]] = pa.array(scores)
        scored = ~failed & uses[family]
        if scored.any():
            metrics[f"reward/{family}/mean"] = float(scores[scored].mean())
    total = np.where(failed, 0.0, total).astype(np.float32)
    columns[REWARD] = pa.array(total, pa.float32())
    columns[TOKEN_REWARDS] = last_token_placement(total, batch.column(RESPONSE_MASK))
    columns[STATUS] = pa.array(np.where(failed, STATUS_FAILED, np.asarray(status.to_pylist(), dtype=object)).tolist(),
                               pa.string())
    metrics["reward/infra_failures"] = float(failed.sum())
    if (~failed).any():
        metrics["reward/mean"] = float(total[~failed].mean())
    return StageResult(columns=columns, metrics=metrics, counts=COUNTS)

