"""The reward families on hand-built batches: discriminative RM (two tokenizers), generative judge
(pointwise, timeout → failed, group-wise parsing), GAR redistribution by hand, the weighted stack."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.jagged import from_flat
from rlpipe.schemas.batch import column_type
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, PipelineConfig, TokenizerConfig
from rlpipe.stage import StageContext
from rlpipe.stages.gar import grpo_gar, redistribute
from rlpipe.stages.judge import Judge, JudgeConfig, parse_group, parse_score
from rlpipe.stages.reward_model import RewardModel, RewardModelConfig, decode_pairs

CTX = StageContext(step=0, seed=0)
ARCH = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}
CHARS = TokenizerConfig(chars="0123456789=")
BYTES = TokenizerConfig(byte_level=True)


def jagged(rows, dtype):
    flat = np.array([x for r in rows for x in r], dtype=dtype.to_pandas_dtype())
    return from_flat(flat, np.array([len(r) for r in rows]), dtype)


def traj_batch(tok, prompts, responses, masks, uids, statuses=None, truths=None):
    n = len(prompts)
    return pa.table({
        "uid": pa.array(uids, pa.string()),
        "sample_index": pa.array(list(range(n)), pa.int32()),
        "data_source": pa.array(["digits"] * n, pa.string()),
        "ground_truth": pa.array(truths or ["73"] * n, pa.string()),
        "prompt_ids": jagged([tok.encode(p) for p in prompts], pa.int32()),
        "response_ids": jagged([tok.encode(r) for r in responses], pa.int32()),
        "response_mask": jagged(masks, pa.int8()),
        "response_text": pa.array(responses, pa.string()),
        "status": pa.array(statuses or ["ok"] * n, column_type("status")),
    })


# -- discriminative RM ------------------------------------------------------------------------------

def test_rm_reencodes_with_its_own_tokenizer_and_scores_the_last_valid_token():
    policy = build_tokenizer(CHARS)
    cfg = RewardModelConfig(architecture=ArchitectureConfig(**ARCH), tokenizer=BYTES, micro_batch_size=2)
    rm = RewardModel(cfg, policy)
    # row 1's last response token is masked out (a tool token): it must not reach the RM
    table = traj_batch(policy, ["37=", "5="], ["73", "58"], [[1, 1], [1, 0]], ["a", "b"])
    texts = decode_pairs(table.column("prompt_ids"), table.column("response_ids"), table.column("response_mask"), policy)
    assert texts == ["37=73", "5=5"]
    ids, mask = rm.encode(texts)
    # by hand: byte-level ids are 4 + rank of the byte's symbol; '3' → 4 + ... differs from the char ids
    assert ids[0, :5].tolist() == rm.tokenizer.encode("37=73", add_special_tokens=False)
    assert ids[0, :5].tolist() != policy.encode("37=73")
    assert mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    scores = rm.score(texts + ["5=5"])  # 3 rows over micro-batches of 2: padding must not change a score
    with torch.no_grad():  # reference: each row alone, unpadded, head on the final hidden state
        alone = [float(rm.head(rm.backbone(input_ids=torch.tensor([rm.tokenizer.encode(t)])).last_hidden_state[0, -1]))
                 for t in texts]
    np.testing.assert_allclose(scores, [alone[0], alone[1], alone[1]], rtol=1e-4, atol=1e-5)
    assert scores[0] != scores[1]


def test_rm_value_head_variant_builds_from_config():
    policy = build_tokenizer(CHARS)
    rm = RewardModel(RewardModelConfig(architecture=ArchitectureConfig(**ARCH), head="value_head"), policy)
    assert rm.score(["1=1", "22=22"]).shape == (2,)


# -- generative judge -------------------------------------------------------------------------------

def constant_model(tok, text_token: str):
    """A real tiny LM whose every next token is ``text_token`` (lm_head = bias on that id)."""
    model = build_model(ModelConfig(architecture=ArchitectureConfig(**ARCH, tie_word_embeddings=False)), tok, 0)
    head = torch.nn.Linear(model.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-50.0)
        head.bias[tok.convert_tokens_to_ids(text_token)] = 50.0
    model.lm_head = head
    return model


def judge_cfg(**kw):
    return JudgeConfig(model=ModelConfig(architecture=ArchitectureConfig(**ARCH)), **kw)


def test_pointwise_judge_scores_through_the_embedded_engine():
    tok = build_tokenizer(CHARS)
    judge = Judge(judge_cfg(max_tokens=2, max_score=100), tok, model=constant_model(tok, "7"))
    assert judge.complete(["1=", "2="]) == ["77", "77"]
    assert parse_score("77", judge.cfg.score_pattern, 100) == 0.77
    assert parse_score("no digits", r"(\d+)", 1) is None
    judge.close()


def test_judge_timeout_returns_none_instead_of_hanging():
    tok = build_tokenizer(CHARS)
    judge = Judge(judge_cfg(max_tokens=2, timeout_s=0.3, latency_s=5.0), tok, model=constant_model(tok, "7"))
    import time
    start = time.monotonic()
    assert judge.complete(["1=", "2="]) == [None, None]
    assert time.monotonic() - start < 2.0
    assert not judge.engine.has_active()  # aborted, nothing left running
    judge.close()


def test_groupwise_answer_parsing():
    scores, hacked = parse_group("1: 8\n2: 3\n3: 9\nHACKED: 3", 3, 10)
    assert scores == [0.8, 0.3, 0.9] and hacked == [False, False, True]
    scores, hacked = parse_group("1: 5 garbage", 2, 10)
    assert scores == [0.5, None] and hacked == [False, False]


# -- GAR by hand ------------------------------------------------------------------------------------

def test_gar_redistribution_by_hand():
    # group a: A = [1.0, 0.5, 0.5, -1.0, -1.0]; passing P = {0,1,2}, S = 2.0; row 2 hacked; q = [0.2, 0.6, *, *, *]
    #   → A'0 = 2.0·0.2/0.8 = 0.5, A'1 = 2.0·0.6/0.8 = 1.5, A'2 = 0 (hacked), failures unchanged
    # group b: A = [0.3, -0.3]; no judge quality (NaN) → equal split of S = 0.3 over the one honest row
    # group c: all passing rows hacked → their positive mass is dropped; the failure stays
    adv = np.array([1.0, 0.5, 0.5, -1.0, -1.0, 0.3, -0.3, 0.4, -0.4], np.float32)
    group = np.array([0, 0, 0, 0, 0, 1, 1, 2, 2])
    quality = np.array([0.2, 0.6, 0.9, 0.1, 0.0, np.nan, 0.5, 0.7, 0.1])
    hacked = np.array([0, 0, 1, 0, 1, 0, 0, 1, 0], bool)  # row 4: a flagged failure stays a failure
    out = redistribute(adv, group, quality, hacked)
    np.testing.assert_allclose(out, [0.5, 1.5, 0.0, -1.0, -1.0, 0.3, -0.3, 0.0, -0.4], rtol=1e-6)
    assert out[:3].sum() == pytest.approx(adv[:3].sum())  # the group's positive total is kept


def test_grpo_gar_stage_puts_redistributed_advantages_on_valid_tokens():
    from rlpipe.stage import stage_registry

    # one group of 3: rewards [1, 1, 0] → GRPO advantages [a, a, -2a] with a = 1/std([1,1,0]) · (1 - 2/3)
    tok = build_tokenizer(CHARS)
    table = traj_batch(tok, ["1="] * 3, ["11", "12", "13"], [[1, 1], [1, 0], [1, 1]], ["g"] * 3)
    table = table.append_column("token_rewards", pa.array([[0, 1.0], [1.0, 0], [0, 0.0]], pa.list_(pa.float32())))
    table = table.append_column("judge_score", pa.array([0.25, 0.75, 0.5], pa.float32()))
    table = table.append_column("judge_hacked", pa.array([0, 0, 0], pa.int8()))
    params = stage_registry("advantage").get("grpo_gar").params_model()
    out = grpo_gar(table, params, CTX)
    adv = out.columns["advantages"].to_pylist()
    a = (1 - 2 / 3) / (np.std([1, 1, 0], ddof=1) + 1e-6)
    # S = 2a split 1:3 by quality → 0.5a and 1.5a; the failure keeps -2a; masked token stays 0
    np.testing.assert_allclose(adv[0], [0.5 * a] * 2, rtol=1e-4)
    np.testing.assert_allclose(adv[1], [1.5 * a, 0.0], rtol=1e-4)
    np.testing.assert_allclose(adv[2], [-2 * a] * 2, rtol=1e-4)


# -- the weighted stack on the reward pool ----------------------------------------------------------

def pool_state(judge_kw=None, weights=None):
    from rlpipe.engine.state.reward_pool import RewardPoolState
    from tests.conftest import quickstart_raw

    params = {"rule": {}, "reward_model": {"architecture": ARCH, "tokenizer": {"byte_level": True}},
              "judge": {"model": {"architecture": ARCH}, "max_tokens": 2, "score_pattern": r"(\d)", "max_score": 10,
                        **(judge_kw or {})},
              "weights": weights or {"rule": 1.0, "reward_model": 0.5, "judge": 2.0}}
    raw = quickstart_raw()
    raw["stages"] = [s if s["kind"] != "reward" else {"kind": "reward", "impl": "weighted", "params": params}
                     for s in raw["stages"]]
    config = PipelineConfig.model_validate(raw)
    pool = RewardPoolState(config, 0, 1, None)
    pool.judge = Judge(pool.judge.cfg, pool.tokenizer, model=constant_model(pool.tokenizer, "7"))  # judge says 7
    from rlpipe.stages.reward_families import WeightedRewardParams
    return pool, WeightedRewardParams.model_validate(params)


def test_weighted_combines_rule_rm_and_judge_with_one_column_each():
    from rlpipe.stages.reward_families import weighted_reward

    pool, params = pool_state()
    tok = pool.tokenizer
    table = traj_batch(tok, ["37=", "37=", "37="], ["73", "70", "73"], [[1, 1]] * 3, ["g"] * 3,
                       statuses=["ok", "ok", "failed"])
    out = weighted_reward(pool, table, params, CTX)
    c = {k: v.to_pylist() for k, v in out.columns.items()}
    rm = pool.reward_model.score(["37=73", "37=70"])
    # by hand: digits rule = [1.0, 0.5]; judge "77" → first digit 7 / 10 = 0.7; failed row 2 scores 0 everywhere
    assert c["reward_rule"] == pytest.approx([1.0, 0.5, 0.0])
    assert c["judge_score"] == pytest.approx([0.7, 0.7, 0.0])
    assert c["reward_rm"] == pytest.approx([rm[0], rm[1], 0.0], rel=1e-4)
    expected = [1.0 * r + 0.5 * m + 2.0 * 0.7 for r, m in zip([1.0, 0.5], rm)]
    assert c["reward"] == pytest.approx(expected + [0.0], rel=1e-4)
    assert c["token_rewards"][0] == pytest.approx([0.0, expected[0]], rel=1e-4)
    assert c["status"] == ["ok", "ok", "failed"] and c["judge_hacked"] == [0, 0, 0]
    assert out.metrics["reward/judge/mean"] == pytest.approx(0.7)
    assert out.metrics["reward/rule/mean"] == pytest.approx(0.75)
    pool.close()


def test_judge_timeout_fails_the_trajectories_and_dapo_and_advantages_ignore_them():
    from rlpipe.stage import stage_registry
    from rlpipe.stages.filter_groups import FilterGroupsParams, filter_groups
    from rlpipe.stages.reward_families import weighted_reward

    fast, params = pool_state()
    slow, slow_params = pool_state({"latency_s": 5.0, "timeout_s": 0.3})
    tok = fast.tokenizer
    graded = weighted_reward(fast, traj_batch(tok, ["37="] * 2, ["73", "70"], [[1, 1]] * 2, ["a", "a"]), params, CTX)
    timed_out = traj_batch(tok, ["12="] * 2, ["21", "20"], [[1, 1]] * 2, ["b", "b"])
    late = weighted_reward(slow, timed_out, slow_params, CTX)
    assert late.columns["status"].to_pylist() == ["failed", "failed"]
    assert late.columns["reward"].to_pylist() == [0.0, 0.0]
    assert late.metrics["reward/judge/ungraded"] == 2.0
    base = traj_batch(tok, ["37="] * 2 + ["12="] * 2, ["73", "70", "21", "20"], [[1, 1]] * 4, ["a", "a", "b", "b"])
    table = base.drop(["status"])
    for name in ("reward", "token_rewards", "status"):
        table = table.append_column(name, pa.concat_arrays([graded.columns[name], late.columns[name]]))
    kept = filter_groups(table, FilterGroupsParams(), CTX)
    assert kept.keep.tolist() == [0, 1]  # group b has no valid trajectory: evicted, not taught as wrong
    assert kept.metrics["filter_groups/evicted_single_valid"] == 1.0
    adv_params = stage_registry("advantage").get("grpo").params_model()
    adv = stage_registry("advantage").get("grpo").fn(table, adv_params, CTX)
    a = adv.columns["advantages"].to_pylist()
    assert a[2] == [0.0, 0.0] and a[3] == [0.0, 0.0] and a[0][0] > 0 > a[1][0]
    assert adv.metrics["advantage/failed_rows"] == 2.0
    fast.close(), slow.close()


def test_rm_loads_from_a_local_directory(tmp_path):
    policy = build_tokenizer(CHARS)
    built = RewardModel(RewardModelConfig(architecture=ArchitectureConfig(**ARCH)), policy)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(built.backbone.config.__class__(
        **{**built.backbone.config.to_dict(), "num_labels": 1}))
    model.model.load_state_dict(built.backbone.state_dict())
    model.score.load_state_dict(built.head.state_dict())
    model.save_pretrained(tmp_path / "rm")
    loaded = RewardModel(RewardModelConfig(path=str(tmp_path / "rm")), policy)
    np.testing.assert_allclose(loaded.score(["37=73", "1=1"]), built.score(["37=73", "1=1"]), rtol=1e-5, atol=1e-6)


def test_groupwise_judge_without_a_parsable_answer_fails_the_group():
    from rlpipe.stages.reward_families import weighted_reward

    pool, params = pool_state({"mode": "groupwise"})  # the constant judge writes "77": no "k: score" lines
    table = traj_batch(pool.tokenizer, ["37="] * 2, ["73", "70"], [[1, 1]] * 2, ["g", "g"])
    out = weighted_reward(pool, table, params, CTX)
    assert out.columns["status"].to_pylist() == ["failed", "failed"]
    assert out.metrics["reward/judge/ungraded"] == 2.0
    pool.close()


def test_reward_model_timeout_fails_its_rows_instead_of_hanging():
    import time

    from rlpipe.stages.reward_families import weighted_reward

    pool, params = pool_state()
    params = params.model_copy(update={"reward_model": params.reward_model.model_copy(
        update={"timeout_s": 0.3, "latency_s": 3.0})})
    pool.reward_model.cfg = params.reward_model  # the RM now takes 3 s per call, its deadline is 0.3 s
    table = traj_batch(pool.tokenizer, ["37="] * 2, ["73", "70"], [[1, 1]] * 2, ["g", "g"])
    start = time.monotonic()
    out = weighted_reward(pool, table, params, CTX)
    assert time.monotonic() - start < 2.5
    assert out.columns["status"].to_pylist() == ["failed", "failed"]
    assert out.columns["reward"].to_pylist() == [0.0, 0.0] and out.columns["reward_rm"].to_pylist() == [0.0, 0.0]
    assert out.metrics["reward/reward_model/timeouts"] == 1.0 and out.metrics["reward/infra_failures"] == 2.0
    assert out.metrics["reward/judge/ungraded"] == 0.0  # failed rows are not sent to the judge
    pool.close()


def test_routes_pick_the_families_per_data_source():
    from rlpipe.stages.reward_families import WeightedRewardParams, weighted_reward

    pool, params = pool_state()
    params = WeightedRewardParams.model_validate({**params.model_dump(), "rule": {"default_scorer": "digits"},
                                                  "routes": {"digits": ["rule", "judge"], "chat": ["reward_model"]}})
    table = traj_batch(pool.tokenizer, ["37="] * 3, ["73", "70", "73"], [[1, 1]] * 3, ["g", "g", "h"])
    table = table.set_column(table.schema.get_field_index("data_source"), "data_source",
                             pa.array(["digits", "chat", "other"], pa.string()))
    out = weighted_reward(pool, table, params, CTX)
    c = {k: v.to_pylist() for k, v in out.columns.items()}
    rm = pool.reward_model.score(["37=70", "37=73"])
    # by hand (weights rule 1, RM 0.5, judge 2): digits → rule 1.0 + judge 2·0.7; chat → RM only (0.5·rm);
    # an unlisted source → every family: rule 1.0 + 0.5·rm + 2·0.7
    assert c["reward_rule"] == pytest.approx([1.0, 0.0, 1.0]) and c["judge_score"] == pytest.approx([0.7, 0.0, 0.7])
    assert c["reward_rm"] == pytest.approx([0.0, rm[0], rm[1]], rel=1e-4)
    assert c["reward"] == pytest.approx([1.0 + 1.4, 0.5 * rm[0], 1.0 + 0.5 * rm[1] + 1.4], rel=1e-4)
    assert out.metrics["reward/rule/mean"] == pytest.approx(1.0)  # over the rows the rule scored
    with pytest.raises(ValueError, match=r"routes.chat: families \['judge'\] are not configured"):
        WeightedRewardParams.model_validate({"rule": {}, "routes": {"chat": ["judge"]}})
    pool.close()


def test_rm_value_head_file_is_loaded_as_tensors_and_checked(tmp_path):
    from rlpipe.backends.model import save_hf_model
    from rlpipe.errors import ConfigError

    policy = build_tokenizer(CHARS)
    save_hf_model(build_model(ModelConfig(architecture=ArchitectureConfig(**ARCH)), policy, 0), policy, tmp_path)
    cfg = RewardModelConfig(path=str(tmp_path), head="value_head")
    head = {"weight": torch.full((1, ARCH["hidden_size"]), 0.5), "bias": torch.tensor([2.0])}
    torch.save(head, tmp_path / "value_head.pt")
    rm = RewardModel(cfg, policy)
    torch.testing.assert_close(rm.head.weight, head["weight"])
    torch.testing.assert_close(rm.head.bias, head["bias"])
    torch.save({"weight": torch.zeros(1, 7), "bias": torch.zeros(1)}, tmp_path / "value_head.pt")  # another model's
    with pytest.raises(ConfigError, match=r"value_head.pt.*unusable.*\(1, 7\).*torch.save"):
        RewardModel(cfg, policy)
    torch.save({"weight": torch.full((1, ARCH["hidden_size"]), float("nan")), "bias": torch.zeros(1)},
               tmp_path / "value_head.pt")
    with pytest.raises(ConfigError, match="non-finite"):
        RewardModel(cfg, policy)
    torch.save(ConfigError("an arbitrary pickled object"), tmp_path / "value_head.pt")  # refused unrun
    with pytest.raises(ConfigError, match="unusable"):
        RewardModel(cfg, policy)
