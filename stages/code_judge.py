"""The ``code`` scorer's two sandboxed programs: the *worker* runs the solution, the *judge* runs the tests.

This file is not imported in the sandbox: :mod:`rlpipe.stages.code_scorer` sends its source, plus one line
calling :func:`judge_main` or :func:`worker_main`, as the sandboxed code. So it uses the standard library only
and does nothing on import (``tests/test_cli.py`` imports every stage module). Why two processes is argued in
``code_scorer``'s docstring; here is how they talk.

The judge never executes a line of the solution. It runs the tests with the solution's names bound to
:class:`Remote` proxies; using one sends a request to the worker, and what comes back is *data* — None, bool,
int, float, str, bytes, complex, and lists, tuples, dicts, sets of those — rebuilt by :func:`decode` from JSON
as the judge's own objects, or a handle to an object that stays in the worker. ``assert``, ``==`` and the
count of passed tests run in the judge on those objects; a proxy compares by identity and has no arithmetic,
so an object whose ``__eq__`` says yes to everything stays in the worker, where it cannot answer for the
judge. A solution's name that shadows a builtin (``len``, ``isinstance``, ``abs``) is not bound: the tests
keep the judge's builtins (and dunder names are not bound at all: a ``__builtins__`` among them would
replace every builtin). A standard-library or numpy module the solution imported is imported again by the
judge, by name (others are not bound), and a standard-library module's name (or ``np``) is always the
judge's own module: a solution's ``class math`` with an ``isclose`` that says yes cannot stand in for it.

Wire: one JSON document per line each way. Judge → worker: ``["load", source]`` first, then ``[op, handle,
*args]``. Worker → judge: first the line ``{"up": 1}`` (written before the solution arrives), then
``{"v": value}`` or ``{"e": [exception type name, message]}`` for the solution's module (its names) and then
for each request. Values: JSON
scalars as they are; ``{"l"|"t"|"s"|"f": [...]}`` (list, tuple, set, frozenset), ``{"d": [[k, v], ...]}``,
``{"b": base64}``, ``{"c": [re, im]}``, ``{"h": handle}``; among the names ``{"m": name}`` for a module. A
line that is not that, or longer than MAX_MESSAGE bytes, or the worker gone, breaks the link: that request
and every later one raise :class:`RemoteError`, so those tests fail. An exception raised in the worker comes
back as the builtin exception of that name (``ValueError``, ``StopIteration``; others as RemoteError).

Left out: callables from a test passed to the solution (``key=lambda …``: TypeError), and arguments the
solution mutates in place (the worker gets a copy, so a test that checks the argument afterwards fails).
"""

import base64
import builtins
import importlib
import json
import os
import re
import sys

MAX_MESSAGE = 16 * 2**20
"""Bytes of one line on the wire; a longer reply breaks the link (the worker replies with an error instead)."""
MAX_INLINE_NAME = 2**20
"""A solution's data name encoded longer than this is bound as a proxy (a big lookup table stays in the worker)."""
_MODULE_NAMES = {"np": "numpy", "numpy": "numpy"}
"""Names that are bound to the judge's own import (as is every standard-library module name)."""

_CONTAINERS = {"l": list, "t": tuple, "s": set, "f": frozenset}
_TAG_OF = {list: "l", tuple: "t", set: "s", frozenset: "f"}


def encode(value, other):
    """``value`` as a JSON-able document; ``other(value)`` encodes what is not plain data (exact types only)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind in _TAG_OF:
        return {_TAG_OF[kind]: [encode(v, other) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, other), encode(v, other)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": base64.b64encode(value).decode()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    return other(value)


def decode(doc, handle):
    """The value a document encodes, built from plain types only; ``handle(n)`` makes a handle. ValueError if bad."""
    kind = type(doc)
    if doc is None or kind in (bool, int, float, str):
        return doc
    if kind is dict and len(doc) == 1:
        ((tag, body),) = doc.items()
        if tag in _CONTAINERS and type(body) is list:
            return _CONTAINERS[tag](decode(v, handle) for v in body)
        if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {decode(k, handle): decode(v, handle) for k, v in body}
        if tag == "b" and type(body) is str:
            return base64.b64decode(body, validate=True)
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(*body)
        if tag == "h" and type(body) is int:
            return handle(body)
    raise ValueError(f"not a value: {str(doc)[:80]}")


def _write(fd, text):
    data = (text + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _silence():
    """fds 0-2 become /dev/null: what the code prints cannot reach the wire or the report."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


