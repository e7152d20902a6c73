"""The custom reward function: loading, dict returns, errors naming file and line, Ray workers."""

import json
import os

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError

from rlpipe.errors import StageError
from rlpipe.schemas.batch import column_type
from rlpipe.stage import StageContext
from rlpipe.stages.reward import RuleRewardParams, rule_reward
from rlpipe.stages.reward_function import RewardFunctionError

CTX = StageContext(step=0, seed=0)

FIVE_LINES = """\
def score(data_source, solution_str, ground_truth, extra_info):
    if data_source == "len":
        return {"score": len(solution_str) / 10, "chars": float(len(solution_str))}
    return 1.0 if solution_str.strip() == ground_truth else 0.0
"""

RAISES = """\
def score(data_source, solution_str, ground_truth, extra_info):
    x = 1
    return x / 0
"""


def batch(sources, responses, truths, statuses=None):
    n = len(sources)
    return pa.table({
        "uid": pa.array([f"u{i // 2}" for i in range(n)], column_type("uid")),
        "sample_index": pa.array([i % 2 for i in range(n)], column_type("sample_index")),
        "data_source": pa.array(sources, column_type("data_source")),
        "ground_truth": pa.array(truths, column_type("ground_truth")),
        "response_text": pa.array(responses, column_type("response_text")),
        "response_mask": pa.array([[1, 1, 0]] * n, column_type("response_mask")),
        "status": pa.array(statuses or ["ok"] * n, column_type("status")),
    })


