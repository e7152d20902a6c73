"""Reading a pipeline YAML into a validated :class:`PipelineConfig`.

Turns YAML and pydantic errors into :class:`ConfigError` messages that name the
field (as a dotted path, stages by node name) and say how to fix it, and applies
``-o dotted.key=value`` overrides (``stages.<node>.params.<key>=...`` addresses a
stage by its node name).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlpipe.errors import ConfigError
from rlpipe.schemas.config import PipelineConfig

MAX_PIPELINE_BYTES = 1 << 20
"""Largest pipeline YAML read: a pipeline holds settings, not data (data files are named by path)."""
MAX_EXPANDED_VALUES = 100_000
"""Most values (mappings, lists and scalars) a pipeline may hold with its YAML aliases expanded. The YAML reader
shares an aliased value, but pydantic and every later reader walk it once per alias: a few lines of aliases nested
in aliases ("billion laughs") would take minutes and gigabytes before any field is checked."""
MAX_ERROR_LINES, MAX_ERROR_LINE_CHARS = 20, 400
"""Most problems a config error lists, and most characters each line keeps (an echoed value is cut)."""


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[PipelineConfig, str]:
    """Parse and validate ``path`` with overrides applied; returns the config and the YAML text."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pipeline file {str(path)!r} does not exist; pass the path of a pipeline YAML")
    size = path.stat().st_size
    if size > MAX_PIPELINE_BYTES:
        raise ConfigError(f"{path}: {size / 2**20:.1f} MiB; a pipeline YAML holds settings, not data (at most "
                          f"{MAX_PIPELINE_BYTES >> 20} MiB): name data files by path (data.params.path)")
    text = _utf8_text(path)
    try:
        raw = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply for a pipeline YAML; flatten it") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (model:, tokenizer:, stages: ...)")
    for override in overrides:
        apply_override(raw, override)
    check_expansion(raw, str(path))
    return validate_config(raw, source=str(path)), text


def check_expansion(raw: Any, source: str = "pipeline") -> None:
    """A ConfigError when ``raw`` refers to itself or holds more than :data:`MAX_EXPANDED_VALUES` values once its
    aliases are expanded, naming the field where the expansion grows; counted in time linear in the YAML."""
    sizes: dict[int, int] = {}
    refs: dict[int, int] = {}  # how many places hold each container (more than one: an aliased value)
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(raw, False)]
    while stack:  # post-order, each shared (aliased) value counted once with its expanded size
        value, children_done = stack.pop()
        key = id(value)
        if not isinstance(value, (dict, list)) or (key in sizes and not children_done):
            continue
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(_size(c, sizes) for c in _children(value))
            continue
        if key in on_path:
            raise ConfigError(f"{source}: a YAML alias refers to a value that contains it; write the value out")
        on_path.add(key)
        stack.append((value, True))
        for child in _children(value):
            if isinstance(child, (dict, list)):
                refs[id(child)] = refs.get(id(child), 0) + 1
                stack.append((child, False))
    if _size(raw, sizes) <= MAX_EXPANDED_VALUES:
        return
    where: list[Any] = []
    value = raw
    while True:  # down the largest child while it alone is over the limit, to the value that repeats aliases
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) if isinstance(value, list) else []
        big = [(k, c) for k, c in items if _size(c, sizes) > MAX_EXPANDED_VALUES and refs.get(id(c), 1) == 1]
        if not big:
            break
        k, value = max(big, key=lambda kc: _size(kc[1], sizes))
        where.append(k)
    field = _dotted(tuple(where), raw) if where and isinstance(raw, dict) else "the pipeline"
    raise ConfigError(f"{source}: {field} expands to {_size(value, sizes):,} values with its YAML aliases (at most "
                      f"{MAX_EXPANDED_VALUES:,}); aliases repeated inside aliases? write the values out")


def _children(value: Any) -> list[Any]:
    return list(value.values()) if isinstance(value, dict) else value


def _size(value: Any, sizes: dict[int, int]) -> int:
    return sizes.get(id(value), 1) if isinstance(value, (dict, list)) else 1


