"""The generate stage (impl ``embedded``): row expansion, schema, reproducibility, metrics."""

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from conftest import prompt_table
from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.errors import BatchError
from rlpipe.schemas.batch import COLUMN_TYPES, PROMPT_COLUMNS
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.generate import GenerateParams, generate

TOK = build_tokenizer(TokenizerConfig(chars="abcdefgh 0123456789+="))


def worker(version=0):
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    model = build_model(ModelConfig(architecture=arch), TOK, seed=0)
    return SimpleNamespace(engine=EmbeddedEngine(model, TOK, version=version), tokenizer=TOK)


def prompts(texts=("1+2=", "abc", "h 7 + 10 =")) -> pa.Table:
    return prompt_table(TOK, texts, 5)


def run(batch, params=GenerateParams(n=4, max_tokens=10), step=5, seed=0, version=0):
    return generate(worker(version), batch, params, StageContext(step=step, seed=seed))


def test_registered_as_a_rollout_worker_stage_creating_rows():
    spec = stage_registry("generate").get("embedded")
    assert (spec.placement, spec.role, spec.creates_rows) == ("worker", "rollout", True)
    assert spec.params_model is GenerateParams
    assert set(spec.read_columns(GenerateParams())) == set(PROMPT_COLUMNS)


def test_rows_expand_n_per_prompt_with_the_canonical_schema():
    batch = prompts()
    result = run(batch)
    table = result.table
    spec = stage_registry("generate").get("embedded")
    assert table.schema == pa.schema(list(spec.write_columns(GenerateParams()).items()))
    assert all(table.schema.field(name).type == COLUMN_TYPES[name] for name in table.column_names)
    assert table.num_rows == 12
    assert table.column("uid").to_pylist() == [u for u in ["p0", "p1", "p2"] for _ in range(4)]
    assert table.column("sample_index").to_pylist() == [0, 1, 2, 3] * 3
    prompt_ids = batch.column("prompt_ids").to_pylist()
    assert table.column("prompt_ids").to_pylist() == [p for p in prompt_ids for _ in range(4)]
    assert table.column("ground_truth").to_pylist() == [g for g in ["0", "1", "2"] for _ in range(4)]
    assert set(table.column("prompt_step").to_pylist()) == {5}


def test_per_token_columns_align_and_statuses_match_lengths():
    table = run(prompts(), version=3).table
    rows = table.to_pylist()
    eos = TOK.eos_token_id
    for row in rows:
        n = len(row["response_ids"])
        assert len(row["response_mask"]) == len(row["rollout_logprobs"]) == len(row["token_versions"]) == n
        assert set(row["response_mask"]) == {1} and set(row["token_versions"]) == {3}
        assert all(lp <= 0 for lp in row["rollout_logprobs"])
        if row["status"] == "ok":
            assert row["response_ids"][-1] == eos
        else:
            assert row["status"] == "truncated" and n == 10
        assert row["response_text"] == TOK.decode(row["response_ids"], skip_special_tokens=True)


def test_reproducible_from_seed_and_step():
    batch = prompts()
    a, b = run(batch).table, run(batch).table
    assert a.equals(b)
    other_step = run(batch, step=6).table
    other_seed = run(batch, seed=1).table
    assert not a.column("response_ids").equals(other_step.column("response_ids"))
    assert not a.column("response_ids").equals(other_seed.column("response_ids"))
    # the n samples of one prompt differ from each other
    first_group = a.column("response_ids").to_pylist()[:4]
    assert len({tuple(x) for x in first_group}) > 1


def test_metrics():
    result = run(prompts())
    lens = [len(x) for x in result.table.column("response_ids").to_pylist()]
    statuses = result.table.column("status").to_pylist()
    m = result.metrics
    assert m["generate/response_length_mean"] == pytest.approx(np.mean(lens))
    assert m["generate/response_length_max"] == max(lens)
    assert m["generate/truncated_fraction"] == pytest.approx(statuses.count("truncated") / len(statuses))
    assert m["generate/tokens_per_s"] > 0


def test_empty_batch_and_repeated_uids():
    empty = run(prompts(())).table
    assert empty.num_rows == 0 and "response_ids" in empty.column_names
    batch = prompts(("1", "2"))
    repeated = batch.set_column(0, "uid", pa.array(["same", "same"]))
    with pytest.raises(BatchError, match="repeats a uid"):
        run(repeated)


def test_params_are_strict_and_bounded():
    with pytest.raises(ValueError, match="extra"):
        GenerateParams(n=2, beams=3)
    with pytest.raises(ValueError):
        GenerateParams(temperature=0)
    assert all(field.description for field in GenerateParams.model_fields.values())


def test_environment_latency_is_heavy_tailed_capped_and_seeded_per_request():
    from rlpipe.stages.generate import env_latencies

    ids = [f"u{i}/0" for i in range(4000)]
    params = GenerateParams(env_latency_s=0.01, env_latency_max_s=0.5, pareto_alpha=1.2)
    lat = env_latencies(params, ids, seed=3)
    assert lat.min() >= 0.01 and lat.max() == 0.5
    # Pareto(1.2) from 0.01: P(X > 0.1) = 0.1 ** 1.2 ~ 6.3%
    assert 0.05 < np.mean(lat > 0.1) < 0.077
    assert np.array_equal(lat[:10], env_latencies(params, ids[:10], seed=3))  # per request, not per batch
    assert not np.array_equal(lat, env_latencies(params, ids, seed=4))
    assert not env_latencies(GenerateParams(), ids, seed=3).any()
