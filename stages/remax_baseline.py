"""ReMax's baseline: the reward of the greedy response to each prompt (stage ``reward/remax_baseline``).

ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505) subtracts, from each
sampled response's reward, the reward of the greedy response to the same prompt.
This stage runs on the rollout workers: it decodes one near-greedy response per
prompt (temperature ``greedy_temperature``, which picks the argmax token except
on exact ties — the embedded engine has no separate greedy path), scores it with
the same routing as ``reward/rule``, and writes ``reward_baseline`` on every row
of the prompt's group, for ``advantage/remax``. Left out: reusing the baseline
response for training (verl doesn't either).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from rlpipe.schemas.batch import DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP, UID
from rlpipe.stage import StageContext, StageResult, cols, stage
from rlpipe.stages.advantage import REWARD_BASELINE
from rlpipe.stages.algos.batch_io import groups_by_appearance
from rlpipe.stages.generate import GenerateParams, generation_seed, group_requests, trajectory_table
from rlpipe.stages.reward import RuleRewardParams, rule_reward


class RemaxBaselineParams(RuleRewardParams):
    """Scoring routes (as reward/rule) plus the greedy decode's budget."""

    max_tokens: int = Field(32, ge=1)
    """Length budget of the greedy response (use the generate stage's max_tokens)."""
    greedy_temperature: float = Field(1e-6, gt=0)
    """Temperature of the near-greedy decode."""


@stage("reward", "remax_baseline", placement="worker", role="rollout", params=RemaxBaselineParams,
       reads=cols(UID, DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP),
       writes={REWARD_BASELINE: pa.float32()})
def remax_baseline(worker, batch: pa.Table, params: RemaxBaselineParams, ctx: StageContext) -> StageResult:
    """ReMax's baseline: decode one greedy response per prompt and score it (writes ``reward_baseline``)."""
    first, _ = groups_by_appearance(batch)
    prompts = batch.take(pa.array(first)).select(list((UID, DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP)))
    sampling = GenerateParams(n=1, temperature=params.greedy_temperature, max_tokens=params.max_tokens)
    rows, sample_index, requests = group_requests(prompts, sampling, generation_seed(ctx))
    worker.engine.wake()  # sync mode puts the engine to sleep after generate
    results = worker.engine.generate(requests)
    greedy = trajectory_table(prompts.take(pa.array(rows)), sample_index, results, worker.tokenizer)
    scored = rule_reward(greedy, RuleRewardParams(**params.model_dump(include=set(RuleRewardParams.model_fields))), ctx)
    baseline_of_prompt = scored.columns["reward"].to_numpy(zero_copy_only=False)
    position = pc.index_in(batch.column(UID), value_set=prompts.column(UID)).to_numpy(zero_copy_only=False)
    return StageResult(
        columns={REWARD_BASELINE: pa.array(baseline_of_prompt[position], pa.float32())},
        metrics={"reward/remax_baseline_mean": float(np.mean(baseline_of_prompt)) if len(first) else 0.0},
    )
