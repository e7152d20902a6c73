"""One registry mechanism for every swappable kind of part.

A kind (``stage.generate``, ``advantage_estimator``, ``policy_loss``, ``scorer``,
``mode``, ``weight_transport``, ``sampler`` ...) owns one :class:`Registry`.
Built-ins register with the ``@registry(kind).register(name)`` decorator at
import time; third-party packages expose an entry point in the group
``rlpipe.plugins`` whose target is a module (or callable) that registers its
parts the same way. Unknown names raise listing the known ones, sorted;
duplicate names raise.
"""

from __future__ import annotations

import difflib
import importlib
import logging
from importlib.metadata import entry_points
from typing import Callable, Generic, Iterator, TypeVar

from rlpipe.errors import RegistryError

log = logging.getLogger(__name__)

T = TypeVar("T")

PLUGIN_GROUP = "rlpipe.plugins"

# Modules whose import registers the built-in parts. Importing them lazily (on the
# first lookup) keeps `import rlpipe` cheap and free of torch/ray imports.
_BUILTIN_MODULES = ("rlpipe.builtins",)

_registries: dict[str, "Registry"] = {}
_loaded = False


class Registry(Generic[T]):
    """Name → object table for one kind of swappable part."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; a duplicate name raises."""

        def decorate(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorate

    def add(self, name: str, obj: T) -> None:
        if name in self._items and self._items[name] is not obj:
            raise RegistryError(
                f"duplicate {self.kind} name {name!r}: already registered by "
                f"{_origin(self._items[name])}; pick another name for {_origin(obj)}"
            )
        self._items[name] = obj

    def get(self, name: str) -> T:
        if name in self._items:  # plugins only matter on a miss (importing them all costs seconds)
            return self._items[name]
        load_plugins()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "(none registered)"
            close = difflib.get_close_matches(str(name), list(self._items), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RegistryError(f"unknown {self.kind} {name!r}{hint}; known: {known}") from None

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._items

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        load_plugins()
        return iter(sorted(self._items.items()))


def registry(kind: str) -> Registry:
    """The registry of ``kind`` (created on first use)."""
    if kind not in _registries:
        _registries[kind] = Registry(kind)
    return _registries[kind]


def kinds() -> list[str]:
    load_plugins()
    return sorted(_registries)


def load_plugins() -> None:
    """Import the built-ins, then every ``rlpipe.plugins`` entry point, once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
    except BaseException:
        _loaded = False  # a later lookup retries and shows the same import error
        raise
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            target = ep.load()
        except Exception as exc:  # a broken plugin must say which one it is
            raise RegistryError(f"plugin entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        if callable(target) and not isinstance(target, type(importlib)):
            target()
        log.debug("loaded rlpipe plugin %s", ep.name)


def _origin(obj: object) -> str:
    module = getattr(obj, "__module__", "?")
    qualname = getattr(obj, "__qualname__", type(obj).__name__)
    return f"{module}.{qualname}"
