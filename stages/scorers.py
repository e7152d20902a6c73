"""Rule-based reward scorers (registry kind ``scorer``).

A scorer is ``fn(responses, ground_truths, **kwargs) -> np.ndarray[float32]`` with
one score in [0, 1] per row; ``responses`` and ``ground_truths`` are lists of
strings or Arrow string arrays (nulls read as ""); keyword arguments are its
options (``scorer_params`` of the reward stage). Each scorer's options are typed by its
own pydantic model (:func:`options_model`): the one it declares with
:func:`with_options`, else one built from its keyword parameters' annotations and
defaults, so ``validate`` refuses an unknown option or a bad value (``timeout_s: "ten"``,
``memory_mb: 1``, ``true`` for a number) before anything starts, naming the scorer and the
option. The ``reward`` stage routes each row to a scorer by its ``data_source``.

Built-ins:

* ``exact_match`` — 1 if the stripped response equals the stripped ground truth.
* ``digits`` — partial credit for the toy task: matching positions of the response
  (whitespace removed) and the target, over the longer of the two, so the first
  ``len(target)`` characters earn credit and only the exact answer scores 1.
* ``tool_answer`` — for agent trajectories: the final answer is the text after
  the last tool observation (after the last ``</tool_response>`` or the compact
  format's ``;``), scored like ``digits`` (partial credit per matching position).
* ``math`` / ``gsm8k`` — extract the final answer (after the last ``####``, else
  the last ``\\boxed{}``, else the last number), verify with ``math_verify``, fall
  back to numeric comparison; 0 or 1.
* ``code`` — the solution against the data's unit tests in the agents' sandbox
  (:mod:`rlpipe.stages.code_scorer`); a sandbox that cannot start raises
  :class:`ScorerInfraError`, which the reward stage turns into ``status == "failed"``.
"""

from __future__ import annotations

import inspect
import re
import reprlib
import threading
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from rlpipe.errors import RlpipeError
from rlpipe.registry import registry

SCORERS = registry("scorer")

TextColumn = Sequence[str | None] | pa.Array | pa.ChunkedArray | np.ndarray


class ScorerError(RlpipeError):
    """A scorer cannot score its input (e.g. malformed ground truth) or returned invalid scores."""


class ScorerInfraError(RlpipeError):
    """Scoring infrastructure failed (sandbox could not start, verifier unreachable).

    ``failed``: indices (within the scorer call) of the rows that could not be scored;
    None means all of them. ``scores``: scores of the other rows, when there are any.
    """

    def __init__(self, message: str, failed: Sequence[int] | None = None, scores: Sequence[float] | None = None):
        super().__init__(message)
        self.failed = None if failed is None else np.asarray(failed, dtype=np.int64)
        self.scores = None if scores is None else np.asarray(scores, dtype=np.float32)

    def __reduce__(self):  # keep the fields across processes
        return (type(self), (str(self), self.failed, self.scores))


