"""Datasets: the finite text sets prompts are drawn from (registry kind ``dataset``).

A dataset is ``fn(params, seed) -> pa.Table``: the whole set, with string columns
``prompt``, ``ground_truth`` and ``data_source`` (the scorer route, see
:mod:`rlpipe.stages.reward`), registered as a :class:`DatasetSpec` with its params
model so ``data.params`` of a YAML is validated before anything runs. Built-ins:
``digits`` (a learnable toy task generated locally, the quickstart: ``"371="`` →
``"2"``), ``jsonl`` / ``parquet`` (local files, configurable field names) and
``arithmetic`` (``"7*8="`` → ``"56"``: the agent pipelines' task, solvable with a
calculator tool), ``gsm8k_sample`` (templated GSM8K-style word problems with integer answers,
generated deterministically; ``pipelines/data/gsm8k_sample.jsonl`` holds 100, made by
``python -c "from rlpipe.stages.datasets import *; write_jsonl(load_dataset('gsm8k_sample',
{'size': 100}, 0), 'pipelines/data/gsm8k_sample.jsonl')"``).

Left out: tokenization, shuffling, batching (the engine's data loader), data larger
than memory, remote stores (HF hub, S3), multi-modal fields.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from rlpipe.errors import ConfigError
from rlpipe.registry import registry
from rlpipe.schemas.batch import AGENT, DATA_SOURCE, GROUND_TRUTH

PROMPT = "prompt"
TEXT_COLUMNS = (PROMPT, GROUND_TRUTH, DATA_SOURCE)
TEXT_SCHEMA = pa.schema([(name, pa.string()) for name in TEXT_COLUMNS])
DATASETS = registry("dataset")


class DatasetError(ConfigError):
    """A dataset cannot be loaded: a missing file or field, a malformed row."""


class DatasetParams(BaseModel):
    """Base of every dataset's params model: unknown keys, inf/nan and booleans for numbers are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        from rlpipe.schemas.config import refuse_bool_for_number

        return refuse_bool_for_number(cls, value, info)


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its name, generator/loader function and params model."""

    name: str
    fn: Callable[[Any, int], pa.Table]
    params_model: type[BaseModel]
    preview: Callable[[Any], None] | None = None
    """Validate-time check (no full load): files exist, the first rows parse and have the fields."""


def dataset(name: str, params: type[BaseModel], preview: Callable[[Any], None] | None = None) -> Callable:
    """Decorator registering ``fn(params, seed) -> pa.Table`` as dataset ``name``."""

    def decorate(fn: Callable[[Any, int], pa.Table]) -> Callable[[Any, int], pa.Table]:
        DATASETS.add(name, DatasetSpec(name, fn, params, preview))
        return fn

    return decorate


def preview_dataset(name: str, params: dict[str, Any] | BaseModel | None) -> None:
    """The dataset's validate-time check, if it has one (file datasets do)."""
    spec = dataset_spec(name)
    if spec.preview is not None:
        spec.preview(validate_params(name, params))


def dataset_spec(name: str) -> DatasetSpec:
    """The registered dataset ``name`` (unknown names raise listing the known ones)."""
    return DATASETS.get(name)


def validate_params(name: str, params: dict[str, Any] | BaseModel | None) -> BaseModel:
    """``params`` validated by dataset ``name``'s model; errors name the dataset and the field."""
    spec = dataset_spec(name)
    if isinstance(params, spec.params_model):
        return params
    try:
        return spec.params_model.model_validate(dict(params or {}))
    except ValidationError as exc:
        problems = "; ".join(f"data.params.{'.'.join(map(str, e['loc']))}: "
                             f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
                             for e in exc.errors())
        fields = ", ".join(spec.params_model.model_fields) or "(none)"
        raise ConfigError(f"invalid params for dataset {name!r}: {problems}. Its fields: {fields}") from None


