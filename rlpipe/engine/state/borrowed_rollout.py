"""separate_async's hybrid borrow, the trainer's side: a trainer rank generates groups as a rollout replica would.

When the rollout pool cannot keep the trainer fed, the driver (:mod:`rlpipe.modes.borrow`) lends the idle
trainer to generation for a while: it pulls prompts from the replay buffer and hands them to trainer rank 0,
which generates them with its *current* weights, runs the generation-side stages (reward ...) on them as a
replica's feeder does (:func:`~rlpipe.engine.state.rollout_feeder.advance_scoring`: task stages in this
process, pool stages on the pool's workers) and stores the scored groups in the buffer through the replicas'
own call (``exchange``), so the staleness guard and the buffer's accounting treat them like any group. verl
lends idle trainer devices to generation the same way (its hybrid engine); AReaL's trainers never do.

The engine is the embedded one (:mod:`rlpipe.inference.embedded`), built on first use from the model config,
in the rollout dtype, as a replica builds its own, and loaded with the trainer's parameters (a
:class:`~rlpipe.backends.weights.LocalTensors` push: no buckets, no copy through Ray) whenever the trainer's
version moved since the last borrow; every token it samples carries that version, so a borrowed group's
version lag is 0 when it is generated. The engine keeps a second copy of the policy in the trainer's memory
(the price of not sharing parameters with the optimizer's model, which trains in place).

Seeds: the generate stage's (run seed, prompt step, rank 0), per prompt step, so a borrowed trajectory depends
on its seed, uid and weights only, as on a replica. Left out: sharded trainers (FSDP2, megatron: rank 0 does
not hold the whole model), a GPU engine (SGLang/vLLM) in the trainer's process, aborting a borrow when the
pool catches up (a borrow is one bounded call).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from rlpipe.backends.model import build_model
from rlpipe.engine.state.pool_client import PoolClient
from rlpipe.engine.state.rollout_feeder import HeadStage, SamplerClient, advance_scoring, begin_scoring
from rlpipe.inference.engines import EngineInputs, build_engine
from rlpipe.schemas.batch import PROMPT_STEP
from rlpipe.stage import StageContext, StepExtras
from rlpipe.stages.generate import GenerateParams, generate

POOL_POLL_S = 0.01
"""How often a borrow waiting for a pool stage (the reward pool) looks for its answer."""


class BorrowedRollout:
    """The embedded rollout engine a trainer rank lends to generation; :meth:`run` is one borrow."""

    def __init__(self, trainer: Any):
        config = trainer.config
        self.trainer = trainer
        self.tokenizer = trainer.tokenizer
        model_config = config.model.model_copy(update={"dtype": config.model.rollout_dtype or config.model.dtype})
        model = build_model(model_config, self.tokenizer, config.seed)
        inputs = EngineInputs(model, self.tokenizer, None, trainer.rank, "", name=f"trainer rank {trainer.rank} "
                              "(borrowed for generation)", lora=config.trainer.lora)
        self.engine = build_engine("embedded", inputs)
        self._loaded: int | None = None
        """The trainer version the engine holds (None: the engine's own initial weights)."""

    def sleep(self) -> None:
        """What the generate stage calls after generating in sync mode; a borrow never asks it to."""

    def run(self, prompts: pa.Table, sampler: Any, head: list[HeadStage], gen_params: dict[str, Any], run_seed: int,
            pools: dict[str, list] | None = None) -> dict[str, Any]:
        """Generate ``prompts`` (pulled from the buffer, marked running there) with the trainer's current weights,
        score them and store them in ``sampler`` (its actor handle, or the object inline). Returns the lineage
        records (``records``), the prompt uids (``uids``), the groups the buffer completed with them (``stored``),
        the policy ``version`` that generated them and the seconds spent (``seconds``)."""
        begun = time.time()
        version = int(self.trainer.version)
        if self._loaded != version:  # the trainer pushed since the last borrow: take its weights as they are now
            self.engine.load_weights(self.trainer.export_local_push(), version)
            self._loaded = version
        clients = {role: PoolClient(workers) for role, workers in (pools or {}).items()}
        try:
            return self._run(prompts, SamplerClient(sampler), head, gen_params, run_seed, clients, version, begun)
        finally:
            for client in clients.values():
                client.close()

    def _run(self, prompts: pa.Table, sampler: SamplerClient, head: list[HeadStage], gen_params: dict[str, Any],
             run_seed: int, pools: dict[str, PoolClient], version: int, begun: float) -> dict[str, Any]:
        params = GenerateParams.model_validate({k: v for k, v in gen_params.items() if k in GenerateParams.model_fields})
        extras = StepExtras(temperature=params.temperature)
        steps = prompts.column(PROMPT_STEP).to_numpy()
        records: list[dict[str, Any]] = []
        uids: list[str] = []
        stored = 0
        for step in np.unique(steps):  # one seed per submission step, as a replica's feeder submits them
            rows = prompts.filter(pa.array(steps == step))
            ctx = StageContext(step=int(step), seed=run_seed, policy_version=version, extras=extras)
            start = time.time()
            result = generate(self, rows, params, ctx)
            scoring = begin_scoring(result.table, start, dict(result.metrics), rows)
            while (scored := advance_scoring(scoring, head, pools, ctx, "the trainer's borrowed rollout")) is None:
                time.sleep(POOL_POLL_S)  # a pool stage (the reward pool) still scoring
            completed, _ = sampler("exchange", scored, 0)  # the replicas' own call: store, take no prompts
            stored += int(completed)
            records.extend(scoring.records)
            uids.extend(scoring.uids)
        return {"records": records, "uids": uids, "stored": stored, "version": version,
                "seconds": time.time() - begun}

    def close(self) -> None:
        self.engine.close()
