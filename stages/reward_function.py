"""A user's own reward in five lines: ``reward.params.function: {path: my_reward.py, name: score}``.

The function is plain Python (verl's ``custom_reward_function``, TRL's ``reward_funcs``)::

    def score(data_source, solution_str, ground_truth, extra_info):
        return 1.0 if ground_truth in solution_str else 0.0     # or {"score": 1.0, "length": 12.0}

It returns a float, or a dict with ``score`` plus extra numeric metrics (each reported as
``reward/<key>/mean``). ``extra_info`` is a dict with the row's ``uid`` and ``sample_index``.

Shipping: the path is resolved on the driver (relative to the working directory) and
the file's source is read there and carried in the validated params, so a Ray worker
with another working directory or on another node compiles the very same source;
compiling under the absolute path keeps tracebacks pointing at the user's file.
Errors (file missing, syntax error, function missing, an exception or a bad return
value while scoring) name the file and, where there is one, the line.

Left out: async functions and batched (list-in, list-out) functions.
"""

from __future__ import annotations

import functools
import linecache
import traceback
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, model_validator

from rlpipe.errors import RlpipeError


class RewardFunctionError(RlpipeError):
    """The user's reward function could not be loaded or failed while scoring."""


class RewardFunction(BaseModel):
    """Where the user's reward function lives."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str
    """Python file defining the function, relative to the directory rlpipe is launched from (or absolute)."""
    name: str = "compute_score"
    """Name of the function in that file: fn(data_source, solution_str, ground_truth, extra_info) → float | dict."""
    source: str | None = None
    """The file's source, filled in when the params are validated on the driver (leave unset): workers
    compile this text, so they need neither the file nor the driver's working directory."""

    @model_validator(mode="after")
    def _read_source(self) -> "RewardFunction":
        if self.source is None:
            file = Path(self.path).expanduser().resolve()
            if not file.is_file():
                raise ValueError(f"reward function file {self.path!r} not found (resolved to {file}); "
                                 "give a path relative to the directory you launch rlpipe from, or an absolute one")
            self.path, self.source = str(file), file.read_text()
        return self


def _where(path: str, exc: BaseException) -> str:
    """'file:line' of the innermost frame of ``exc`` inside ``path`` (or the path alone)."""
    line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == path:
            line = frame.lineno
    return f"{path}:{line}" if line else path


@functools.lru_cache(maxsize=16)
def _compile(path: str, name: str, source: str) -> Callable[..., Any]:
    # linecache: tracebacks show the user's lines even where the file does not exist (a remote worker)
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    namespace: dict[str, Any] = {"__name__": f"rlpipe_reward_{Path(path).stem}", "__file__": path}
    try:
        exec(compile(source, path, "exec"), namespace)  # noqa: S102 - the user's own reward code
    except BaseException as exc:
        raise RewardFunctionError(f"loading reward function file {_where(path, exc)}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    fn = namespace.get(name)
    if not callable(fn):
        defined = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))
        raise RewardFunctionError(f"{path} defines no function {name!r}; functions in the file: {defined}; "
                                  "set reward.params.function.name")
    return fn


def load(ref: RewardFunction) -> Callable[..., Any]:
    """The user's function (compiled once per process and source)."""
    return _compile(ref.path, ref.name, ref.source or "")


def call(ref: RewardFunction, fn: Callable[..., Any], data_source: str, solution: str, truth: str,
         extra_info: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(score, extra metrics) of one row; any failure names the file and line."""
    try:
        value = fn(data_source, solution, truth, extra_info)
    except Exception as exc:
        raise RewardFunctionError(f"reward function {ref.name!r} raised at {_where(ref.path, exc)}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardFunctionError(f"reward function {ref.name!r} ({ref.path}) returned a dict without "
                                      f"'score' (keys {sorted(value)}); return a float or {{'score': ..., ...}}")
        extras = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise RewardFunctionError(f"reward function {ref.name!r} ({ref.path}) returned {value!r}; "
                                  "return a float or a dict with a float 'score'") from None
    if score != score or score in (float("inf"), float("-inf")):
        raise RewardFunctionError(f"reward function {ref.name!r} ({ref.path}) returned {score}; scores must be finite")
    return score, extras

