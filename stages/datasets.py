"""Datasets: the finite text sets prompts are drawn from (registry kind ``dataset``).

A dataset is ``fn(params, seed) -> pa.Table``: the whole set, with string columns
``prompt``, ``ground_truth`` and ``data_source`` (the scorer route, see
:mod:`rlpipe.stages.reward`), registered as a :class:`DatasetSpec` with its params
model so ``data.params`` of a YAML is validated before anything runs. Built-ins:
``digits`` (a learnable toy task generated locally, the quickstart: ``"371="`` →
``"2"``), ``jsonl`` / ``parquet`` / ``hf`` (local files and Hugging Face datasets, in verl's and TRL's
formats too: :mod:`rlpipe.stages.dataset_records`) and
``arithmetic`` (``"7*8="`` → ``"56"``: the agent pipelines' task, solvable with a
calculator tool), ``gsm8k_sample`` (templated GSM8K-style word problems with integer answers,
generated deterministically; ``pipelines/data/gsm8k_sample.jsonl`` holds 100, made by
``python -c "from rlpipe.stages.datasets import *; write_jsonl(load_dataset('gsm8k_sample',
{'size': 100}, 0), 'pipelines/data/gsm8k_sample.jsonl')"``; the same 100 in verl's layout,
``pipelines/data/gsm8k_sample_verl.parquet``, by ``write_verl_parquet`` in place of ``write_jsonl``).

A dataset may add the string columns ``prompt_messages`` (a chat prompt's messages, JSON),
``extra_info`` (JSON details for the reward function) and ``agent``; they are kept.

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
from pydantic import BaseModel, Field, ValidationError

from rlpipe.errors import ConfigError
from rlpipe.registry import registry
from rlpipe.stages.dataset_records import (  # noqa: F401 - DatasetError, DatasetParams, TEXT_*: this module's API
    OPTIONAL_COLUMNS,
    PREVIEW_ROWS,
    PROMPT,
    Preview,
    TEXT_COLUMNS,
    TEXT_SCHEMA,
    DatasetError,
    DatasetParams,
    HfParams,
    RecordParams,
    load_files,
    load_hf,
    read_files,
    read_hf,
    read_jsonl,
    read_parquet,
)

DATASETS = registry("dataset")


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its name, generator/loader function and params model."""

    name: str
    fn: Callable[[Any, int], pa.Table]
    params_model: type[BaseModel]
    preview: Callable[[Any, int, int], Preview] | None = None
    """Validate-time read ``(params, rows, whole_below_bytes)``: files exist, and every row of a file up to
    ``whole_below_bytes`` (the first ``rows`` of a bigger one) parses and has the fields."""


def dataset(name: str, params: type[BaseModel], preview: Callable[[Any, int, int], Preview] | None = None,
            ) -> Callable:
    """Decorator registering ``fn(params, seed) -> pa.Table`` as dataset ``name``."""

    def decorate(fn: Callable[[Any, int], pa.Table]) -> Callable[[Any, int], pa.Table]:
        DATASETS.add(name, DatasetSpec(name, fn, params, preview))
        return fn

    return decorate


def preview_dataset(name: str, params: dict[str, Any] | BaseModel | None, whole_below_bytes: int = 0,
                    rows: int = PREVIEW_ROWS) -> Preview | None:
    """The dataset's validate-time read, if it has one (file datasets do: every row of a file up to
    ``whole_below_bytes``, the first ``rows`` of a bigger one)."""
    spec = dataset_spec(name)
    return spec.preview(validate_params(name, params), rows, whole_below_bytes) if spec.preview is not None else None


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
    optional = {name: table.column(name).cast(pa.string()) for name in OPTIONAL_COLUMNS if name in table.column_names}
    table = table.select(list(TEXT_COLUMNS)).cast(TEXT_SCHEMA)
    for name, column in optional.items():
        table = table.append_column(name, column)
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
    """Random digit strings and a digit task's answer (copy, reverse, successor, last_digit_successor)."""
    rng = np.random.default_rng(seed if params.seed is None else params.seed)
    prompt_digits = rng.integers(0, 10, size=(params.size, params.num_digits))
    prompts = np.char.add(_digit_strings(prompt_digits), "=")
    answers = _digit_strings(digits_answers(prompt_digits, params.task))
    return _table(prompts.tolist(), answers.tolist(), "digits")


class FileParams(RecordParams):
    """Local files (dataset_records: field names, chat prompts, nested keys)."""

    path: str | list[str]
    """Local file, or a list of files concatenated in order."""


@dataset("jsonl", FileParams, preview=lambda params, rows, whole: read_files(params, read_jsonl, rows, whole))
def jsonl(params: FileParams, seed: int) -> pa.Table:
    """Local JSON-lines files (TRL-style records: text or chat-message prompts, nested answer keys)."""
    return load_files(params, read_jsonl)


@dataset("parquet", FileParams, preview=lambda params, rows, whole: read_files(params, read_parquet, rows, whole))
def parquet(params: FileParams, seed: int) -> pa.Table:
    """Local parquet files, e.g. verl's preprocessed datasets read as they are."""
    return load_files(params, read_parquet)


@dataset("hf", HfParams, preview=lambda params, rows, whole: read_hf(params, rows, whole))
def hf(params: HfParams, seed: int) -> pa.Table:
    """A Hugging Face `datasets` dataset on this machine (a save_to_disk folder or local data files)."""
    return load_hf(params)


def write_jsonl(table: pa.Table, path: str | Path) -> None:
    """Write a text dataset as JSON lines (the format the ``jsonl`` dataset reads)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("w", encoding="utf-8") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_verl_parquet(table: pa.Table, path: str | Path, data_source: str = "openai/gsm8k",
                       split: str = "train") -> None:
    """Write a text dataset in verl's preprocessed layout (what verl's examples/data_preprocess scripts write):
    ``data_source``, ``prompt`` as one user message, ``ability``, ``reward_model: {style, ground_truth}`` and
    ``extra_info: {split, index}``. The ``parquet`` dataset reads it back with
    ``answer_key: reward_model.ground_truth`` and ``data.apply_chat_template: true``."""
    import pyarrow.parquet as pq

    rows = [{"data_source": data_source, "prompt": [{"role": "user", "content": row["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
             "extra_info": {"split": split, "index": i}} for i, row in enumerate(table.to_pylist())]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


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
    """Generated GSM8K-style word problems with their numeric answers (no download)."""
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