# -- the worker: the solution's process ------------------------------------------------------------------------

_OPS = {
    "call": lambda o, args, kwargs: o(*args, **kwargs), "getattr": getattr, "setattr": setattr,
    "delattr": delattr, "getitem": lambda o, k: o[k], "setitem": lambda o, k, v: o.__setitem__(k, v),
    "delitem": lambda o, k: o.__delitem__(k), "len": len, "bool": bool, "str": str, "repr": repr,
    "iter": iter, "next": next, "contains": lambda o, x: x in o,
}
_PLAIN = (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)


def worker_main():
    """Say "up", take the solution from the judge's first request, send its names, answer requests until EOF."""
    rx, tx = os.fdopen(os.dup(0), "rb"), os.dup(1)  # the wire, on private duplicates of stdin and stdout
    _silence()
    _write(tx, '{"up": 1}')  # before the solution arrives: a missing "up" is the sandbox's failure, not its
    objects = []

    def other(value):  # subclasses of plain types travel as their base type, numpy as lists; the rest as handles
        for base in _PLAIN:
            if isinstance(value, base):
                plain = base(value)
                if type(plain) is base:
                    return encode(plain, other)
        if type(value).__module__.split(".")[0] == "numpy" and hasattr(value, "tolist"):
            return encode(value.tolist(), other)
        objects.append(value)
        return {"h": len(objects) - 1}

    def reply(compute):
        try:
            text = json.dumps({"v": compute()})
            if len(text) > MAX_MESSAGE:
                raise OverflowError(f"the result is over {MAX_MESSAGE} bytes on the wire")
        except BaseException as exc:  # the solution's SystemExit too: the judge decides what it means
            text = json.dumps({"e": [type(exc).__name__, str(exc)[:2000]]})
        _write(tx, text)

    def load(line):  # ["load", source]: run the solution, then its names (module docstring: how they travel)
        ns = {"__name__": "solution"}
        exec(compile(json.loads(line)[1], "<solution>", "exec"), ns)
        out = []
        for name, value in ns.items():
            if name.startswith("__") and name.endswith("__"):
                continue
            if type(value) is type(os):
                out.append([name, {"m": str(value.__name__)}])
                continue
            try:
                doc = encode(value, other)
                inline = len(json.dumps(doc)) <= MAX_INLINE_NAME
            except Exception:  # e.g. a list that contains itself: it stays here, as a proxy
                inline = False
            if not inline:
                doc = {"h": len(objects)}
                objects.append(value)
            out.append([name, doc])
        return {"d": out}

    def answer(line):
        op, handle, *args = json.loads(line)
        args = [decode(a, objects.__getitem__) for a in args]
        return encode(_OPS[op](objects[handle], *args), other)

    compute = load
    while True:
        line = rx.readline(MAX_MESSAGE + 1)
        if not line.endswith(b"\n"):
            return  # the judge is done (or gone)
        reply(lambda: compute(line))
        compute = answer


# -- the judge: runs the tests, counts, reports ----------------------------------------------------------------


class RemoteError(Exception):
    """The solution's process raised an exception that is not a builtin one, broke the wire protocol, or died."""


class _Link:
    """The judge's end of the wire. Strict: the first bad reply breaks it for good."""

    def __init__(self, tx, rx):
        self.tx, self.rx, self.broken = tx, os.fdopen(rx, "rb"), None

    def ask(self, op, handle, *args):
        line = [op, handle, *(encode(a, _outgoing) for a in args)]  # TypeError for a test's own non-data
        if self.broken is None:
            try:
                _write(self.tx, json.dumps(line))
            except OSError:
                self.broken = "the solution's process is gone"
        return self.receive(Remote)

    def receive(self, handle):
        """The next reply's value (``handle`` makes its handles; None: the document as sent) or its exception."""
        if self.broken is not None:
            raise RemoteError(self.broken)
        line = self.rx.readline(MAX_MESSAGE + 1)
        try:
            if not line.endswith(b"\n"):
                raise ValueError("it closed the wire" if not line else f"a line over {MAX_MESSAGE} bytes")
            doc = json.loads(line)
            if type(doc) is not dict or len(doc) != 1:
                raise ValueError(f"not a reply: {line[:80]!r}")
            if "v" in doc:
                return doc["v"] if handle is None else decode(doc["v"], handle)
            error = doc.get("e")
            if type(error) is not list or len(error) != 2 or not all(type(x) is str for x in error):
                raise ValueError(f"not a reply: {line[:80]!r}")
        except Exception as exc:  # ValueError, RecursionError (deep nesting), MemoryError: all the worker's fault
            self.broken = f"the solution's process broke the wire protocol ({exc})"
            raise RemoteError(self.broken) from None
        raise _exception(*error)


