"""The ``reward`` stage, impl ``rule``: rule-based scores routed by ``data_source``.

Every row goes to one scorer (:mod:`rlpipe.stages.scorers`): ``routes`` maps a
data_source to a scorer name, a data_source that is itself a scorer name uses that
scorer, anything else uses ``default_scorer`` or is an error. Rows are scored one
scorer at a time (each scorer sees all of its rows at once, so it can vectorize or
fan out). The sequence score is written as ``reward`` and placed on the last
``response_mask == 1`` token as ``token_rewards`` (verl's reward placement).

Rows whose scorer reports an infrastructure failure (:class:`ScorerInfraError`),
or whose scorer call runs past ``scorer_timeout_s``, get ``status = "failed"`` and
reward 0: downstream they are excluded from group filtering and advantages instead
of being taught as wrong. Rows already failed are not scored. Other statuses (ok, truncated) are scored as they are.

The scorer timeout: each scorer call runs in a daemon thread that the stage waits
on for ``scorer_timeout_s``. Scorers are in-process callables (built-ins, plugins,
closures registered by a test), so a separate process could not always find them,
and forking a multi-threaded Ray worker can deadlock the child; a thread can run
any of them. A thread cannot be killed, so a scorer that never returns is
*abandoned*: the wait is bounded, its rows are marked failed (counted in
``reward/scorer_timeouts``), and the thread ends with its process (a daemon thread
never keeps a process alive). A scorer that needs hard limits on what it runs
(time, memory, CPU) runs its own subprocess, as ``code`` does. One cost: the
``math`` scorer's per-answer timeouts (math_verify's ``signal.alarm``) work only on
the main thread, so on the scorer thread they are off and one pathological answer
runs the whole call into ``scorer_timeout_s`` (``scorer_timeout_s: null`` keeps them,
with the call unbounded).

With ``function: {path, name}`` a user's own Python function scores every row instead
of the scorers (:mod:`rlpipe.stages.reward_function`); its scores may be any finite float
and the extra keys of a dict it returns are reported as ``reward/<key>/mean``.

Rule + discriminative RM + judge, weighted, is the ``weighted`` impl
(:mod:`rlpipe.stages.reward_families`, on the reward pool); it runs this impl as its rule family.

Left out: overlong penalties for truncated rows, and re-decoding only the
``response_mask == 1`` tokens: rule scorers read ``response_text`` as the generate
stage decoded it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ConfigDict, Field, model_validator

from rlpipe.deadline import StageTimeout, call_with_deadline
from rlpipe.errors import ConfigError
from rlpipe.jagged import last_token_placement
from rlpipe.schemas.batch import (
    DATA_SOURCE,
    EXTRA_INFO,
    GROUND_TRUTH,
    RESPONSE_IDS,
    SAMPLE_INDEX,
    UID,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    REWARD,
    STATUS,
    STATUS_FAILED,
    TOKEN_REWARDS,
)
from rlpipe.stage import StageContext, StageParams, StageResult, cols, stage
from rlpipe.stages import reward_function
from rlpipe.stages.reward_function import RewardFunction
from rlpipe.stages.scorers import SCORERS, ScorerError, ScorerInfraError, check_options

log = logging.getLogger(__name__)


class RuleRewardParams(StageParams):
    """Routing of rows to rule-based scorers."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    routes: dict[str, str] = Field(default_factory=dict)
    """data_source → scorer name, e.g. {gsm8k: math, humaneval: code}. A data_source not listed
    here uses the scorer of the same name."""
    default_scorer: str | None = None
    """Scorer for data_sources that are neither routed nor a scorer name; None makes them an error."""
    scorer_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Keyword options per scorer name, e.g. {code: {timeout_s: 10, memory_mb: 2048}}."""
    scorer_timeout_s: float | None = Field(300.0, gt=0)
    """Longest one scorer call (all rows routed to one scorer in one batch) may take, in seconds; past it
    those rows are infrastructure failures (status `failed`, excluded from advantages and reward/mean) and
    the hung call is abandoned. None waits forever. Keep it below the stage's `timeout_s`."""
    function: RewardFunction | None = None
    """Your own reward function, {path: my_reward.py, name: score}: it scores every row (routes and scorers
    unused); verl's fn(data_source, solution_str, ground_truth, extra_info) → float or dict with `score`, or
    TRL's batched fn(prompts, completions, **kwargs) → list[float] (rlpipe.stages.reward_function)."""

    @model_validator(mode="after")
    def _scorers_exist(self) -> "RuleRewardParams":
        if self.function is not None and (self.routes or self.default_scorer or self.scorer_params):
            raise ValueError("`function` scores every row: drop `routes`, `default_scorer` and `scorer_params`, "
                             "or drop `function` to use the scorers")
        names = set(self.routes.values()) | set(self.scorer_params) | ({self.default_scorer} - {None})
        for name in sorted(names):
            if name not in SCORERS:
                raise ValueError(f"unknown scorer {name!r}; known scorers: {', '.join(SCORERS.names())}")
        for name, options in self.scorer_params.items():
            check_options(name, options)  # each scorer's own options model (rlpipe.stages.scorers.options_model)
        return self


