"""Plugin files named by the pipeline (``plugins: [my_kinds.py]``): new kinds and impls without a package.

A plugin file is a Python file that registers parts the way the built-ins do (``stage_kind``, ``@stage``,
``registry(...).register``). The driver resolves its path (relative to the directory rlpipe is launched
from) and reads its source when the config is validated; the source travels in the config to every worker
actor and in each stage call's context to Ray's task workers, so a worker on another node or in another
directory runs the very same code and needs no copy (the reward function's way, stages/reward_function.py).

Each process imports a file once per source text (a module ``rlpipe_plugin_<stem>`` in ``sys.modules``,
compiled under its path, so tracebacks and a stage's code hash show the user's lines). Packages use the
``rlpipe.plugins`` entry point instead (rlpipe.registry).
"""

from __future__ import annotations

import hashlib
import linecache
import sys
import threading
import types
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, model_validator

from rlpipe.errors import ConfigError

MAX_PLUGIN_BYTES = 1 << 20
"""Largest plugin file: it travels with every stage call."""

_imported: dict[str, str] = {}
"""Path → the source digest imported in this process."""
_lock = threading.Lock()


class PluginFile(BaseModel):
    """A Python file that registers stage kinds, impls or other parts (``plugins: [path, ...]``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    path: str
    """The file, relative to the directory rlpipe is launched from (or absolute)."""
    source: str | None = None
    """Its text, read on the driver when the config is validated (leave unset): workers import this text."""

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _read_source(self) -> "PluginFile":
        if self.source is None:
            file = Path(self.path).expanduser().resolve()
            if not file.is_file():
                raise ValueError(f"plugin file {self.path!r} not found (resolved to {file}); give a path relative "
                                 "to the directory you launch rlpipe from, or an absolute one")
            size = file.stat().st_size
            if size > MAX_PLUGIN_BYTES:
                raise ValueError(f"plugin file {self.path!r} has {size} bytes; a plugin registers code (at most "
                                 f"{MAX_PLUGIN_BYTES} bytes): keep data in files its stages read")
            object.__setattr__(self, "path", str(file))
            object.__setattr__(self, "source", file.read_text(encoding="utf-8"))
        return self

    @property
    def digest(self) -> str:
        return hashlib.sha256((self.source or "").encode()).hexdigest()[:16]


def import_plugin_files(files: Iterable[PluginFile]) -> None:
    """Import each file's source in this process (once per path and text); a ConfigError naming the file and
    line when one does not import."""
    for plugin in files:
        if _imported.get(plugin.path) == plugin.digest:
            continue
        with _lock:
            if _imported.get(plugin.path) == plugin.digest:
                continue
            if plugin.path in _imported:
                raise ConfigError(f"plugin file {plugin.path} changed since this process imported it; its parts "
                                  "stay registered as first imported: start a new process (or Ray cluster)")
            _import(plugin)
            _imported[plugin.path] = plugin.digest


def _import(plugin: PluginFile) -> None:
    source = plugin.source or ""
    linecache.cache[plugin.path] = (len(source), None, source.splitlines(True), plugin.path)
    name = f"rlpipe_plugin_{Path(plugin.path).stem}"
    module = types.ModuleType(name)
    module.__file__ = plugin.path
    sys.modules[name] = module  # its classes and functions pickle by reference, as a module's do
    try:
        exec(compile(source, plugin.path, "exec"), module.__dict__)  # noqa: S102 - the user's own plugin code
    except BaseException as exc:
        del sys.modules[name]
        line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
        for filename, lineno in _frames(exc):
            if filename == plugin.path:
                line = lineno
        where = f"{plugin.path}:{line}" if line else plugin.path
        raise ConfigError(f"plugin file {where}: {type(exc).__name__}: {exc}") from exc


def _frames(exc: BaseException):
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
