"""Rows of local data (JSONL, Parquet, a Hugging Face ``datasets`` folder) as rlpipe's text dataset.

The formats people bring from verl and TRL load as they are, with field names set in ``data.params``:

* verl: ``prompt`` is a list of chat messages, the answer sits at ``reward_model.ground_truth``
  (``answer_key: reward_model.ground_truth``: a dotted key reaches into nested fields), plus
  ``data_source`` and ``extra_info`` (a dict);
* TRL's conversational datasets: ``prompt`` is a list of messages, the answer a column of its own
  (``answer_key: solution``).

A prompt that is a list of chat messages (``{"role": ..., "content": ...}``) stays a list: it travels
as JSON in the ``prompt_messages`` column and the data loader renders it with the tokenizer's chat
template (``data.apply_chat_template: true``; without it the run stops before it starts, naming the
field), never as the JSON text of the list. ``prompt`` then holds the last user message, for people
to read. A row's ``extra_info`` (a dict) travels as JSON in the ``extra_info`` column to the reward
function; a row without one sends its other fields instead (TRL hands a reward function the dataset's
columns; ``ground_truth`` and ``data_source`` are passed under those names anyway), and a chat prompt's
messages as ``prompt``. Numbers become text as written (``72.0`` → ``"72"``); other lists and dicts (e.g. unit
tests as an answer) become JSON.
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rlpipe.errors import ConfigError
from rlpipe.schemas.batch import AGENT, DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH

PROMPT = "prompt"
PROMPT_MESSAGES = "prompt_messages"
"""A chat prompt's messages as JSON (null for a text prompt); the data loader renders them."""
TEXT_COLUMNS = (PROMPT, GROUND_TRUTH, DATA_SOURCE)
OPTIONAL_COLUMNS = (AGENT, PROMPT_MESSAGES, EXTRA_INFO)
"""String columns a dataset may add; they are kept when present."""
TEXT_SCHEMA = pa.schema([(name, pa.string()) for name in TEXT_COLUMNS])
PREVIEW_ROWS = 2000
"""Rows of each file bigger than ``data.check_whole_files_mb`` that ``rlpipe validate`` reads (fields, chat
prompts, scorer routes, prompt lengths); the rest of such a file is checked when the run loads it."""
_MISSING = object()
_PASSED_ANYWAY = (GROUND_TRUTH, DATA_SOURCE)
"""Fields a reward function gets under these names in any case (a row's extra_info need not repeat them)."""


class DatasetError(ConfigError):
    """A dataset cannot be loaded: a missing file or field, a malformed row."""


@dataclass(frozen=True)
class RowPlaces:
    """Where each row of a dataset came from, for errors a person can open the file at: ``file:line`` for
    JSON lines, ``file row n`` for Parquet and Hugging Face data. Kept as one small int array per file, not
    a string per row, so a large run-time load pays little for it."""

    starts: tuple[int, ...]
    """Index of each file's first row in the concatenated rows."""
    names: tuple[str, ...]
    """Each file's path as the user gave it."""
    lines: tuple[array | None, ...]
    """Each file's line number per row (JSON lines: blank lines are skipped), or None: row n is the n-th."""

    @classmethod
    def of(cls, name: str) -> "RowPlaces":
        """The rows of one source counted 1, 2, ...: ``name row n``."""
        return cls((0,), (name,), (None,))

    def __call__(self, index: int) -> str:
        part = bisect_right(self.starts, index) - 1
        lines, offset = self.lines[part], index - self.starts[part]
        return f"{self.names[part]}:{lines[offset]}" if lines is not None else f"{self.names[part]} row {offset + 1}"


@dataclass(frozen=True)
class Preview:
    """What ``rlpipe validate`` read of a dataset: the rows as the run will see them, where each came from,
    and the files it read only the first rows of."""

    table: pa.Table
    """The dataset table of the rows read."""
    places: RowPlaces
    """Where each row of ``table`` came from."""
    partial: tuple[str, ...] = ()
    """Files read only in part (bigger than the whole-file bound), as ``path (N MB)``."""


