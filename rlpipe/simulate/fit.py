"""Cost fits of ``rlpipe simulate``: a node's duration as a linear function of its work, with a floor.

``duration = max(floor_s, intercept_s + Σ coef[f] · f)`` over a few features (a node's rows and
response tokens; a generate call's decode steps and tokens), fitted by least squares to the
recorded executions with every coefficient ≥ 0 (a duration never falls as work grows): the
best non-negative fit over subsets of the features (there are two or three, so the search is
exact and cheap).

A recording rarely varies every feature: a sync run's steps all have ``prompts_per_step × n``
rows, and a fixed-length workload all the same tokens. A feature that does not vary (by
:data:`IDENTIFYING_SPREAD` of its mean at least) cannot be
told apart from the intercept; its coefficient is *not identified* (:attr:`CostFit.unidentified`).
Then the first constant feature in the caller's order of preference takes the whole constant part
(a proportional model: twice the work, twice the time) rather than the intercept (a fixed cost
that would make a larger batch free). The floor is a share of the shortest recorded execution
(:data:`FLOOR_SHARE`): the fixed cost of a call — a round trip, a kernel launch — that a
proportional fit cannot see, so a much smaller batch is not predicted to cost nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
from pydantic import Field

from rlpipe.schemas.config import Strict

FLOOR_SHARE = 0.25
"""The floor of a fit, as a share of the shortest recorded duration it was fitted on."""
IDENTIFYING_SPREAD = 0.05
"""A feature whose standard deviation is under this share of its mean is treated as constant: durations that
vary by more than that (noise) cannot tell its effect from the intercept's. A sync recording whose generate calls
all hit the length cap varies their decode steps by a token or two; fitted as a variable, the whole decode loop
went to the intercept (the call's overhead) and the async modes' replicas decoded almost for free."""


class CostFit(Strict):
    """A fitted duration: ``max(floor_s, intercept_s + Σ coef[f]·f)`` seconds."""

    intercept_s: float = Field(0.0, ge=0)
    """Seconds every execution costs whatever its work."""
    coef: dict[str, float] = Field(default_factory=dict)
    """Seconds per unit of each feature (``rows``, ``tokens``, ``decode_steps``), all ≥ 0."""
    floor_s: float = Field(0.0, ge=0)
    """The least an execution is predicted to take (FLOOR_SHARE × the shortest recorded one)."""
    samples: int = Field(0, ge=0)
    """Recorded executions fitted."""
    unidentified: list[str] = Field(default_factory=list)
    """Features that did not vary in the recording: their share of the time is a guess (see the module)."""
    rmse_s: float = Field(0.0, ge=0)
    """Root-mean-square residual of the fit on its own records (seconds)."""
    carrier: str | None = None
    """The constant feature charged with the part of the time the varying ones do not explain (None: the
    intercept kept it, or every feature varied)."""

    def __call__(self, **features: float) -> float:
        missing = set(self.coef) - set(features)
        if missing:
            raise ValueError(f"the cost needs the features {sorted(missing)}")
        value = self.intercept_s + sum(c * features[name] for name, c in self.coef.items())
        return max(self.floor_s, value)

    def scaled(self, factor: float) -> "CostFit":
        """The same fit at ``factor`` times the cost (every term and the floor)."""
        return self.model_copy(update={"intercept_s": self.intercept_s * factor, "floor_s": self.floor_s * factor,
                                       "coef": {name: c * factor for name, c in self.coef.items()}})

    @classmethod
    def constant(cls, seconds: float) -> "CostFit":
        """A fixed cost (hand-built calibrations, nodes with one record)."""
        return cls(intercept_s=max(0.0, seconds), samples=0)


def fit_cost(durations, features: dict[str, np.ndarray | list[float]]) -> CostFit:
    """The best non-negative least-squares fit of ``durations`` on ``features`` (their order = the order of
    preference for a constant part; see the module docstring)."""
    y = np.asarray(durations, dtype=np.float64)
    if len(y) == 0:
        return CostFit()
    cols = {name: np.asarray(v, dtype=np.float64) for name, v in features.items()}
    floor = FLOOR_SHARE * float(y.min())
    varying = [n for n, x in cols.items() if _varies(x)]
    constant = [n for n in cols if n not in varying]
    best: tuple[float, float, dict[str, float]] | None = None
    for size in range(len(varying), -1, -1):  # larger subsets first: on equal residuals the richer fit wins
        for subset in itertools.combinations(varying, size):
            fitted = _nonneg_lstsq(y, [cols[n] for n in subset])
            if fitted is None:
                continue
            intercept, coefs, sse = fitted
            if best is None or sse < best[0] * (1 - 1e-9) - 1e-15:
                best = (sse, intercept, dict(zip(subset, coefs)))
    if best is None:  # unreachable for durations ≥ 0 (the mean fits); kept total for odd input
        return CostFit.constant(float(np.mean(y)))
    sse, intercept, coef = best
    coef = {n: coef.get(n, 0.0) for n in varying}
    # the constant part goes to the first constant feature that is not zero (a proportional model)
    carrier = next((n for n in constant if float(np.mean(cols[n])) > 0), None)
    if carrier is not None and intercept > 0:
        coef[carrier] = intercept / float(np.mean(cols[carrier]))
        intercept = 0.0
    else:
        carrier = None
    for n in constant:
        coef.setdefault(n, 0.0)
    rmse = float(np.sqrt(sse / len(y)))
    return CostFit(intercept_s=intercept, coef=coef, floor_s=floor, samples=len(y), unidentified=constant,
                   rmse_s=rmse, carrier=carrier)


def _varies(x: np.ndarray) -> bool:
    return len(x) > 1 and float(np.std(x)) > IDENTIFYING_SPREAD * max(float(np.abs(np.mean(x))), 1e-12)


def _nonneg_lstsq(y: np.ndarray, xs: list[np.ndarray]) -> tuple[float, list[float], float] | None:
    """Least squares of y on [1, *xs]; None unless every coefficient is ≥ 0. A negative intercept is retried
    through the origin (the features alone)."""
    for with_intercept in (True, False):
        columns = ([np.ones_like(y)] if with_intercept else []) + xs
        if not columns:
            return None
        a = np.stack(columns, axis=1)
        solution, *_ = np.linalg.lstsq(a, y, rcond=None)
        intercept = float(solution[0]) if with_intercept else 0.0
        coefs = [float(c) for c in (solution[1:] if with_intercept else solution)]
        if intercept < 0 or any(c < 0 for c in coefs):
            continue
        sse = float(np.sum((a @ solution - y) ** 2))
        return intercept, coefs, sse
    return None