def resolve_routes(data_sources: list[str], params: RuleRewardParams) -> dict[str, str]:
    """data_source → scorer name for every data_source present; an unroutable one raises."""
    out, unknown = {}, []
    for source in data_sources:
        name = params.routes.get(source) or (source if source in SCORERS else params.default_scorer)
        if name is None:
            unknown.append(source)
        out[source] = name
    if unknown:
        raise ConfigError(
            f"no scorer for data_source(s) {unknown}: map them in reward params `routes` "
            f"(e.g. routes: {{{unknown[0]}: exact_match}}) or set `default_scorer`. "
            f"Known scorers: {', '.join(SCORERS.names())}; data_sources in this batch: {sorted(data_sources)}"
        )
    return out


def _checked(name: str, scores: Any, n: int) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float32)
    if scores.shape != (n,) or not np.isfinite(scores).all() or ((scores < 0) | (scores > 1)).any():
        raise ScorerError(f"scorer {name!r} must return {n} finite scores in [0, 1]; got shape {scores.shape}, "
                          f"first values {scores.ravel()[:5].tolist()}")
    return scores


class ScorerTimeout(ScorerInfraError):
    """A scorer call ran past ``scorer_timeout_s``: all of its rows are infrastructure failures."""


def call_scorer(name: str, responses: pa.Array, truths: pa.Array, options: dict[str, Any],
                timeout_s: float | None) -> Any:
    """The scorer's scores, waiting at most ``timeout_s`` (module docstring: why a daemon thread)."""
    fn = SCORERS.get(name)
    try:
        return call_with_deadline(lambda: fn(responses, truths, **options), timeout_s, f"scorer {name!r}")
    except StageTimeout:
        log.warning("scorer %r gave no scores for %d rows within scorer_timeout_s=%g s; those rows are marked "
                    "failed and the call is abandoned", name, len(responses), timeout_s)
        raise ScorerTimeout(f"scorer {name!r} timed out after {timeout_s:g} s") from None