class DatasetParams(BaseModel):
    """Base of every dataset's params model: unknown keys, inf/nan and booleans for numbers are errors."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        from rlpipe.schemas.config import refuse_bool_for_number

        return refuse_bool_for_number(cls, value, info)


class RecordParams(DatasetParams):
    """Which field of a row is what (dotted keys reach into nested fields)."""

    prompt_key: str = "prompt"
    """Field holding the prompt: text, or a list of chat messages (verl's and TRL's conversational format;
    rendered by the tokenizer's chat template, so set data.apply_chat_template: true)."""
    answer_key: str = "ground_truth"
    """Field holding the reference answer, e.g. `reward_model.ground_truth` (verl) or `solution` (TRL).
    Numbers become text; lists and dicts (e.g. unit tests) become JSON."""
    data_source: str | None = None
    """Constant data_source for every row; None reads it from `data_source_key`."""
    data_source_key: str = "data_source"
    """Field holding each row's data_source (used when `data_source` is None)."""
    extra_info_key: str | None = "extra_info"
    """Field holding each row's details for the reward function (verl's `extra_info`, a dict); a row without
    it passes its other fields instead (as TRL passes a dataset's columns), and a chat prompt's messages as
    `prompt`. None passes nothing."""
    prompt_template: str = "{prompt}"
    """Format applied to every prompt (to a chat prompt's last user message), e.g.
    "{prompt}\\nPut the final answer after ####."."""
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


def lookup(row: dict, key: str) -> Any:
    """``row[key]``, or the nested field a dotted ``key`` names (``reward_model.ground_truth``); _MISSING if
    absent. A top-level field whose own name has dots wins."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def as_text(value: Any) -> str | None:
    """A field as text: strings as they are, whole floats without ``.0``, other numbers as written, lists and
    dicts as JSON."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, ensure_ascii=False)


def chat_messages(value: Any) -> list[dict] | None:
    """``value`` as chat messages when it is a non-empty list of {role, content} dicts, else None."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        return [{"role": m["role"], "content": m["content"], **{k: v for k, v in m.items()
                                                                 if k not in ("role", "content") and v is not None}}
                for m in value]
    return None


def _fields_hint(rows: list[dict], key: str, params: RecordParams) -> str:
    fields = list(dict.fromkeys(k for row in rows[:PREVIEW_ROWS] for k in row))
    hint = ""
    if key == params.data_source_key:
        hint = " (or set data.params.data_source to a constant)"
    elif key == params.answer_key and any(isinstance(r.get("reward_model"), dict) for r in rows[:PREVIEW_ROWS]):
        hint = " (verl's format: set data.params.answer_key: reward_model.ground_truth)"
    return f"fields: {fields}. Set the matching *_key param{hint}"


def records_table(rows: list[dict], params: RecordParams, places: RowPlaces) -> pa.Table:
    """The dataset table of ``rows`` (module docstring): prompt, ground_truth, data_source and the optional
    prompt_messages / extra_info / agent columns; a missing or null field or a malformed value names the file and
    line (``places``). ``params.limit`` is the caller's to apply."""
    keys = [params.prompt_key, params.answer_key] + ([params.data_source_key] if params.data_source is None else [])
    columns: dict[str, list] = {name: [] for name in (*TEXT_COLUMNS, PROMPT_MESSAGES, EXTRA_INFO, AGENT)}
    for index, row in enumerate(rows):
        values = [lookup(row, key) for key in keys]
        for key, value in zip(keys, values):
            if value is _MISSING:
                raise DatasetError(f"{places(index)}: no field {key!r}; {_fields_hint(rows, key, params)}")
            if value is None:
                raise DatasetError(f"{places(index)}: field {key!r} is null; fill or drop the row")
        prompt, answer = values[0], values[1]
        messages = chat_messages(prompt)
        if messages is not None:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if users and isinstance(messages[users[-1]]["content"], str):
                last = messages[users[-1]]
                messages[users[-1]] = {**last, "content": params.prompt_template.replace("{prompt}", last["content"])}
            columns[PROMPT].append(str(messages[users[-1]]["content"]) if users else "")
            columns[PROMPT_MESSAGES].append(json.dumps(messages, ensure_ascii=False))
        elif isinstance(prompt, str):
            columns[PROMPT].append(params.prompt_template.replace("{prompt}", prompt))
            columns[PROMPT_MESSAGES].append(None)
        else:
            raise DatasetError(f"{places(index)}: field {params.prompt_key!r} is {type(prompt).__name__} "
                               f"{as_text(prompt)[:80]!r}; a prompt is text or a list of chat messages "
                               "({role, content}); fix the data or data.params.prompt_key")
        columns[GROUND_TRUTH].append(as_text(answer))
        columns[DATA_SOURCE].append(params.data_source or as_text(values[2]))
        info: Any = {}
        if params.extra_info_key is not None:
            info = lookup(row, params.extra_info_key)
            if info is _MISSING:  # TRL's way: the function sees the row's other fields (its columns)
                info = {k: v for k, v in row.items() if k not in (params.prompt_key, *_PASSED_ANYWAY)}
                info.update({"prompt": messages} if messages is not None else {})
            elif info is not None and not isinstance(info, dict):
                raise DatasetError(f"{places(index)}: field {params.extra_info_key!r} is {type(info).__name__}, "
                                   "not a dict; fix the data or set data.params.extra_info_key")
        columns[EXTRA_INFO].append(json.dumps(info or {}, ensure_ascii=False, default=str))
        agent = lookup(row, params.agent_key) if params.agent_key else None
        columns[AGENT].append(None if agent is _MISSING else as_text(agent))
    keep = [*TEXT_COLUMNS]
    if any(m is not None for m in columns[PROMPT_MESSAGES]):
        keep.append(PROMPT_MESSAGES)
    if params.extra_info_key is not None and any(v != "{}" for v in columns[EXTRA_INFO]):
        keep.append(EXTRA_INFO)
    if params.agent_key is not None:
        keep.append(AGENT)
    return pa.table({name: pa.array(columns[name], pa.string()) for name in keep})


# --- readers: each file format as a list of row dicts --------------------------------------------------------


def file_paths(path: str | list[str]) -> list[Path]:
    """The files ``data.params.path`` names; a missing one is a DatasetError."""
    paths = [Path(p) for p in ([path] if isinstance(path, str) else path)]
    for p in paths:
        if not p.is_file():
            raise DatasetError(f"dataset file {str(p)!r} does not exist (cwd {Path.cwd()}); fix data.params.path")
    return paths


def read_jsonl(path: Path, limit: int | None = None) -> tuple[list[dict], array]:
    """The JSON objects of a JSON-lines file (blank lines skipped) and the line number of each; a bad line
    names its number."""
    rows, numbers = [], array("l")
    with path.open("rb") as lines:  # bytes, decoded line by line: a bad byte is named where it is
        for number, raw in enumerate(lines, start=1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                   f"{exc.start + 1}); convert the file to UTF-8") from None
            try:
                row = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not valid JSON ({exc.msg}); one object per line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: not a JSON object; one object per line")
            if row:
                rows.append(row)
                numbers.append(number)
    return rows, numbers


def read_parquet(path: Path, limit: int | None = None) -> tuple[list[dict], None]:
    """The rows of a Parquet file (nested columns as dicts and lists); rows are named by their number."""
    try:
        if limit is None:
            return pq.read_table(path).to_pylist(), None
        first = next(pq.ParquetFile(path).iter_batches(batch_size=limit), None)
        return (first.to_pylist() if first is not None else []), None
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet file ({exc}); fix data.params.path") from None


Reader = Callable[[Path, "int | None"], "tuple[list[dict], array | None]"]
"""A file format's reader: the first ``limit`` rows of a file (all when None) and each one's line number (None:
rows are named by their number)."""


def _size(bytes_: int) -> str:
    return f"{bytes_ / 2**20:.1f} MB"


def read_files(params: Any, reader: Reader, limit: int | None = None, whole_below_bytes: int = 0) -> Preview:
    """Every file of ``params.path`` read by ``reader`` as one dataset table: whole when ``limit`` is None or the
    file has at most ``whole_below_bytes``, else its first ``limit`` rows; ``params.limit`` keeps the first rows
    of the concatenation."""
    rows: list[dict] = []
    starts, names, lines, partial = [], [], [], []
    for path in file_paths(params.path):
        size = path.stat().st_size
        bounded = limit is not None and size > whole_below_bytes
        caps = ([limit] if bounded else []) + ([params.limit - len(rows)] if params.limit is not None else [])
        cap = min(caps, default=None)
        if cap == 0:
            break
        read, numbers = reader(path, cap)
        starts.append(len(rows))
        names.append(str(path))
        lines.append(numbers)
        rows.extend(read)
        if bounded and len(read) == limit:  # stopped by the bound, not by the file's end or params.limit
            partial.append(f"{path} ({_size(size)})")
            if params.limit is not None:  # the run may take all its rows from the rest of this file
                break
    places = RowPlaces(tuple(starts), tuple(names), tuple(lines))
    return Preview(records_table(rows, params, places), places, tuple(partial))


def load_files(params: Any, reader: Reader) -> pa.Table:
    """The dataset table of every file of ``params.path``, read whole by ``reader``."""
    return read_files(params, reader).table


def hf_rows(path: str, split: str, limit: int | None = None) -> list[dict]:
    """The rows of a Hugging Face dataset on this machine: a ``save_to_disk`` folder (a ``DatasetDict``'s
    ``split``), or a folder / data file ``datasets.load_dataset`` reads (parquet, json, csv); never the hub."""
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local folder only: no hub lookups, no downloads
    try:
        import datasets
    except ImportError:
        raise DatasetError("data.source hf needs the `datasets` package: pip install 'rlpipe[hf]' "
                           "(or pip install datasets)") from None
    folder = Path(path)
    if not folder.exists():
        raise DatasetError(f"Hugging Face dataset {path!r} does not exist (cwd {Path.cwd()}); point data.params.path "
                           "at a save_to_disk folder or a local data folder (nothing is downloaded)")
    saved = folder.is_dir() and any((folder / name).is_file() for name in ("state.json", "dataset_dict.json"))
    try:
        if saved:
            loaded = datasets.load_from_disk(str(folder))
        else:
            loaded = datasets.load_dataset(str(folder), split=split) if folder.is_dir() else datasets.load_dataset(
                folder.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(folder), split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; the user needs the path and the cause
        raise DatasetError(f"cannot load the Hugging Face dataset {path!r}: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"Hugging Face dataset {path!r} has splits {sorted(loaded)}, not {split!r}; "
                               "set data.params.split")
        loaded = loaded[split]
    if limit is not None:
        loaded = loaded.select(range(min(limit, len(loaded))))
    return loaded.to_list()


class HfParams(RecordParams):
    """A Hugging Face dataset on this machine (module docstring for the field names)."""

    path: str
    """A `save_to_disk` folder, or a local folder / data file `datasets.load_dataset` reads. Nothing is downloaded."""
    split: str = "train"
    """Split of a DatasetDict (or of a data folder)."""


def read_hf(params: HfParams, limit: int | None = None, whole_below_bytes: int = 0) -> Preview:
    """A Hugging Face dataset as a table: whole when ``limit`` is None or its files hold at most
    ``whole_below_bytes``, else its first ``limit`` rows (``params.limit`` caps both)."""
    folder = Path(params.path)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else (
        folder.stat().st_size if folder.exists() else 0)
    bounded = limit is not None and size > whole_below_bytes
    cap = min(([limit] if bounded else []) + ([params.limit] if params.limit is not None else []), default=None)
    rows = hf_rows(params.path, params.split, cap)
    partial = (f"{params.path} ({_size(size)})",) if bounded and len(rows) == limit else ()
    places = RowPlaces.of(params.path)
    return Preview(records_table(rows, params, places), places, partial)


def load_hf(params: HfParams) -> pa.Table:
    """The dataset table of a Hugging Face dataset."""
    return read_hf(params).table
