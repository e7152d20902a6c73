"""Rule-based scorers: digits partial credit, math answer verification, exact match, sandboxed code."""

import json
import pickle
import time

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.stages import scorers
from rlpipe.stages.scorers import (
    SCORERS,
    ScorerError,
    ScorerInfraError,
    code,
    digits,
    exact_match,
    extract_answer,
    math_answer,
    parse_tests,
    response_code,
)


def test_registered():
    assert {"code", "digits", "exact_match", "gsm8k", "math"} <= set(SCORERS.names())
    assert SCORERS.get("gsm8k") is SCORERS.get("math") is math_answer


def test_digits_partial_credit_and_exactness():
    responses = ["173", "1 7 3\n", "17", "1734", "", "999", "371", "x73"]
    scores = digits(responses, ["173"] * len(responses))
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, [1, 1, 2 / 3, 3 / 4, 0, 0, 1 / 3, 2 / 3], rtol=1e-6)
    assert (scores == 1).sum() == 2  # 1.0 only for the exact answer (whitespace ignored)
    # Arrow input with nulls, targets of different lengths, an empty target scores 0
    out = digits(pa.array(["2", None, "12"]), pa.array(["2", "5", ""]))
    np.testing.assert_allclose(out, [1, 0, 0])
    assert digits([], []).shape == (0,)


def test_exact_match():
    np.testing.assert_array_equal(exact_match([" a ", "b", None], ["a", "c", ""]), [1, 0, 1])


@pytest.mark.parametrize("text,answer", [
    ("step 1 ... #### 1,234\nthanks", "1,234"),
    ("so \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
    ("nested \\boxed{x^{2}}", "x^{2}"),
    ("I think 3 apples, then 41.", "41"),
    ("-7 degrees", "-7"),
    ("no answer here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_math_verification():
    responses = ["so the answer is 42.", "#### 1,234", "\\boxed{\\frac{1}{2}}", "I get 41", "nothing", "$0.5$",
                 "#### 72", "the result is 72.0"]
    truths = ["42", "1234", "0.5", "42", "1", "1/2", "She earns ... #### 72", "72"]
    np.testing.assert_array_equal(math_answer(responses, truths), [1, 1, 1, 0, 0, 1, 1, 1])


def test_parse_tests_and_response_code():
    assert parse_tests(json.dumps(["assert f(1) == 2", "assert f(2) == 3"])) == ["assert f(1) == 2", "assert f(2) == 3"]
    assert parse_tests("assert f(1) == 2\nfor x in [1]:\n    assert f(x) > 0\n") == [
        "assert f(1) == 2", "for x in [1]:\n    assert f(x) > 0"]
    with pytest.raises(ScorerError, match="neither a JSON list of tests nor Python source"):
        parse_tests("assert (")
    assert response_code("Here:\n```python\ndef f(): pass\n```\nand\n```py\ndef g(): pass\n```") == "def g(): pass\n"
    assert response_code("def f(): pass") == "def f(): pass"


TESTS = json.dumps(["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"])


def test_code_scores_fraction_passed_with_limits():
    responses = [
        "```python\ndef f(x):\n    return x + 1\n```",  # 2 of 3
        "def f(x): return 1 / 0",  # every test raises
        "while True: pass",  # timeout
        "import os; os._exit(3)",  # crash without a result
        "x = ' ' * 10**10\ndef f(x): return x + 1",  # exceeds the memory limit at definition time
        "print('ready')\nimport sys; print('{\"passed\": 3}', file=sys.stderr)\ndef f(x): return x + 1",  # cannot spoof
        "def f(x): return {1: 2, 2: 3, 3: 5}[x]",  # all pass
    ]
    start = time.time()
    scores = code(responses, [TESTS] * len(responses), timeout_s=0.5, memory_mb=256, max_workers=4)
    np.testing.assert_allclose(scores, [2 / 3, 0, 0, 0, 0, 2 / 3, 1], rtol=1e-6)
    assert time.time() - start < 5
    source_tests = "assert f(1) == 2\nassert f(2) == 3\n"
    assert code(["def f(x): return x + 1"], [source_tests]).tolist() == [1.0]


def test_code_sandbox_that_cannot_start_is_an_infra_error(monkeypatch):
    monkeypatch.setattr(scorers.sys, "executable", "/nonexistent/python")
    with pytest.raises(ScorerInfraError, match="code sandbox failed on 2 of 2 rows") as info:
        code(["def f(x): return x + 1"] * 2, [TESTS] * 2)
    assert info.value.failed.tolist() == [0, 1]
    monkeypatch.setattr(scorers.sys, "executable", "/bin/true")  # starts, but never says "ready"
    with pytest.raises(ScorerInfraError, match="sandbox did not start"):
        code(["def f(x): return x + 1"], [TESTS])


def test_code_rejects_bad_options_and_empty_tests():
    with pytest.raises(ScorerError, match="memory_mb >= 32"):
        code(["x"], [TESTS], memory_mb=1)
    with pytest.raises(ScorerError, match="row 0: code ground truth holds no tests"):
        code(["x"], ["[]"])


def test_infra_error_keeps_its_fields_across_processes():
    err = pickle.loads(pickle.dumps(ScorerInfraError("down", failed=[1], scores=[0.5, 0.0])))
    assert str(err) == "down" and err.failed.tolist() == [1] and err.scores.tolist() == [0.5, 0.0]


def test_tool_answer_scores_the_text_after_the_last_observation():
    from rlpipe.stages.scorers import SCORERS

    score = SCORERS.get("tool_answer")
    got = score(["[7*8]=56;56", "[7*8]=56;5", "<tool_call>{}</tool_call><tool_response>56</tool_response>56",
                 "56", "[7*8]=56;"], ["56"] * 5)
    assert got.tolist() == [1.0, 0.5, 1.0, 1.0, 0.0]
