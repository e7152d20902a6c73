"""The rule reward stage: routing by data_source, last-token placement, infra failures, metrics."""

import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from rlpipe.errors import ConfigError
from rlpipe.schemas.batch import column_type
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.reward import RuleRewardParams, rule_reward
from rlpipe.stages.scorers import SCORERS, ScorerError, ScorerInfraError

CTX = StageContext(step=3, seed=0)
SEEN: list[list[str]] = []


def flaky(responses, ground_truths, *, fail_on: str = "boom"):
    """Test scorer: the sandbox 'dies' on responses equal to ``fail_on``; others score 0.5."""
    texts = [r.as_py() for r in responses]
    SEEN.append(texts)
    failed = [i for i, t in enumerate(texts) if t == fail_on]
    scores = np.full(len(texts), 0.5, np.float32)
    if failed:
        raise ScorerInfraError("sandbox down", failed=failed, scores=scores)
    return scores


def out_of_range(responses, ground_truths):
    return np.full(len(responses), 2.0)


HANG = threading.Event()


def hangs(responses, ground_truths):
    """Test scorer: never returns (until the test releases it)."""
    HANG.wait()
    return np.ones(len(responses), np.float32)


for name, fn in (("test_reward_flaky", flaky), ("test_reward_out_of_range", out_of_range),
                 ("test_reward_hangs", hangs)):
    if name not in SCORERS:
        SCORERS.add(name, fn)


def batch(sources, responses, truths, masks, statuses=None):
    n = len(sources)
    return pa.table({
        "data_source": pa.array(sources, column_type("data_source")),
        "ground_truth": pa.array(truths, column_type("ground_truth")),
        "response_text": pa.array(responses, column_type("response_text")),
        "response_mask": pa.array(masks, column_type("response_mask")),
        "status": pa.array(statuses or ["ok"] * n, column_type("status")),
    })


def test_routes_scores_and_places_them_on_the_last_valid_token():
    table = batch(
        ["digits", "digits", "gsm8k", "mine"],
        ["173", "17", "so #### 42", "yes"],
        ["173", "173", "42", "yes"],
        [[1, 1, 0], [1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0]],
        ["ok", "truncated", "ok", "ok"],
    )
    before = table.to_pydict()
    result = rule_reward(table, RuleRewardParams(routes={"mine": "exact_match"}), CTX)
    assert table.to_pydict() == before  # input untouched
    cols = result.columns
    assert cols["reward"].type == pa.float32() and cols["token_rewards"].type == column_type("token_rewards")
    np.testing.assert_allclose(cols["reward"].to_numpy(), [1, 2 / 3, 1, 1], rtol=1e-6)
    tokens = cols["token_rewards"].to_pylist()
    assert tokens[0] == [0.0, 1.0, 0.0]
    assert tokens[1] == pytest.approx([0.0, 0.0, 2 / 3, 0.0])
    assert tokens[2] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert tokens[3] == [0.0, 0.0]  # no valid token: the score is dropped, not moved
    assert cols["status"].to_pylist() == ["ok", "truncated", "ok", "ok"]
    m = result.metrics
    assert m["reward/mean"] == pytest.approx((1 + 2 / 3 + 1 + 1) / 4)
    assert m["reward/max"] == 1.0 and m["reward/min"] == pytest.approx(2 / 3)
    assert m["reward/std"] == pytest.approx(np.std([1, 2 / 3, 1, 1]))
    assert m["reward/digits/mean"] == pytest.approx(5 / 6) and m["reward/gsm8k/mean"] == 1.0
    assert m["reward/mine/mean"] == 1.0 and m["reward/infra_failures"] == 0.0


def test_default_scorer_and_unknown_data_source():
    table = batch(["weird", "digits"], ["x", "1"], ["x", "1"], [[1], [1]])
    result = rule_reward(table, RuleRewardParams(default_scorer="exact_match"), CTX)
    assert result.columns["reward"].to_pylist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match=r"no scorer for data_source\(s\) \['weird'\].*routes: \{weird: exact_match\}"
                                          r".*Known scorers: code, digits, exact_match.*data_sources in this batch: "
                                          r"\['digits', 'weird'\]"):
        rule_reward(table, RuleRewardParams(), CTX)


