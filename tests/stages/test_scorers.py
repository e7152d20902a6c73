"""Rule-based scorers: digits partial credit, math answer verification, exact match (code: test_code_scorer.py)."""

import pickle

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.stages.scorers import (
    SCORERS,
    ScorerError,
    ScorerInfraError,
    digits,
    exact_match,
    extract_answer,
    math_answer,
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


def test_infra_error_keeps_its_fields_across_processes():
    err = pickle.loads(pickle.dumps(ScorerInfraError("down", failed=[1], scores=[0.5, 0.0])))
    assert str(err) == "down" and err.failed.tolist() == [1] and err.scores.tolist() == [0.5, 0.0]


def test_tool_answer_scores_the_text_after_the_last_observation():
    from rlpipe.stages.scorers import SCORERS

    score = SCORERS.get("tool_answer")
    got = score(["[7*8]=56;56", "[7*8]=56;5", "<tool_call>{}</tool_call><tool_response>56</tool_response>56",
                 "56", "[7*8]=56;"], ["56"] * 5)
    assert got.tolist() == [1.0, 0.5, 1.0, 1.0, 0.0]
