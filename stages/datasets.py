"""Datasets: the finite text sets that prompts are drawn from (registry kind ``dataset``).

A dataset is a function ``fn(params, seed) -> pa.Table`` returning the whole set
with string columns ``prompt``, ``ground_truth`` and ``data_source`` (the scorer
route, see :mod:`rlpipe.stages.reward`). It is registered as a
:class:`DatasetSpec` together with its pydantic params model, so the engine can
validate ``data.params`` of a pipeline YAML before anything runs. Tokenization,
shuffling and batching belong to the engine's data loader, not to datasets.

Built-ins:

* ``digits`` — a learnable toy task generated locally (the quickstart): prompt
  ``"371="`` → answer, e.g. the successor of the last digit, ``"2"``.
* ``jsonl`` / ``parquet`` — local files with configurable field names.
* ``gsm8k_sample`` — templated GSM8K-style word problems with integer answers,
  generated deterministically (a stand-in for GSM8K that needs no download).
  ``pipelines/data/gsm8k_sample.jsonl`` holds 100 of them, regenerated with
  ``python -m rlpipe.stages.datasets gsm8k_sample pipelines/data/gsm8k_sample.jsonl --size 100``.

Left out: streaming datasets larger than memory, remote stores (HF hub, S3),
chat templates (a prompt is plain text here), multi-modal fields.
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlpipe.errors import ConfigError
from rlpipe.registry import registry
from rlpipe.schemas.batch import DATA_SOURCE, GROUND_TRUTH

PROMPT = "prompt"
TEXT_COLUMNS = (PROMPT, GROUND_TRUTH, DATA_SOURCE)
TEXT_SCHEMA = pa.schema([(name, pa.string()) for name in TEXT_COLUMNS])

DATASETS = registry("dataset")


class DatasetError(ConfigError):
    """A dataset cannot be loaded: a missing file or field, a malformed row."""


class DatasetParams(BaseModel):
    """Base of every dataset's params model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its name, generator/loader function and params model."""

    name: str
    fn: Callable[[Any, int], pa.Table]
    params_model: type[BaseModel]


def dataset(name: str, params: type[BaseModel]) -> Callable:
    """Decorator registering ``fn(params, seed) -> pa.Table`` as dataset ``name``."""

    def decorate(fn: Callable[[Any, int], pa.Table]) -> Callable[[Any, int], pa.Table]:
        DATASETS.add(name, DatasetSpec(name, fn, params))
        return fn

    return decorate


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
        problems = "; ".join(
            f"data.params.{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        fields = ", ".join(spec.params_model.model_fields) or "(none)"
        raise ConfigError(f"invalid params for dataset {name!r}: {problems}. Its fields: {fields}") from None


def load_dataset(name: str, params: dict[str, Any] | BaseModel | None, seed: int) -> pa.Table:
    """Validate ``params``, build dataset ``name`` and check it has the three string columns."""
    table = dataset_spec(name).fn(validate_params(name, params), seed)
    missing = [c for c in TEXT_COLUMNS if c not in table.column_names]
    if missing:
        raise DatasetError(f"dataset {name!r} returned no column(s) {missing}; it must return {list(TEXT_COLUMNS)}")
    table = table.select(list(TEXT_COLUMNS)).cast(TEXT_SCHEMA)
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


# ---------------------------------------------------------------- digits (toy)

DigitsTask = Literal["copy", "reverse", "successor", "last_digit_successor"]


class DigitsParams(DatasetParams):
    task: DigitsTask = "last_digit_successor"
    """copy: "371=" → "371"; reverse: → "173"; successor: (x+1) mod 10^n, zero-padded → "372";
    last_digit_successor: (last digit + 1) mod 10 → "2" (the easiest to learn from scratch).
    In every task the answer is uniform over its strings when the prompt digits are, so no
    constant answer scores above 0.1 in expectation (copy/reverse: each target position is
    one uniform prompt digit; successor: x → x+1 mod 10^n is a bijection; last digit + 1: a
    bijection of a uniform digit)."""
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


# ---------------------------------------------------------------- local files


class FileParams(DatasetParams):
    path: str | list[str]
    """Local file, or a list of files concatenated in order."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    answer_key: str = "ground_truth"
    """Field holding the reference answer (numbers are converted to text)."""
    data_source: str | None = None
    """Constant data_source for every row; None reads it from `data_source_key`."""
    data_source_key: str = "data_source"
    """Field holding each row's data_source (used when `data_source` is None)."""
    prompt_template: str = "{prompt}"
    """Format applied to every prompt, e.g. "{prompt}\\nPut the final answer after ####."."""
    limit: int | None = Field(None, ge=1)
    """Keep only the first `limit` rows."""

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


def _text(table: pa.Table, key: str, where: str) -> list:
    try:
        return table.column(key).cast(pa.string()).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DatasetError(f"{where}: field {key!r} cannot be read as text ({exc}); it must hold strings or numbers") from None


def _from_records(table: pa.Table, params: FileParams, where: str) -> pa.Table:
    keys = [params.prompt_key, params.answer_key] + ([params.data_source_key] if params.data_source is None else [])
    for key in keys:
        if key not in table.column_names:
            hint = " (or set data.params.data_source to a constant)" if key == params.data_source_key else ""
            raise DatasetError(f"{where} has no field {key!r}; fields: {table.column_names}. "
                               f"Set the matching *_key param{hint}")
    if params.limit:
        table = table.slice(0, params.limit)
    prompts = _text(table, params.prompt_key, where)
    if params.prompt_template != "{prompt}":
        prompts = [params.prompt_template.format(prompt=p) if p is not None else None for p in prompts]
    sources = params.data_source or _text(table, params.data_source_key, where)
    return _table(prompts, _text(table, params.answer_key, where), sources)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg}); one object per line") from None
    return rows