def score_rows(responses: pa.Array, truths: pa.Array, name: str, options: dict[str, Any],
               timeout_s: float | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """(scores, infra_failed, timed_out) of one scorer over its rows; infra-failed rows score 0."""
    n = len(responses)
    failed = np.zeros(n, dtype=bool)
    timed_out = False
    try:
        scores = call_scorer(name, responses, truths, options, timeout_s)
    except ScorerInfraError as exc:
        timed_out = isinstance(exc, ScorerTimeout)
        failed[np.arange(n) if exc.failed is None else exc.failed] = True
        scores = np.zeros(n, np.float32) if exc.scores is None else exc.scores
    scores = _checked(name, scores, n).copy()
    scores[failed] = 0.0
    return scores, failed, timed_out


def _metric_name(source: str) -> str:
    return re.sub(r"[^\w.\-]", "_", source) or "_"


def _rule_reads(params: RuleRewardParams) -> dict[str, pa.DataType]:
    extra = (UID, SAMPLE_INDEX) if params.function is not None else ()
    extra += (RESPONSE_IDS,) if params.function is not None and params.function.style == "trl" else ()
    return cols(DATA_SOURCE, GROUND_TRUTH, RESPONSE_TEXT, RESPONSE_MASK, STATUS, *extra)


def function_scores(batch: pa.Table, ref: RewardFunction, rows: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Scores of ``rows`` by the user's function (others 0) and the means of its extra metrics."""
    taken = batch.take(pa.array(rows, pa.int64()))
    text = {c: [v or "" for v in taken.column(c).to_pylist()] for c in (DATA_SOURCE, RESPONSE_TEXT, GROUND_TRUTH)}
    infos = taken.column(EXTRA_INFO).to_pylist() if EXTRA_INFO in taken.column_names else [None] * len(rows)
    infos = [reward_function.row_info(info, uid, index) for info, uid, index
             in zip(infos, taken.column(UID).to_pylist(), taken.column(SAMPLE_INDEX).to_pylist())]
    ids = taken.column(RESPONSE_IDS).to_pylist() if RESPONSE_IDS in taken.column_names else None
    values, extras = reward_function.score_rows(ref, text[DATA_SOURCE], text[RESPONSE_TEXT], text[GROUND_TRUTH],
                                                infos, ids)
    scores = np.zeros(batch.num_rows, dtype=np.float32)
    scores[rows] = values
    return scores, {f"reward/{_metric_name(k)}/mean": float(np.mean(v)) for k, v in extras.items()}


@stage(
    "reward",
    "rule",
    reads=_rule_reads,
    writes=cols(REWARD, TOKEN_REWARDS, STATUS),
    params=RuleRewardParams,
)
def rule_reward(batch: pa.Table, params: RuleRewardParams, ctx: StageContext) -> StageResult:
    """Score every row with a rule-based scorer chosen by its data_source, or with the user's own reward function."""
    n = batch.num_rows
    if params.function is not None:
        return _function_reward(batch, params.function)
    encoded = pc.fill_null(batch.column(DATA_SOURCE), "").combine_chunks().dictionary_encode()
    sources = encoded.dictionary.to_pylist()
    source_of_row = encoded.indices.to_numpy(zero_copy_only=False)
    route = resolve_routes(sources, params)
    scorer_of_source = np.array([route[s] for s in sources] or [""], dtype=object)
    scorer_of_row = scorer_of_source[source_of_row] if n else np.array([], dtype=object)

    status = batch.column(STATUS)
    skipped = pc.fill_null(pc.equal(status, STATUS_FAILED), False).to_numpy(zero_copy_only=False)
    responses, truths = batch.column(RESPONSE_TEXT), batch.column(GROUND_TRUTH)
    scores = np.zeros(n, dtype=np.float32)
    infra = np.zeros(n, dtype=bool)
    timeouts = 0
    for name in sorted(set(route.values())):
        rows = np.flatnonzero((scorer_of_row == name) & ~skipped)
        if rows.size:
            scores[rows], infra[rows], timed_out = score_rows(
                responses.take(rows), truths.take(rows), name, params.scorer_params.get(name, {}),
                params.scorer_timeout_s,
            )
            timeouts += timed_out

    new_status = pc.if_else(pa.array(infra), pa.scalar(STATUS_FAILED), status)
    columns = {
        REWARD: pa.array(scores, pa.float32()),
        TOKEN_REWARDS: last_token_placement(scores, batch.column(RESPONSE_MASK)),
        STATUS: new_status.combine_chunks() if isinstance(new_status, pa.ChunkedArray) else new_status,
    }
    metrics = _metrics(scores, ~skipped & ~infra, source_of_row, sources, infra)
    metrics["reward/scorer_timeouts"] = float(timeouts)
    return StageResult(columns=columns, metrics=metrics)


def _function_reward(batch: pa.Table, ref: RewardFunction) -> StageResult:
    status = batch.column(STATUS)
    skipped = pc.fill_null(pc.equal(status, STATUS_FAILED), False).to_numpy(zero_copy_only=False)
    scores, extra_metrics = function_scores(batch, ref, np.flatnonzero(~skipped))
    encoded = pc.fill_null(batch.column(DATA_SOURCE), "").combine_chunks().dictionary_encode()
    metrics = _metrics(scores, ~skipped, encoded.indices.to_numpy(zero_copy_only=False),
                       encoded.dictionary.to_pylist(), np.zeros(batch.num_rows, dtype=bool))
    columns = {REWARD: pa.array(scores, pa.float32()),
               TOKEN_REWARDS: last_token_placement(scores, batch.column(RESPONSE_MASK)),
               STATUS: status.combine_chunks() if isinstance(status, pa.ChunkedArray) else status}
    return StageResult(columns=columns, metrics={**metrics, **extra_metrics})


def _metrics(scores, valid, source_of_row, sources, infra) -> dict[str, float]:
    metrics = {"reward/infra_failures": float(infra.sum())}
    if valid.any():
        s = scores[valid]
        metrics.update({"reward/mean": float(s.mean()), "reward/std": float(s.std()),
                        "reward/max": float(s.max()), "reward/min": float(s.min())})
    for index, source in enumerate(sources):
        rows = valid & (source_of_row == index)
        if rows.any():
            metrics[f"reward/{_metric_name(source)}/mean"] = float(scores[rows].mean())
    return metrics