def test_infra_failures_mark_rows_failed_and_already_failed_rows_are_not_scored():
    SEEN.clear()
    table = batch(["flaky"] * 4, ["a", "boom", "c", "d"], [""] * 4, [[1, 1], [1], [1, 0], [1]],
                  ["ok", "ok", "truncated", "failed"])
    params = RuleRewardParams(routes={"flaky": "test_reward_flaky"})
    result = rule_reward(table, params, CTX)
    assert SEEN == [["a", "boom", "c"]]  # the failed row was not sent to the scorer
    assert result.columns["status"].to_pylist() == ["ok", "failed", "truncated", "failed"]
    assert result.columns["reward"].to_pylist() == [0.5, 0.0, 0.5, 0.0]
    assert result.columns["token_rewards"].to_pylist() == [[0.0, 0.5], [0.0], [0.5, 0.0], [0.0]]
    assert result.metrics["reward/infra_failures"] == 1.0
    assert result.metrics["reward/mean"] == 0.5 and result.metrics["reward/flaky/mean"] == 0.5
    # scorer options reach the scorer
    opts = RuleRewardParams(routes={"flaky": "test_reward_flaky"}, scorer_params={"test_reward_flaky": {"fail_on": "a"}})
    assert rule_reward(table, opts, CTX).columns["status"].to_pylist() == ["failed", "ok", "truncated", "failed"]


def test_invalid_scores_are_an_error():
    table = batch(["x"], ["a"], ["a"], [[1]])
    with pytest.raises(ScorerError, match=r"scorer 'test_reward_out_of_range' must return 1 finite scores in \[0, 1\]"):
        rule_reward(table, RuleRewardParams(default_scorer="test_reward_out_of_range"), CTX)


def test_params_are_checked_against_the_registry():
    with pytest.raises(ValidationError, match="unknown scorer 'mathh'; known scorers: code, digits"):
        RuleRewardParams(routes={"gsm8k": "mathh"})
    with pytest.raises(ValidationError, match=r"scorer_params\.code\.timeout: unknown option of scorer 'code' \(its "
                                              r"options: timeout_s, memory_mb, max_file_mb, max_workers\)"):
        RuleRewardParams(scorer_params={"code": {"timeout": 3}})
    # values are typed by the scorer's own model (issue 14 part 4): no strings, booleans or out-of-range numbers
    for options, message in (({"timeout_s": "ten"}, r"scorer_params\.code\.timeout_s: Input should be a valid number"),
                             ({"memory_mb": 1}, r"scorer_params\.code\.memory_mb: Input should be greater than or "
                                                r"equal to 32 \(got 1\)"),
                             ({"max_workers": True}, r"scorer_params\.code\.max_workers: Input should be a valid "
                                                     r"integer \(got True\)"),
                             ({"timeout_s": float("inf")}, r"scorer_params\.code\.timeout_s: Input should be a finite")):
        with pytest.raises(ValidationError, match=message):
            RuleRewardParams(scorer_params={"code": options})
    # a scorer without a declared model: one built from its keyword parameters' annotations
    with pytest.raises(ValidationError, match=r"scorer_params\.test_reward_flaky\.fail_on: Input should be a valid "
                                              r"string \(got 3\)"):
        RuleRewardParams(scorer_params={"test_reward_flaky": {"fail_on": 3}})
    with pytest.raises(ValidationError, match=r"scorer_params\.digits\.strict: unknown option of scorer 'digits' "
                                              r"\(its options: none\)"):
        RuleRewardParams(scorer_params={"digits": {"strict": True}})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        RuleRewardParams(route={})
    RuleRewardParams(routes={"humaneval": "code"}, scorer_params={"code": {"timeout_s": 3, "memory_mb": 512}})


def test_contract_and_empty_batch():
    spec = stage_registry("reward").get("rule")
    params = RuleRewardParams()
    assert set(spec.read_columns(params)) == {"data_source", "ground_truth", "response_text", "response_mask", "status"}
    assert spec.write_columns(params) == {"reward": pa.float32(), "token_rewards": pa.list_(pa.float32()),
                                          "status": pa.string()}
    assert spec.placement == "task"
    result = rule_reward(batch([], [], [], []), params, CTX)
    assert result.columns["reward"].to_pylist() == [] and result.metrics == {"reward/infra_failures": 0.0,
                                                                               "reward/scorer_timeouts": 0.0}


def test_a_scorer_that_never_returns_marks_its_rows_failed_after_scorer_timeout_s():
    table = batch(["hang", "hang", "digits"], ["1", "2", "12"], ["1", "2", "12"], [[1], [1], [1, 1]])
    params = RuleRewardParams(routes={"hang": "test_reward_hangs"}, scorer_timeout_s=0.5)
    start = time.monotonic()
    try:
        result = rule_reward(table, params, CTX)
    finally:
        HANG.set()  # release the abandoned thread
    assert time.monotonic() - start < 5
    assert result.columns["status"].to_pylist() == ["failed", "failed", "ok"]
    assert result.columns["reward"].to_pylist() == [0.0, 0.0, 1.0]
    assert result.metrics["reward/scorer_timeouts"] == 1.0 and result.metrics["reward/infra_failures"] == 2.0
    assert result.metrics["reward/mean"] == 1.0  # the failed rows are not averaged in


def test_scorer_timeout_must_be_positive():
    with pytest.raises(ValidationError, match="scorer_timeout_s"):
        RuleRewardParams(scorer_timeout_s=0)
