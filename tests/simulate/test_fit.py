"""Cost fits: linear, non-negative, a floor, and a proportional guess for what a recording did not vary."""

from __future__ import annotations

import numpy as np
import pytest

from rlpipe.simulate.fit import FLOOR_SHARE, fit_cost


def test_recovers_a_linear_cost():
    rows = np.array([8, 16, 32, 8, 24.0])
    tokens = np.array([100, 90, 400, 20, 300.0])
    fit = fit_cost(0.05 + 0.001 * rows + 0.0002 * tokens, {"tokens": tokens, "rows": rows})
    assert fit.intercept_s == pytest.approx(0.05)
    assert fit.coef == pytest.approx({"tokens": 0.0002, "rows": 0.001})
    assert fit.unidentified == [] and fit.rmse_s == pytest.approx(0, abs=1e-12)
    assert fit(rows=10, tokens=50) == pytest.approx(0.05 + 0.01 + 0.01)


def test_coefficients_are_never_negative():
    tokens = np.array([10, 20, 30, 40.0])
    fit = fit_cost([0.4, 0.3, 0.2, 0.1], {"tokens": tokens})  # more work, less time: noise, not a saving
    assert fit.coef["tokens"] == 0 and fit.intercept_s == pytest.approx(0.25)


def test_a_constant_feature_takes_the_constant_part_proportionally():
    rows = np.full(4, 64.0)
    tokens = np.array([100, 120, 140, 160.0])
    fit = fit_cost(0.1 + 0.001 * tokens, {"tokens": tokens, "rows": rows})
    assert fit.unidentified == ["rows"] and fit.carrier == "rows"
    assert fit.intercept_s == 0 and fit.coef["rows"] == pytest.approx(0.1 / 64)
    assert fit.coef["tokens"] == pytest.approx(0.001)
    assert fit(rows=128, tokens=100) == pytest.approx(0.2 + 0.1)  # twice the rows: twice their part


def test_the_floor_keeps_a_small_call_from_costing_nothing():
    fit = fit_cost([0.4, 0.4, 0.4], {"tokens": [40, 40, 40]})
    assert fit.coef["tokens"] == pytest.approx(0.01) and fit.floor_s == pytest.approx(FLOOR_SHARE * 0.4)
    assert fit(tokens=1) == pytest.approx(FLOOR_SHARE * 0.4)
    with pytest.raises(ValueError, match="tokens"):
        fit(rows=3)


def test_a_length_that_barely_varies_is_not_identified():
    """Calls that all hit the length cap but one or two (longest 96, 95, 94): a fit that took that spread as a
    signal put the whole decode loop in the call's overhead; under IDENTIFYING_SPREAD it is constant."""
    longest = np.array([96, 96, 95, 96, 94, 96.0])
    tokens = np.array([1200, 1500, 1300, 1700, 1250, 1600.0])
    durations = 0.0012 * longest + 2e-5 * tokens + np.array([0.001, -0.0004, 0.0006, -0.001, 0.0003, 0.0])  # noise
    fit = fit_cost(durations, {"decode_steps": longest, "tokens": tokens})
    assert fit.unidentified == ["decode_steps"] and fit.carrier == "decode_steps" and fit.intercept_s == 0
    assert fit.coef["decode_steps"] == pytest.approx(0.0012, rel=0.1)
