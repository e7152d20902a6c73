"""A user's own reward in five lines: ``reward.params.function: {path: my_reward.py, name: score}``.

Two signatures, the ones verl and TRL users already have::

    def compute_score(data_source, solution_str, ground_truth, extra_info):      # verl, one row per call
        return 1.0 if ground_truth in solution_str else 0.0     # or {"score": 1.0, "length": 12.0}

    def accuracy(completions, solution, **kwargs):                                # TRL, batched
        return [1.0 if s in c else 0.0 for c, s in zip(completions, solution)]

A verl function returns a float, or a dict with ``score`` plus extra numeric metrics (each reported
as ``reward/<key>/mean``); it is called with those four keyword names when it has them (verl calls
it so), else positionally. ``extra_info`` is the row's ``extra_info`` field (verl's datasets carry
one) or, for a row without one, the row's other fields (rlpipe.stages.dataset_records); rlpipe adds
``uid`` and ``sample_index``.
A TRL function (``style: trl``, or ``auto`` when it has a ``completions`` parameter) gets lists, one
entry per row: ``prompts`` (a chat prompt's messages; None for a text prompt, as the reward stage gets
token ids, not prompt text, and for a row with its own ``extra_info``, verl's, which holds no prompt),
``completions`` (text, or ``[{"role": "assistant", "content": ...}]`` when the prompt was messages),
``completion_ids``,
``ground_truth``, ``data_source`` and every field of the rows' ``extra_info`` as a keyword
(TRL passes a dataset's columns so: ``solution`` above), and returns one float per row.

Shipping: the path is resolved on the driver (relative to the working directory) and
the file's source is read there and carried in the validated params, so a Ray worker
with another working directory or on another node compiles the very same source;
compiling under the absolute path keeps tracebacks pointing at the user's file. The driver
also compiles it when the params are validated (``rlpipe validate``, before Ray starts) and
checks its signature. Errors (file missing, syntax error, function missing, a signature that
cannot take the arguments, an exception or a bad return value while scoring) name the file and,
where there is one, the line.

Left out: async functions, TRL's ``trainer_state`` and reward-function lists (write one function
that combines them).
"""

from __future__ import annotations

import functools
import inspect
import json
import linecache
import traceback
from pathlib import Path
from typing import Any, Callable, Literal

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
    """Name of the function in that file (module docstring: the two signatures)."""
    style: Literal["auto", "verl", "trl"] = "auto"
    """`verl`: fn(data_source, solution_str, ground_truth, extra_info) per row → float | dict; `trl`: TRL's
    batched fn(prompts, completions, **columns) → list[float]; `auto`: `trl` when the function has a
    `completions` parameter, else `verl` (decided on the driver when the params are validated)."""
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
            try:  # on the driver, before anything starts: the file compiles and the signature fits
                self.style = caller(self).style
            except RewardFunctionError as exc:
                raise ValueError(str(exc)) from None
        return self


TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "ground_truth", "data_source")
"""The keywords a TRL-style function always gets (the rows' extra_info fields come on top)."""


class Caller:
    """How one loaded function is called (decided once per process and source)."""

    def __init__(self, ref: RewardFunction, fn: Callable[..., Any]):
        self.ref, self.fn = ref, fn
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or C function: call it the documented way
            signature = None
        self.style = ref.style if ref.style != "auto" else (
            "trl" if signature is not None and "completions" in signature.parameters else "verl")
        self.by_keyword = True
        if signature is None:
            return
        where = f"reward function {ref.name!r} ({ref.path}) has signature {ref.name}{signature}"
        if self.style == "trl":
            try:  # partial: the parameters beyond these come from the rows' fields (TRL: the dataset's columns)
                signature.bind_partial(**dict.fromkeys(TRL_ARGUMENTS, []))
            except TypeError:
                raise RewardFunctionError(f"{where}, which cannot take TRL's keywords {', '.join(TRL_ARGUMENTS)} "
                                          "(and the rows' fields); end its parameters with **kwargs")
            return
        keywords = dict(data_source="", solution_str="", ground_truth="", extra_info={})
        if _binds(signature, **keywords):
            return
        self.by_keyword = False
        if not _binds(signature, *keywords.values()):
            raise RewardFunctionError(f"{where}, which cannot take verl's (data_source, solution_str, ground_truth, "
                                      "extra_info); give it those parameters, or write TRL's batched "
                                      "fn(completions, **kwargs) with style: trl")

    def verl(self, data_source: str, solution: str, truth: str, extra_info: dict[str, Any]) -> Any:
        if self.by_keyword:
            return self.fn(data_source=data_source, solution_str=solution, ground_truth=truth, extra_info=extra_info)
        return self.fn(data_source, solution, truth, extra_info)