def load_dataset(name: str, params: dict[str, Any] | BaseModel | None, seed: int) -> pa.Table:
    """Validate ``params``, build dataset ``name`` and check it has the three string columns (and keep the
    optional per-row ``agent`` column when it returns one)."""
    table = dataset_spec(name).fn(validate_params(name, params), seed)
    missing = [c for c in TEXT_COLUMNS if c not in table.column_names]
    if missing:
        raise DatasetError(f"dataset {name!r} returned no column(s) {missing}; it must return {list(TEXT_COLUMNS)}")
    agents = table.column(AGENT).cast(pa.string()) if AGENT in table.column_names else None
    table = table.select(list(TEXT_COLUMNS)).cast(TEXT_SCHEMA)
    if agents is not None:
        table = table.append_column(AGENT, agents)
    for column in TEXT_COLUMNS:
        if table.column(column).null_count:
            raise DatasetError(f"dataset {name!r} has null values in column {column!r}; fill or drop those rows")
    if table.num_rows == 0:
        raise DatasetError(f"dataset {name!r} is empty; check its params")
    return table


def _table(prompts, answers, data_source: str | list[str]) -> pa.Table:
    sources = [data_source] * len(prompts) if isinstance(data_source, str) else data_source
    return pa.table([pa.array(list(prompts), pa.string()), pa.array(list(answers), pa.string()),
                     pa.array(sources, pa.string())], schema=TEXT_SCHEMA)


class DigitsParams(DatasetParams):
    task: Literal["copy", "reverse", "successor", "last_digit_successor"] = "last_digit_successor"
    """copy: "371=" → "371"; reverse: → "173"; successor: (x+1) mod 10^n zero-padded → "372";
    last_digit_successor: (last digit + 1) mod 10 → "2" (the easiest to learn from scratch).
    No constant answer scores above 0.1 in expectation: prompt digits are i.i.d. uniform and
    each task maps them bijectively (copy/reverse: a target position is one prompt digit;
    successor: x → x+1 mod 10^n; last digit → +1 mod 10), so each target digit is uniform."""
    num_digits: int = Field(3, ge=1, le=15)
    """Digits per prompt."""
    size: int = Field(2048, ge=1)
    """Number of examples."""
    seed: int | None = None
    """Generator seed; None uses the run seed."""