def _exception(name, message):
    cls = vars(builtins).get(name)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # e.g. UnicodeDecodeError wants five arguments
            pass
    return RemoteError(f"{name}: {message}")


def _outgoing(value):
    if type(value) is Remote:
        return {"h": object.__getattribute__(value, "_handle")}
    raise TypeError(f"a test cannot pass a {type(value).__name__} to the solution (data and its objects only)")


_LINK = None  # set by judge_main


class Remote:
    """An object in the solution's process. Compares, hashes and is ``is`` by identity; no arithmetic."""

    __slots__ = ("_handle",)

    def __init__(self, handle):
        object.__setattr__(self, "_handle", handle)

    def _ask(self, op, *args):
        return _LINK.ask(op, object.__getattribute__(self, "_handle"), *args)

    def __getattr__(self, name):
        return self._ask("getattr", name)

    def __setattr__(self, name, value):
        self._ask("setattr", name, value)

    def __delattr__(self, name):
        self._ask("delattr", name)

    def __call__(self, *args, **kwargs):
        return self._ask("call", args, kwargs)

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __setitem__(self, key, value):
        self._ask("setitem", key, value)

    def __delitem__(self, key):
        self._ask("delitem", key)

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __contains__(self, item):
        return self._ask("contains", item)

    def __str__(self):
        return self._ask("str")

    def __repr__(self):
        return self._ask("repr")


def _bind(doc, tests):
    """The test namespace from the worker's names: data, proxies, and the judge's own import of each module."""
    if type(doc) is not dict or list(doc) != ["d"] or type(doc["d"]) is not list:
        raise ValueError("not a list of names")
    # __builtins__ set here: exec would take a forged one from the names (the worker's wire is the solution's)
    ns, source = {"__name__": "tests", "__builtins__": builtins}, "\n".join(tests)
    for pair in doc["d"]:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or not pair[0].isidentifier():
            raise ValueError("not a name")
        name, value = pair
        if name.startswith("__") or name in vars(builtins):
            continue  # the tests keep the judge's len/isinstance/abs: the solution cannot answer for them
        module = _MODULE_NAMES.get(name, name if name in sys.stdlib_module_names else None)
        if module is None and type(value) is dict and list(value) == ["m"] and type(value["m"]) is str:
            module = value["m"]
            if module.split(".")[0] not in sys.stdlib_module_names and module not in _MODULE_NAMES.values():
                continue  # the judge imports the standard library and numpy only
        if module is None:
            ns[name] = decode(value, Remote)
        elif re.search(rf"\b{re.escape(name)}\b", source):  # only modules the tests name: importing costs
            try:  # the real module, whatever the solution bound to the name (a `class math` would answer)
                ns[name] = importlib.import_module(module)
            except Exception:
                pass
    return ns


def judge_main():
    """Read the spec (nonce, tests, solution, wire fds) from stdin to its end, run the tests, report."""
    global _LINK
    spec = json.loads(sys.stdin.buffer.read())  # the worker starts after "ready": then the spec is in here only
    nonce, tests, (tx, rx) = spec["nonce"], spec["tests"], spec["fds"]
    out = os.fdopen(os.dup(1), "w")  # the report, on a private duplicate: what a test prints goes nowhere
    _silence()

    def report(what):
        out.write(f"{nonce} {what}\n")
        out.flush()

    report("ready")
    _LINK = _Link(tx, rx)
    if _LINK.rx.readline(64) != b'{"up": 1}\n':
        return  # the worker did not come up: no "up" line, the scorer reports the sandbox down
    report("up")  # before the solution is sent: nothing it does can take this line back
    try:
        _write(tx, json.dumps(["load", spec["solution"]]))
        ns = _bind(_LINK.receive(None), tests)
    except Exception:  # the solution did not load (syntax error, exception, crash) or sent junk: nothing passes
        report("passed 0")
        return
    passed = 0
    for test in tests:
        try:
            exec(compile(test, "<test>", "exec"), ns)
            passed += 1
        except BaseException:
            pass
        report(f"passed {passed}")  # after each test: a timeout later keeps what passed before it