def _binds(signature: inspect.Signature, *args: Any, **kwargs: Any) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


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


@functools.lru_cache(maxsize=16)
def _caller(path: str, name: str, source: str, style: str) -> Caller:
    ref = RewardFunction.model_construct(path=path, name=name, source=source, style=style)
    return Caller(ref, _compile(path, name, source))


def caller(ref: RewardFunction) -> Caller:
    """How to call the user's function (its style and calling convention, decided once per process)."""
    return _caller(ref.path, ref.name, ref.source or "", ref.style)


def score_rows(ref: RewardFunction, data_sources: list[str], solutions: list[str], truths: list[str],
               infos: list[dict[str, Any]], completion_ids: list[list[int]] | None = None,
               ) -> tuple[list[float], dict[str, list[float]]]:
    """Each row's score and the extra metrics (verl's dicts) by the user's function; any failure names the
    file and line. ``infos``: each row's extra_info (module docstring)."""
    call = caller(ref)
    if call.style == "trl":
        return _trl_scores(ref, call.fn, data_sources, solutions, truths, infos, completion_ids), {}
    scores, extras = [], {}
    for source, solution, truth, info in zip(data_sources, solutions, truths, infos):
        try:
            value = call.verl(source, solution, truth, info)
        except Exception as exc:
            raise RewardFunctionError(f"reward function {ref.name!r} raised at {_where(ref.path, exc)}: "
                                      f"{type(exc).__name__}: {exc}") from exc
        score, more = _checked_value(ref, value)
        scores.append(score)
        for key, extra in more.items():
            extras.setdefault(key, []).append(extra)
    return scores, extras


def _trl_scores(ref: RewardFunction, fn: Callable[..., Any], data_sources: list[str], solutions: list[str],
                truths: list[str], infos: list[dict[str, Any]], completion_ids: list[list[int]] | None) -> list[float]:
    prompts = [info.get("prompt") for info in infos]
    completions = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                   for prompt, text in zip(prompts, solutions)]
    columns = {key: [info.get(key) for info in infos]
               for key in dict.fromkeys(k for info in infos for k in info) if key != "prompt"}
    kwargs = {**columns, "ground_truth": truths, "data_source": data_sources, "completion_ids": completion_ids}
    try:
        values = fn(prompts=prompts, completions=completions, **kwargs)
    except TypeError as exc:
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:  # the call itself did not bind
            raise RewardFunctionError(f"reward function {ref.name!r} ({ref.path}) cannot take TRL's arguments: "
                                      f"{exc}; it gets prompts, completions and {sorted(kwargs)}") from None
        raise RewardFunctionError(f"reward function {ref.name!r} raised at {_where(ref.path, exc)}: "
                                  f"TypeError: {exc}") from exc
    except Exception as exc:
        raise RewardFunctionError(f"reward function {ref.name!r} raised at {_where(ref.path, exc)}: "
                                  f"{type(exc).__name__}: {exc}") from exc
    try:
        values = list(values)
    except TypeError:
        values = None
    if values is None or len(values) != len(solutions):
        raise RewardFunctionError(f"reward function {ref.name!r} ({ref.path}) is TRL-style (batched) and must return "
                                  f"one float per completion ({len(solutions)}); got {type(values).__name__}")
    return [_checked_value(ref, v)[0] for v in values]


def _checked_value(ref: RewardFunction, value: Any) -> tuple[float, dict[str, float]]:
    """(score, extra metrics) of one returned value: a finite float, or a dict with a finite 'score'."""
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


def row_info(extra_info: str | None, uid: str, sample_index: int) -> dict[str, Any]:
    """A row's extra_info for the function: the dataset's (JSON) with rlpipe's uid and sample_index added."""
    info = json.loads(extra_info) if extra_info else {}
    info.setdefault("uid", uid)
    info.setdefault("sample_index", sample_index)
    return info