class ScorerOptions(BaseModel):
    """Base of a scorer's options model: unknown options are errors; values are strict (no "10" for 10,
    no booleans for numbers, no inf/nan)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


def with_options(model: type[ScorerOptions]) -> Callable[[Callable], Callable]:
    """Decorator: the scorer's options are ``model``'s fields (the scorer takes them as keyword arguments)."""

    def attach(fn: Callable) -> Callable:
        fn.options_model = model
        return fn

    return attach


def options_model(name: str) -> type[BaseModel]:
    """The pydantic model of scorer ``name``'s options: declared with :func:`with_options`, else built from the
    keyword parameters after ``(responses, ground_truths)`` (unannotated ones take any value; a scorer
    taking ``**kwargs`` accepts unknown options)."""
    fn = SCORERS.get(name)
    declared = getattr(fn, "options_model", None)
    if declared is not None:
        return declared
    fields: dict[str, Any] = {}
    extra = "forbid"
    for param in list(inspect.signature(fn).parameters.values())[2:]:
        if param.kind is param.VAR_KEYWORD:
            extra = "allow"
        elif param.kind is not param.VAR_POSITIONAL:
            annotation = Any if param.annotation is param.empty else param.annotation
            fields[param.name] = (annotation, ... if param.default is param.empty else param.default)
    base_config = ConfigDict(**{**ScorerOptions.model_config, "extra": extra})
    return create_model(f"{name}_options", __config__=base_config, **fields)


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` validated by scorer ``name``'s model (defaults filled in); a ValueError naming
    ``scorer_params.<name>.<option>`` and what is wrong."""
    try:
        return options_model(name).model_validate(options).model_dump()
    except ValidationError as exc:
        problems = "; ".join(f"scorer_params.{name}.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {reprlib.repr(e['input'])})"
                             if e["type"] != "extra_forbidden" else
                             f"scorer_params.{name}.{'.'.join(map(str, e['loc']))}: unknown option of scorer {name!r}"
                             f" (its options: {', '.join(options_model(name).model_fields) or 'none'})"
                             for e in exc.errors())
        raise ValueError(problems) from None


def texts(values: TextColumn) -> list[str]:
    """A text column as a list of Python strings (nulls → "")."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = values.to_pylist()
    return ["" if v is None else str(v) for v in values]


@SCORERS.register("exact_match")
def exact_match(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    return np.array([r.strip() == g.strip() for r, g in zip(texts(responses), texts(ground_truths))], np.float32)


@SCORERS.register("digits")
def digits(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """Positional matches / max(len(target), len(response)); an empty target scores 0."""
    targets = texts(ground_truths)
    width = max((len(t) for t in targets), default=0) or 1
    stripped = ["".join(r.split()) for r in texts(responses)]
    response_len = np.array([len(r) for r in stripped], dtype=np.int64)
    target_len = np.array([len(t) for t in targets], dtype=np.int64)
    # fixed-width UCS-4 arrays viewed as code points [B, width]; padding is 0
    resp = np.array([r[:width] for r in stripped], dtype=f"<U{width}").view(np.uint32).reshape(-1, width)
    tgt = np.array(targets, dtype=f"<U{width}").view(np.uint32).reshape(-1, width)
    matched = ((resp == tgt) & (tgt != 0)).sum(axis=1)
    denom = np.maximum(target_len, response_len)
    return np.where(target_len > 0, matched / np.maximum(denom, 1), 0.0).astype(np.float32)


_OBSERVATION_END = re.compile(r"</tool_response>|;")


@SCORERS.register("tool_answer")
def tool_answer(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """``digits`` on the text after the last tool observation (the whole response if it called no tool)."""
    finals = [_OBSERVATION_END.split(r)[-1] for r in texts(responses)]
    return digits(finals, ground_truths)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: after the last ``####``, else the last ``\\boxed{}``, else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip().rstrip(".")
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def _to_float(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            return float(num) / float(den)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(gold: str, pred: str | None) -> bool:
    """``math_verify`` equivalence of two final answers, falling back to numeric comparison."""
    if not pred:
        return False
    import math_verify  # 0.5 s of sympy imports, paid on first use only

    # math_verify's timeouts use signal.alarm, which only works in the main thread
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        g = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        p = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
        if g and p and math_verify.verify(g, p, timeout_seconds=timeout):
            return True
    except Exception:  # noqa: BLE001 - a verifier error is a non-match; the numeric fallback decides
        pass
    a, b = _to_float(gold), _to_float(pred)
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(a))


@SCORERS.register("gsm8k")
@SCORERS.register("math")
def math_answer(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """1 if the response's final answer equals the ground truth's (``#### x`` in the ground truth is honored)."""
    golds = [(extract_answer(g) if "####" in g else g.strip()) for g in texts(ground_truths)]
    return np.array([answers_equal(g, extract_answer(r)) for r, g in zip(texts(responses), golds)], np.float32)