@dataset("jsonl", FileParams)
def jsonl(params: FileParams, seed: int) -> pa.Table:
    paths = _paths(params)
    where = ", ".join(map(str, paths))
    try:
        table = pa.Table.from_pylist([row for path in paths for row in _read_jsonl(path)])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DatasetError(f"{where}: rows do not share one type per field ({exc})") from None
    return _from_records(table, params, where)


@dataset("parquet", FileParams)
def parquet(params: FileParams, seed: int) -> pa.Table:
    paths = _paths(params)
    tables = [pq.read_table(path) for path in paths]
    return _from_records(pa.concat_tables(tables, promote_options="permissive"), params, ", ".join(map(str, paths)))


def write_jsonl(table: pa.Table, path: str | Path) -> None:
    """Write a text dataset as JSON lines (the format the ``jsonl`` dataset reads)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("w", encoding="utf-8") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- gsm8k_sample

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena")
_ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "stamps", "shells", "cards")


def _problem(rng: random.Random) -> tuple[str, int]:
    """One templated word problem and its integer answer."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    r = rng.randint
    kind = r(0, 7)
    if kind == 0:
        a, b, c = r(2, 30), r(2, 9), r(2, 12)
        return f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} each. How many {item} does {name} have now?", a + b * c
    if kind == 1:
        a, b, c = r(8, 30), r(2, 10), r(2, 7)
        return f"{name} earns ${a} per hour and works {b} hours a day for {c} days. How many dollars does {name} earn?", a * b * c
    if kind == 2:
        b, c, d = r(3, 20), r(1, 10), r(2, 7)
        a = b + c + r(1, 30)
        return (f"A baker makes {a} muffins every day. She sells {b} of them and gives {c} to neighbors. "
                f"How many muffins are left over after {d} days?"), (a - b - c) * d
    if kind == 3:
        a, k = r(5, 40), r(3, 20)
        return f"{name} reads {a} pages a day. The book has {a * k} pages. How many days does {name} need to finish it?", k
    if kind == 4:
        half, b = r(10, 60), r(1, 9)
        return (f"{name} had ${2 * half}. {name} spent half of it on {item} and then ${b} on lunch. "
                f"How many dollars does {name} have left?"), half - b
    if kind == 5:
        a, b = r(3, 15), r(4, 12)
        c = r(1, a * b - 1)
        return (f"A hall has {a} rows of chairs with {b} chairs in each row. {c} chairs are broken. "
                f"How many chairs can be used?"), a * b - c
    if kind == 6:
        a, b = r(4, 20), r(1, 15)
        return f"{name} is {a} years old. {other} is {b} years older than twice {name}'s age. How old is {other}?", 2 * a + b
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


def main(argv: list[str] | None = None) -> None:
    """``python -m rlpipe.stages.datasets NAME OUT.jsonl [--size N] [--seed S]``."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a registered dataset to a JSONL file.")
    parser.add_argument("name")
    parser.add_argument("out")
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_jsonl(load_dataset(args.name, {"size": args.size}, args.seed), args.out)


if __name__ == "__main__":
    import sys

    # Run as a script, this module is `__main__`; alias it so the registry's import of
    # rlpipe.stages.datasets finds it instead of registering every dataset a second time.
    sys.modules.setdefault("rlpipe.stages.datasets", sys.modules[__name__])
    main()