def write(tmp_path, text, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_function_scores_rows_and_reports_extra_metrics(tmp_path, monkeypatch):
    write(tmp_path, FIVE_LINES)
    monkeypatch.chdir(tmp_path)
    params = RuleRewardParams.model_validate({"function": {"path": "my_reward.py", "name": "score"}})
    assert params.function.path == str(tmp_path / "my_reward.py")  # resolved on the driver
    table = batch(["x", "x", "len", "x"], ["42", "7", "abcd", "boom"], ["42", "42", "", "boom"],
                  ["ok", "ok", "ok", "failed"])
    out = rule_reward(table, params, CTX)
    # by hand: match, mismatch, len("abcd")/10, failed row not scored
    np.testing.assert_allclose(out.columns["reward"].to_numpy(), [1.0, 0.0, 0.4, 0.0], rtol=1e-6)
    assert out.columns["token_rewards"].to_pylist()[2] == pytest.approx([0.0, 0.4, 0.0])
    assert out.columns["status"].to_pylist() == ["ok", "ok", "ok", "failed"]
    assert out.metrics["reward/chars/mean"] == 4.0
    assert out.metrics["reward/mean"] == pytest.approx(1.4 / 3)


def test_errors_name_the_file_and_line(tmp_path):
    path = write(tmp_path, RAISES)
    params = RuleRewardParams.model_validate({"function": {"path": str(path), "name": "score"}})
    with pytest.raises(RewardFunctionError, match=rf"{path}:3: ZeroDivisionError"):
        rule_reward(batch(["x"], ["1"], ["1"]), params, CTX)

    # found when the params are validated (on the driver, by `rlpipe validate`), not at step 0
    broken = write(tmp_path, "def score(:\n", "broken.py")
    with pytest.raises(ValidationError, match=rf"{broken}:1: SyntaxError"):
        RuleRewardParams.model_validate({"function": {"path": str(broken), "name": "score"}})
    with pytest.raises(ValidationError, match=r"defines no function 'nope'.*\['score'\]"):
        RuleRewardParams.model_validate({"function": {"path": str(path), "name": "nope"}})
    two = write(tmp_path, "def score(text, truth):\n    return 0.0\n", "two.py")
    with pytest.raises(ValidationError, match=r"score\(text, truth\), which cannot take verl's"):
        RuleRewardParams.model_validate({"function": {"path": str(two), "name": "score"}})
    strict_trl = write(tmp_path, "def score(completions, solution):\n    return [0.0]\n", "strict.py")
    with pytest.raises(ValidationError, match=r"cannot take TRL's keywords prompts, completions.*\*\*kwargs"):
        RuleRewardParams.model_validate({"function": {"path": str(strict_trl), "name": "score"}})

    with pytest.raises(ValidationError, match="not found"):
        RuleRewardParams.model_validate({"function": {"path": str(tmp_path / "missing.py")}})
    with pytest.raises(ValidationError, match="drop `routes`"):
        RuleRewardParams.model_validate({"function": {"path": str(path), "name": "score"}, "routes": {"x": "math"}})


def test_function_runs_on_a_ray_worker_without_the_file(tmp_path, monkeypatch, ray_session):
    """The driver resolves and reads the file; the worker compiles the shipped source
    (the file is gone and the worker's directory is not the driver's)."""
    from rlpipe.engine.execution.ray_worker import run_task_stage

    write(tmp_path, FIVE_LINES)
    monkeypatch.chdir(tmp_path)
    params = RuleRewardParams.model_validate({"function": {"path": "my_reward.py", "name": "score"}})
    dumped = params.model_dump(mode="json")  # what the plan hands the executor
    os.remove(tmp_path / "my_reward.py")
    table = batch(["x", "len"], ["42", "abc"], ["42", ""])
    out = ray_session.get(run_task_stage.remote("reward", "rule", dumped, table, CTX))
    np.testing.assert_allclose(out.columns["reward"].to_numpy(), [1.0, 0.3], rtol=1e-6)

    write(tmp_path, RAISES)
    dumped = RuleRewardParams.model_validate({"function": {"path": "my_reward.py", "name": "score"}}).model_dump()
    with pytest.raises(Exception, match="my_reward.py:3"):
        ray_session.get(run_task_stage.remote("reward", "rule", dumped, table, CTX))
    assert StageError  # the worker wraps it in a StageError naming reward/rule


VERL_KEYWORDS = """\
def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):
    # verl calls by keyword: the order of the parameters is the user's
    return {"score": float(extra_info["level"]) / 10 if solution_str == ground_truth else 0.0,
            "index": float(extra_info["sample_index"])}
"""

TRL_BATCHED = """\
def accuracy(completions, solution, prompts, **kwargs):
    assert kwargs["ground_truth"] == [str(s) for s in solution] and len(kwargs["completion_ids"]) == len(completions)
    return [1.0 if c[0]["content"] == str(s) and p[-1]["content"].endswith("?") else 0.25
            for c, s, p in zip(completions, solution, prompts)]
"""


def with_info(table, infos):
    return table.append_column("extra_info", pa.array([None if i is None else json.dumps(i) for i in infos],
                                                      column_type("extra_info")))


def test_a_verl_function_gets_the_rows_extra_info_by_keyword(tmp_path):
    path = write(tmp_path, VERL_KEYWORDS)
    params = RuleRewardParams.model_validate({"function": {"path": str(path)}})
    assert params.function.style == "verl"  # decided on the driver, from the signature
    table = with_info(batch(["x", "x", "x"], ["7", "7", "8"], ["7", "7", "7"]),
                      [{"level": 3}, {"level": 5, "sample_index": 99}, {"level": 9}])
    out = rule_reward(table, params, CTX)
    # by hand: 3/10, 5/10 (the dataset's own sample_index wins over rlpipe's), a mismatch
    np.testing.assert_allclose(out.columns["reward"].to_numpy(), [0.3, 0.5, 0.0], rtol=1e-6)
    assert out.metrics["reward/index/mean"] == pytest.approx((0 + 99 + 0) / 3)  # sample_index is i % 2


def test_a_trl_batched_function_gets_lists_and_the_rows_fields_as_keywords(tmp_path):
    path = write(tmp_path, TRL_BATCHED)
    params = RuleRewardParams.model_validate({"function": {"path": str(path), "name": "accuracy"}})
    assert params.function.style == "trl"  # it has a `completions` parameter
    table = batch(["x", "x", "x", "x"], ["4", "5", "4", "9"], ["4", "4", "4", "9"], ["ok", "ok", "ok", "failed"])
    table = table.append_column("response_ids", pa.array([[1], [2], [1], [3]], column_type("response_ids")))
    chat = [{"role": "user", "content": "2+2?"}]
    table = with_info(table, [{"prompt": chat, "solution": 4}, {"prompt": chat, "solution": 4},
                              {"prompt": [{"role": "user", "content": "2+2"}], "solution": 4}, {"solution": 9}])
    out = rule_reward(table, params, CTX)
    # by hand: right; wrong (0.25); right but its prompt has no "?" (0.25); the failed row is not scored
    np.testing.assert_allclose(out.columns["reward"].to_numpy(), [1.0, 0.25, 0.25, 0.0], rtol=1e-6)
    short = write(tmp_path, "def f(completions, **kw):\n    return [1.0]\n", "short.py")
    params = RuleRewardParams.model_validate({"function": {"path": str(short), "name": "f"}})
    with pytest.raises(RewardFunctionError, match=r"one float per completion \(2\); got list"):
        rule_reward(with_info(batch(["x", "x"], ["1", "2"], ["1", "2"]), [{}, {}])
                    .append_column("response_ids", pa.array([[1], [2]], column_type("response_ids"))), params, CTX)