def digits_answers(digits: np.ndarray, task: str) -> np.ndarray:
    """Answer digits ``[B, L]`` of ``task`` for prompt digits ``[B, n]`` (vectorized)."""
    if task == "copy":
        return digits
    if task == "reverse":
        return digits[:, ::-1]
    if task == "last_digit_successor":
        return (digits[:, -1:] + 1) % 10
    if task == "successor":
        powers = 10 ** np.arange(digits.shape[1] - 1, -1, -1, dtype=np.int64)
        value = (digits.astype(np.int64) * powers).sum(axis=1)
        nxt = (value + 1) % (10 ** digits.shape[1])
        return (nxt[:, None] // powers) % 10
    raise ValueError(f"unknown digits task {task!r}")


def _digit_strings(digits: np.ndarray) -> np.ndarray:
    chars = np.ascontiguousarray((digits + ord("0")).astype(np.uint8))
    return chars.view(f"S{digits.shape[1]}").ravel().astype(str)


@dataset("digits", DigitsParams)
def digits(params: DigitsParams, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed if params.seed is None else params.seed)
    prompt_digits = rng.integers(0, 10, size=(params.size, params.num_digits))
    prompts = np.char.add(_digit_strings(prompt_digits), "=")
    answers = _digit_strings(digits_answers(prompt_digits, params.task))
    return _table(prompts.tolist(), answers.tolist(), "digits")


class FileParams(DatasetParams):
    path: str | list[str]
    """Local file, or a list of files concatenated in order."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    answer_key: str = "ground_truth"
    """Field holding the reference answer (numbers become text; lists, e.g. unit tests, become JSON)."""
    data_source: str | None = None
    """Constant data_source for every row; None reads it from `data_source_key`."""
    data_source_key: str = "data_source"
    """Field holding each row's data_source (used when `data_source` is None)."""
    prompt_template: str = "{prompt}"
    """Format applied to every prompt, e.g. "{prompt}\\nPut the final answer after ####."."""
    limit: int | None = Field(None, ge=1)
    """Keep only the first `limit` rows."""
    agent_key: str | None = None
    """Field holding each row's agent (registry `agent`: the per-sample `agent` column; a null or missing value
    uses generate.params.agent); None = no such column, every row uses generate.params.agent."""

    @field_validator("prompt_template")
    @classmethod
    def _has_slot(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError('prompt_template must contain "{prompt}"')
        return value


def _paths(params: FileParams) -> list[Path]:
    paths = [Path(p) for p in ([params.path] if isinstance(params.path, str) else params.path)]
    for path in paths:
        if not path.is_file():
            raise DatasetError(f"dataset file {str(path)!r} does not exist (cwd {Path.cwd()}); fix data.params.path")
    return paths


def _as_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _text(table: pa.Table, key: str) -> list[str | None]:
    """A field as text: strings as they are, numbers as written, lists/objects (e.g. unit tests) as JSON."""
    try:
        return table.column(key).cast(pa.string()).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return [_as_text(v) for v in table.column(key).to_pylist()]


def _from_records(table: pa.Table, params: FileParams, where: str) -> pa.Table:
    keys = [params.prompt_key, params.answer_key] + ([params.data_source_key] if params.data_source is None else [])
    for key in keys:
        if key not in table.column_names:
            hint = " (or set data.params.data_source to a constant)" if key == params.data_source_key else ""
            raise DatasetError(f"{where} has no field {key!r}; fields: {table.column_names}. "
                               f"Set the matching *_key param{hint}")
    if params.limit:
        table = table.slice(0, params.limit)
    prompts = [p if p is None else params.prompt_template.replace("{prompt}", p) for p in _text(table, params.prompt_key)]
    sources = params.data_source or _text(table, params.data_source_key)
    out = _table(prompts, _text(table, params.answer_key), sources)
    if params.agent_key is not None:
        agents = _text(table, params.agent_key) if params.agent_key in table.column_names else [None] * out.num_rows
        out = out.append_column(AGENT, pa.array(agents, pa.string()))
    return out


def _read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows, number = [], 0
    with path.open(encoding="utf-8") as lines:
        while limit is None or len(rows) < limit:
            number += 1
            try:
                line = lines.readline()
            except UnicodeDecodeError:  # decoded in chunks: the bad byte is at or after this line
                raise DatasetError(f"{path}: not UTF-8 text (near line {number}); convert the file to UTF-8") from None
            if not line:
                break
            try:
                row = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg}); one object per line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: not a JSON object; one object per line")
            rows.extend([row] if row else [])
    return rows


def _records(rows: list[dict]) -> pa.Table:
    keys = dict.fromkeys(key for row in rows for key in row)
    return pa.table({key: pa.array([_as_text(row.get(key)) for row in rows], pa.string()) for key in keys})


PREVIEW_ROWS = 5
"""Rows of each file a validate-time preview parses."""


def _preview_jsonl(params: FileParams) -> None:
    for path in _paths(params):
        _from_records(_records(_read_jsonl(path, PREVIEW_ROWS)), params, str(path))


def _preview_parquet(params: FileParams) -> None:
    for path in _paths(params):
        try:
            first = next(pq.ParquetFile(path).iter_batches(batch_size=PREVIEW_ROWS), None)
            table = pa.Table.from_batches([first]) if first is not None else pq.read_schema(path).empty_table()
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{path}: not a readable Parquet file ({exc}); fix data.params.path") from None
        _from_records(table, params, str(path))


@dataset("jsonl", FileParams, preview=_preview_jsonl)
def jsonl(params: FileParams, seed: int) -> pa.Table:
    rows = [row for path in _paths(params) for row in _read_jsonl(path)]
    return _from_records(_records(rows), params, str(params.path))


@dataset("parquet", FileParams, preview=_preview_parquet)
def parquet(params: FileParams, seed: int) -> pa.Table:
    tables = [pq.read_table(path) for path in _paths(params)]
    return _from_records(pa.concat_tables(tables, promote_options="permissive"), params, str(params.path))


