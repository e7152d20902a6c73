"""``rlpipe stages [KIND[/IMPL]] [--plugin FILE ...]``: what can go in a pipeline, from the registry itself
(with ``--plugin``, the kinds and impls a plugin file registers too).

Without an argument: every stage kind with one line per implementation (where it runs, what it
does: its docstring's first sentence), then the other registries' names. With a kind (``advantage``),
an implementation (``advantage/grpo``) or another registry (``dataset``, ``scorer``): each
implementation's description, the columns it reads and writes (with its default params), and its
params as YAML with every default, nested models spelled out, each field's docstring as a comment.
The full reference of every key is docs/pipeline-yaml-reference.md (``make docs``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterator

from pydantic import BaseModel, ValidationError

from rlpipe.engine.planning.config_reference import _first_paragraph, _plain, _type_name
from rlpipe.errors import ConfigError
from rlpipe.registry import kinds, registry
from rlpipe.stage_kinds import get_kind, known_kinds

DESCRIPTION_WIDTH = 90
"""Characters of a description shown in the overview (the detail view shows it whole)."""


def stage_kinds() -> list[str]:
    """Registered stage kinds: the built-ins in step order, then the plugins'."""
    return known_kinds()


def overview() -> str:
    lines = []
    for kind in stage_kinds():
        lines.append(f"{kind}: {get_kind(kind).doc}")
        impls = list(registry(f"stage.{kind}").items())
        if not impls:
            continue
        width = max(len(impl) for impl, _ in impls)
        shared = _shared_functions([spec for _, spec in impls])
        for impl, spec in impls:
            where = _where(spec)
            lines.append(f"  {impl:<{width}}  {where:<13} {_short(_first_sentence(_description(spec, shared)))}")
    lines.append("")
    for kind in kinds():
        if not kind.startswith("stage"):
            lines.append(f"{kind}: {', '.join(registry(kind).names())}")
    lines.append("")
    lines.append("rlpipe stages KIND (or KIND/IMPL) shows each implementation's columns and params with defaults")
    return "\n".join(lines)


def detail(query: str) -> str:
    """The detail view of a stage kind, one implementation, or another registry."""
    kind, _, impl = query.partition("/")
    if kind in stage_kinds():
        reg = registry(f"stage.{kind}")
        names = [impl] if impl else reg.names()
        shared = _shared_functions([spec for _, spec in reg.items()])
        return "\n\n".join(_stage_detail(kind, name, reg.get(name), shared) for name in names)
    if kind in kinds():
        reg = registry(kind)
        names = [impl] if impl else reg.names()
        return "\n\n".join(_part_detail(kind, name, reg.get(name)) for name in names)
    known = stage_kinds() + [k for k in kinds() if not k.startswith("stage.")]
    hint = _close(kind, known)
    raise ConfigError(f"rlpipe stages: no stage kind or registry {kind!r}{hint}; known: {', '.join(known)}")


def _stage_detail(kind: str, impl: str, spec, shared: set) -> str:
    lines = [f"{kind}/{impl}  (runs on: {_where(spec)})"]
    docs = [spec.params_model.__doc__, spec.fn.__doc__] if spec.fn in shared else [spec.fn.__doc__]
    for doc in dict.fromkeys(_unmarked(_first_paragraph(d)) for d in docs if d):
        lines.append(f"  {doc}")
    params = _default_params(spec.params_model)
    if params is not None:
        for label, columns in (("reads", spec.read_columns(params)), ("writes", spec.write_columns(params))):
            lines.append(f"  {label}: " + (", ".join(f"{c} ({t})" for c, t in columns.items()) or "-"))
    else:
        lines.append("  reads/writes: depend on the required params")
    lines += _params_block(spec.params_model)
    return "\n".join(lines)


def _part_detail(kind: str, name: str, part: Any) -> str:
    lines = [f"{kind}: {name}"]
    doc = _unmarked(_first_paragraph(_part_doc(part)))
    if doc:
        lines.append(f"  {doc}")
    model = getattr(part, "params_model", None) or getattr(part, "params", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        lines += _params_block(model)
    return "\n".join(lines)


def _part_doc(part: Any) -> str | None:
    """What a registered part does: its function's docstring, or its class's for an object that is the part
    itself (a trainer backend); a spec record (a dataclass holding a function) has only its function's."""
    if hasattr(part, "fn"):
        return part.fn.__doc__
    if dataclasses.is_dataclass(part):
        return None
    return part.__doc__


def _params_block(model: type[BaseModel]) -> list[str]:
    if not model.model_fields:
        return ["  params: none"]
    return ["  params:"] + list(_yaml_fields(model, 2))


def _yaml_fields(model: type[BaseModel], depth: int) -> Iterator[str]:
    pad = "  " * depth
    for name, field in model.model_fields.items():
        comment = _first_sentence(field.description)
        comment = f"  # {comment}" if comment else ""
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            yield f"{pad}{name}:{comment}"
            yield from _yaml_fields(type(default), depth + 1)
        elif field.is_required():
            yield f"{pad}{name}: (required: {_type_name(field.annotation)}){comment}"
        else:
            yield f"{pad}{name}: {json.dumps(_plain(default), ensure_ascii=False)}{comment}"


def _default_params(model: type[BaseModel]) -> BaseModel | None:
    try:
        return model()
    except ValidationError:
        return None


def _shared_functions(specs: list) -> set:
    """Stage functions that more than one implementation of a kind runs (generate's engines): those
    implementations are told apart by their params model's docstring."""
    seen: dict = {}
    for spec in specs:
        seen[spec.fn] = seen.get(spec.fn, 0) + 1
    return {fn for fn, count in seen.items() if count > 1}


def _description(spec, shared: set) -> str:
    doc = spec.params_model.__doc__ if spec.fn in shared and spec.params_model.__doc__ else spec.fn.__doc__
    return _unmarked(_first_paragraph(doc))


def _unmarked(text: str) -> str:
    """Docstring text without its reST markup (``x``, `x` and :class:`x` read as x on a terminal)."""
    return re.sub(r":\w+:`", "", text).replace("``", "").replace("`", "")


def _where(spec) -> str:
    return spec.role if spec.placement == "worker" else spec.placement


_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bDr)(?<!\bvs)\.\s+(?=[A-Z(`])")
"""A full stop that ends a sentence: followed by a capital, not the dot of e.g., i.e., Dr. or vs."""


def _first_sentence(doc: str | None) -> str:
    text = _unmarked(_first_paragraph(doc))
    end = _SENTENCE_END.search(text)
    return text[: end.start() + 1] if end else text


def _short(text: str) -> str:
    return text if len(text) <= DESCRIPTION_WIDTH else text[: DESCRIPTION_WIDTH - 1] + "…"


def _close(name: str, known: list[str]) -> str:
    import difflib

    match = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {match[0]!r}?" if match else ""
