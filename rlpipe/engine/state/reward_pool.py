"""The independent reward pool: the ``reward_model`` worker role.

A pool worker holds the models of the ``reward/weighted`` stage — a discriminative reward
model and/or a generative judge behind its own rollout engine — plus the policy tokenizer
(responses are decoded with it). The role is replicated (``pool_size`` workers, rows split
evenly) and hosted, like every role, on Ray actors of its own: reward models never share
a process with the rollout replicas or the trainer, so a slow judge occupies only the
pool. Deadlines, each turning its rows into infrastructure failures (``status = "failed"``,
left out of DAPO and the advantages, counted) instead of a hang: every judge call
(``judge.timeout_s``), every reward-model call (``reward_model.timeout_s``), and, in
separate_async, every call of a rollout feeder to a pool worker (the stage's
``call_timeout_s``; also a worker that died).

In separate_async each rollout replica's feeder calls the pool without waiting
(:mod:`rlpipe.engine.state.pool_client`): it hands finished groups to the pool and goes on
pulling prompts and collecting generations; the groups are stored once the pool answers.

Left out: autoscaling the pool, and batching several replicas' groups into one pool call.
"""

from __future__ import annotations

from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.engine.host import configure_process
from rlpipe.engine.state.roles import WORKER_ROLES, RoleSpec
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import PipelineConfig


def pool_params(config: PipelineConfig):
    """The pool's part of the ``reward/weighted`` stage's params: (reward_model, judge, pool_size).

    The rule family is not validated here: its custom function's path is resolved on the driver
    (the plan ships the source with the stage's params), not in a pool worker's directory."""
    from rlpipe.stages.judge import JudgeConfig
    from rlpipe.stages.reward_families import WeightedRewardParams
    from rlpipe.stages.reward_model import RewardModelConfig

    node = next((s for s in config.stages if s.kind == "reward" and s.impl == "weighted"), None)
    if node is None:
        raise ConfigError("the reward_model role serves the `reward/weighted` stage; the pipeline has none")
    raw = node.params
    rm = RewardModelConfig.model_validate(raw["reward_model"]) if raw.get("reward_model") else None
    judge = JudgeConfig.model_validate(raw["judge"]) if raw.get("judge") else None
    size = raw["pool_size"] if "pool_size" in raw else WeightedRewardParams.model_fields["pool_size"].default
    return rm, judge, int(size)


class RewardPoolState:
    """One reward-pool worker: the reward model and the judge of the weighted reward stage."""

    def __init__(self, config: PipelineConfig, rank: int, world_size: int, dist_address: str | None):
        from rlpipe.stages.judge import Judge
        from rlpipe.stages.reward_model import RewardModel

        configure_process(config)
        rm, judge, _ = pool_params(config)
        self.rank = rank
        self.tokenizer = build_tokenizer(config.tokenizer)
        self.reward_model = RewardModel(rm, self.tokenizer) if rm is not None else None
        self.judge = Judge(judge, self.tokenizer, name=f"{config.name}-judge{rank}") if judge is not None else None

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()


WORKER_ROLES.add("reward_model", RoleSpec(RewardPoolState, sharded=False, size=lambda c: pool_params(c)[2]))