def write_jsonl(table: pa.Table, path: str | Path) -> None:
    """Write a text dataset as JSON lines (the format the ``jsonl`` dataset reads)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("w", encoding="utf-8") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena")
_ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "cards")


def _problem(rng: random.Random) -> tuple[str, int]:
    """One templated word problem and its integer answer."""
    name, other = rng.sample(_NAMES, 2)
    item, r, kind = rng.choice(_ITEMS), rng.randint, rng.randint(0, 7)
    if kind == 0:
        a, b, c = r(2, 30), r(2, 9), r(2, 12)
        return f"{name} has {a} {item} and buys {b} packs of {c} {item}. How many {item} does {name} have now?", a + b * c
    if kind == 1:
        a, b, c = r(8, 30), r(2, 10), r(2, 7)
        return f"{name} earns ${a} an hour and works {b} hours a day for {c} days. How many dollars is that?", a * b * c
    if kind == 2:
        b, c, d, left = r(3, 20), r(1, 10), r(2, 7), r(1, 30)
        return (f"A baker makes {b + c + left} muffins every day. She sells {b} of them and gives {c} to neighbors. "
                f"How many muffins are left over after {d} days?"), left * d
    if kind == 3:
        a, k = r(5, 40), r(3, 20)
        return f"{name} reads {a} pages a day. How many days does a book of {a * k} pages take {name}?", k
    if kind == 4:
        half, b = r(10, 60), r(1, 9)
        return f"{name} had ${2 * half}, spent half of it on {item}, then ${b} on lunch. How many dollars are left?", half - b
    if kind == 5:
        a, b, c = r(3, 15), r(4, 12), r(1, 40)
        return f"A hall has {a} rows of {b} chairs. {c} more chairs are brought in. How many chairs are there now?", a * b + c
    if kind == 6:
        a, b = r(4, 20), r(1, 15)
        return f"{name} is {a}. {other} is {b} years older than twice {name}'s age. How old is {other}?", 2 * a + b
    a, b, c, d = r(1, 5), r(2, 9), r(2, 12), r(1, 6)
    return (f"A store sells pencils for ${a} each and notebooks for ${b} each. {name} buys {c} pencils and "
            f"{d} notebooks. How many dollars does {name} spend?"), a * c + b * d


class Gsm8kSampleParams(DatasetParams):
    size: int = Field(500, ge=1)
    """Number of problems."""
    seed: int = 0
    """Generator seed; fixed by default so every run sees the same problems (the run seed only shuffles)."""
    instruction: str = GSM8K_INSTRUCTION
    """Appended to every problem (verl's GSM8K preprocessing does the same)."""


@dataset("gsm8k_sample", Gsm8kSampleParams)
def gsm8k_sample(params: Gsm8kSampleParams, seed: int) -> pa.Table:
    rng = random.Random(params.seed)
    problems = [_problem(rng) for _ in range(params.size)]
    prompts = [f"{q} {params.instruction}".strip() for q, _ in problems]
    return _table(prompts, [str(a) for _, a in problems], "gsm8k")


class ArithmeticParams(DatasetParams):
    ops: str = Field("*", min_length=1, pattern=r"^[+\-*]+$")
    """Operators drawn from (any of + - *), e.g. "*" or "+-*"."""
    min_value: int = Field(2, ge=0)
    """Smallest operand."""
    max_value: int = Field(9, ge=0)
    """Largest operand."""
    size: int = Field(1024, ge=1)
    """Number of examples."""
    data_source: str = "tool_answer"
    """The scorer route of every row (`tool_answer` scores the text after the last tool observation)."""


@dataset("arithmetic", ArithmeticParams)
def arithmetic(params: ArithmeticParams, seed: int) -> pa.Table:
    """``a<op>b=`` with integer answers; a model that calls the calculator can always get them right."""
    if params.max_value < params.min_value:
        raise DatasetError("data.params.max_value is smaller than min_value; swap them")
    rng = np.random.default_rng(seed)
    a, b = rng.integers(params.min_value, params.max_value + 1, size=(2, params.size))
    ops = np.array(list(params.ops))[rng.integers(0, len(params.ops), size=params.size)]
    values = np.where(ops == "+", a + b, np.where(ops == "-", a - b, a * b))
    prompts = [f"{x}{op}{y}=" for x, op, y in zip(a.tolist(), ops.tolist(), b.tolist())]
    return _table(prompts, [str(v) for v in values.tolist()], params.data_source)