def _utf8_text(path: Path) -> str:
    """The file's text; a file that is not UTF-8 is a one-line ConfigError naming the line (not a raw
    UnicodeDecodeError from deep inside the reader)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} on line {line}); save the "
                          "pipeline YAML as UTF-8") from None


def validate_config(raw: dict[str, Any], source: str = "pipeline") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_bounded(_describe(err, raw)) for err in errors[:MAX_ERROR_LINES]]
        if len(errors) > MAX_ERROR_LINES:
            lines.append(f"... and {len(errors) - MAX_ERROR_LINES} more")
        raise ConfigError(f"{source}: invalid pipeline config:\n  " + "\n  ".join(lines)) from None


def _bounded(line: str) -> str:
    """``line`` cut to :data:`MAX_ERROR_LINE_CHARS` (a message can echo a huge value)."""
    if len(line) <= MAX_ERROR_LINE_CHARS:
        return line
    return f"{line[:MAX_ERROR_LINE_CHARS]}... ({len(line):,} characters, cut)"


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` (value parsed as YAML) to the raw config in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like dotted.key=value (e.g. trainer.total_steps=5)")
    key, value_text = override.split("=", 1)
    value = yaml.safe_load(value_text) if value_text.strip() else ""
    parts = key.strip().split(".")
    target: Any = raw
    for i, part in enumerate(parts[:-1]):
        if part == "stages" and isinstance(target, dict) and i == 0:
            node = parts[i + 1] if i + 1 < len(parts) else ""
            target = _stage_by_name(raw, node, override)
            return _set_path(target, parts[i + 2 :], value, override)
        target = target.setdefault(part, {}) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a mapping")
    target[parts[-1]] = value


def _stage_by_name(raw: dict[str, Any], node: str, override: str) -> dict[str, Any]:
    stages = raw.get("stages") or []
    for stage in stages:
        if isinstance(stage, dict) and (stage.get("name") or stage.get("kind")) == node:
            return stage
    names = sorted(str(s.get("name") or s.get("kind")) for s in stages if isinstance(s, dict))
    raise ConfigError(f"override {override!r}: no stage named {node!r}; stages are: {', '.join(names)}")


def _set_path(target: dict[str, Any], parts: list[str], value: Any, override: str) -> None:
    if not parts:
        raise ConfigError(f"override {override!r}: say which field of the stage, e.g. stages.update.params.lr=1e-3")
    for part in parts[:-1]:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"override {override!r}: {part} is not a mapping")
    target[parts[-1]] = value


def _describe(err: dict[str, Any], raw: dict[str, Any]) -> str:
    loc = _dotted(err["loc"], raw)
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{loc}: unknown field{_params_hint(err['loc'], raw) or _suggest(err['loc'], raw)}"
    if kind == "missing":
        return f"{loc}: required field is missing"
    if kind == "finite_number":
        return f"{loc}: must be a finite number, got {err.get('input')!r}; write a finite value (e.g. 1e-4)"
    return f"{loc}: {message(err)} (got {shown(err.get('input'))})"


def message(err: dict[str, Any]) -> str:
    """A pydantic error's message without pydantic's "Value error, " prefix."""
    return str(err["msg"]).removeprefix("Value error, ")


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 300-character name need not be echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value) if hasattr(value, '__len__') else '?'} long)"


def _dotted(loc: tuple[Any, ...], raw: dict[str, Any]) -> str:
    """``('stages', 2, 'params')`` → ``stages[2:update].params`` so the user can find the node."""
    out: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int) and out and out[-1] == "stages":
            stages = raw.get("stages") or []
            node = stages[part] if part < len(stages) and isinstance(stages[part], dict) else {}
            out[-1] = f"stages[{part}:{node.get('name') or node.get('kind', '?')}]"
        else:
            out.append(str(part))
    return ".".join(out)


def _suggest(loc: tuple[Any, ...], raw: dict[str, Any]) -> str:
    """Suggest the closest valid field name for an unknown key."""
    model: type[BaseModel] | None = PipelineConfig
    for part in loc[:-1]:
        if model is None:
            break
        field = model.model_fields.get(str(part))
        model = _submodel(field.annotation) if field else (model if isinstance(part, int) else None)
    if model is None:
        return ""
    fields = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} allowed here: {', '.join(fields)}"


def _params_hint(loc: tuple[Any, ...], raw: dict[str, Any]) -> str:
    """For ``stages[i].<key>`` where ``key`` is a param of that stage's impl (``-o stages.update.clip_ratio=0.1``):
    the ``.params.`` spelling to use."""
    if len(loc) != 3 or loc[0] != "stages" or not isinstance(loc[1], int):
        return ""
    stages = raw.get("stages") or []
    stage = stages[loc[1]] if loc[1] < len(stages) and isinstance(stages[loc[1]], dict) else {}
    try:
        from rlpipe.stage import stage_registry

        fields = stage_registry(str(stage.get("kind"))).get(str(stage.get("impl"))).params_model.model_fields
    except Exception:  # noqa: BLE001 - an unknown kind or impl is reported by the plan, with its own fix
        return ""
    if str(loc[2]) not in fields:
        return ""
    node = stage.get("name") or stage.get("kind")
    return (f"; {loc[2]!r} is a param of {stage.get('kind')}/{stage.get('impl')}: write it under params "
            f"(stages.{node}.params.{loc[2]} in an override)")


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    for cand in candidates:
        inner = [cand, *getattr(cand, "__args__", ())]
        for c in inner:
            if isinstance(c, type) and issubclass(c, BaseModel):
                return c
    return None
