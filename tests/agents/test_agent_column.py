"""The per-sample `agent` column: each prompt row picks its agent (generate.params.agent is the default), in the
generate stage and in the async modes' rollout service, and a dataset carries the column to the prompt batches."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pytest

from agent_fixtures import OBSERVATION, PROMPT, TURN1, TURN2, scripted_model, tok  # noqa: F401 (fixtures)
from conftest import prompt_table
from rlpipe.backends.weights import export_buckets
from rlpipe.engine.state.data import PromptLoader
from rlpipe.engine.state.rollout_service import RolloutService
from rlpipe.errors import BatchError
from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.schemas.config import DataConfig
from rlpipe.stage import StageContext
from rlpipe.stages.generate import GenerateParams, generate


def mixed_params(**extra) -> GenerateParams:
    return GenerateParams(n=2, max_tokens=30, temperature=0.05, agent="single_turn", agents=["tool_agent"],
                          agent_loop={"parser": "compact", "max_turns": 3}, **extra)


def with_agents(table: pa.Table, agents: list) -> pa.Table:
    return table.append_column("agent", pa.array(agents, pa.string()))


def check_rows(tok, table):
    eos = tok.eos_token_id
    by_uid = {}
    for row in table.to_pylist():
        by_uid.setdefault(row["uid"], []).append(row)
    # p0 named tool_agent: the calculator ran between the turns (observation tokens mask 0)
    for row in by_uid["p0"]:
        assert row["response_ids"] == tok.encode(TURN1) + [eos] + tok.encode(OBSERVATION) + tok.encode(TURN2) + [eos]
        assert row["response_mask"] == [1] * 7 + [0] * 4 + [1] * 3 and row["num_turns"] == 2
    # p1 had no agent (null): the default single_turn, one generation, every token mask 1
    for row in by_uid["p1"]:
        assert row["response_ids"] == tok.encode(TURN1) + [eos] and row["response_mask"] == [1] * 7
        assert row["num_turns"] == 1 and row["generation_spans"] == [0, 7] and row["termination"] == "eos"


def test_generate_stage_runs_each_row_with_its_agent(tok, scripted_model):
    worker = type("W", (), {})()
    worker.engine, worker.tokenizer = EmbeddedEngine(copy.deepcopy(scripted_model), tok), tok
    batch = with_agents(prompt_table(tok, [PROMPT, PROMPT], 0), ["tool_agent", None])
    table = generate(worker, batch, mixed_params(), StageContext(step=0, seed=0)).table
    check_rows(tok, table)

    with pytest.raises(BatchError, match=r"rows name agent\(s\) \['gateway'\].*add them to generate.params.agents"):
        generate(worker, with_agents(prompt_table(tok, [PROMPT], 0), ["gateway"]), mixed_params(),
                 StageContext(step=0, seed=0))


def test_rollout_service_routes_rows_across_a_push(tok, scripted_model):
    from rlpipe.agents.loop import build_agent

    agent = build_agent(EmbeddedEngine(copy.deepcopy(scripted_model), tok), tok, mixed_params())
    service = RolloutService(agent, tok)
    try:
        service.submit(with_agents(prompt_table(tok, [PROMPT, PROMPT], 0), ["tool_agent", None]), mixed_params(),
                       seed=0)
        service.push_weights(export_buckets(scripted_model), version=1)  # aborts and resumes whatever runs
        rows = service.collect(min_groups=2, timeout=60)
    finally:
        service.shutdown()
    check_rows(tok, rows)


def test_dataset_agent_key_reaches_the_prompt_batches(tok, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "1+1=", "ground_truth": "2", "agent": "tool_agent"}, {"prompt": "2+2=", "ground_truth": "4"}]))
    data = DataConfig(source="jsonl", params={"path": str(path), "data_source": "digits", "agent_key": "agent"},
                      prompts_per_step=2, max_prompt_length=8, shuffle=False)
    batch = PromptLoader(data, tok, seed=0).next_batch(0)
    assert batch.column("agent").to_pylist() == ["tool_agent", None]
    plain = DataConfig(source="jsonl", params={"path": str(path), "data_source": "digits"}, prompts_per_step=2,
                       max_prompt_length=8)
    assert "agent" not in PromptLoader(plain, tok, seed=0).next_batch(0).column_names


def test_agents_setting_is_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"unknown agent\(s\) \['nope'\] in agents; known: gateway"):
        GenerateParams(agents=["nope"])
