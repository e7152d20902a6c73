"""Tools an agent may call: the ``tool`` registry and the built-in local tools.

A tool is a :class:`Tool`: a name, and ``run(arguments) -> ToolOutput``. Its own
failures (a division by zero, a python traceback, a malformed argument) come
back as an *observation* with ``ok=False`` — the model sees the error and may do
better next turn. An *infrastructure* failure (the sandbox could not start, the
tool process vanished) raises :class:`ToolInfraError`; the agent loop then ends
the trajectory with termination ``tool_error`` and status ``failed``.

Built-ins: ``calculator`` (arithmetic through :mod:`ast`, never ``eval``),
``python`` (:mod:`rlpipe.agents.sandbox`: a sandboxed subprocess),
``latency`` (sleeps a seeded heavy-tailed time, for benchmarks of long-tail tool
latency) and ``lookup`` (a secret keyed table: the answer of the ``lookup``
dataset, which a model can only get by calling it). Plugins register more with ``TOOLS.add(name, factory)`` from an
``rlpipe.plugins`` entry point; a factory takes the tool's settings (a dict from
``agent_loop.tool_settings``) and returns a Tool. The tool types themselves are defined in
:mod:`rlpipe.agents.tool_types` and re-exported here.
"""

from __future__ import annotations

import ast
import hashlib
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rlpipe.agents.sandbox import PythonTool, SandboxLimits
from rlpipe.agents.tool_types import Tool, ToolCall, ToolInfraError, ToolOutput
from rlpipe.registry import registry

# Tool, ToolCall, ToolInfraError and ToolOutput live in tool_types, below the sandbox this module registers (so
# the sandbox needs nothing from here); they stay importable from here, where callers import them.
__all__ = [
    "TOOLS", "Calculator", "CalculatorError", "LatencyTool", "LookupTool", "Tool", "ToolCall", "ToolInfraError",
    "ToolOutput", "build_tool", "evaluate", "format_number", "lookup_value",
]

TOOLS = registry("tool")


def build_tool(name: str, settings: Mapping[str, Any] | None = None) -> Tool:
    """The registered tool ``name`` built with its ``settings`` (unknown names raise listing the known)."""
    factory: Callable[[Mapping[str, Any]], Tool] = TOOLS.get(name)
    return factory(dict(settings or {}))


# -- calculator ----------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value cannot be computed."""


def evaluate(expression: str, max_exponent: int = 64, max_length: int = 200) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Parsed with :mod:`ast` and evaluated node by node: names, calls, attributes and
    every other construct raise CalculatorError, so nothing but arithmetic runs.
    Exponents are capped at ``max_exponent`` (``9**9**9`` would hang the worker).
    """
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise CalculatorError(f"exponent {right} is larger than {max_exponent}")
            try:
                return _BINARY[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError) as exc:
                raise CalculatorError(str(exc)) from None
        raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers and + - * / // % ** ( )")

    return value(tree)


def format_number(number: int | float) -> str:
    """Integers (and floats that are whole) without a decimal point; other floats to 6 significant digits."""
    if isinstance(number, float) and math.isfinite(number) and number.is_integer() and abs(number) < 1e15:
        return str(int(number))
    return f"{number:.6g}" if isinstance(number, float) else str(number)


@dataclass
class Calculator:
    """``calculator(expression)``: safe arithmetic (see :func:`evaluate`)."""

    name: str = "calculator"

    def run(self, arguments: Mapping[str, Any]) -> ToolOutput:
        expression = arguments.get("expression", arguments.get("expr"))
        if not isinstance(expression, str):
            return ToolOutput("error: calculator needs a string argument `expression`", ok=False)
        try:
            return ToolOutput(format_number(evaluate(expression)))
        except CalculatorError as exc:
            return ToolOutput(f"error: {exc}", ok=False)


TOOLS.add("calculator", lambda settings: Calculator(**settings))


# -- latency (benchmarks) ------------------------------------------------------------

@dataclass
class LatencyTool:
    """``latency(key)``: sleeps a Pareto(alpha) time from ``min_s`` capped at ``max_s``, seeded by
    (seed, key) so a rerun sleeps the same; returns the seconds slept. Long-tail tool latency for benchmarks."""

    min_s: float = 0.01
    max_s: float = 2.0
    alpha: float = 1.2
    seed: int = 0
    name: str = "latency"

    def delay(self, key: str) -> float:
        digest = hashlib.blake2b(f"{self.seed}\x00{key}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "little") + 0.5) / 2.0**64
        return min(self.min_s * u ** (-1.0 / self.alpha), self.max_s)

    def run(self, arguments: Mapping[str, Any]) -> ToolOutput:
        seconds = self.delay(str(arguments.get("key", "")))
        time.sleep(seconds)
        return ToolOutput(f"{seconds:.3f}")


TOOLS.add("latency", lambda settings: LatencyTool(**settings))


# -- lookup (the agent_tools task) ---------------------------------------------------

def lookup_value(key: str, secret: int = 0, digits: int = 1) -> str:
    """The value the secret table holds for ``key``: ``digits`` decimal digits of a keyed hash of it.

    A keyed hash, not a formula: nothing in ``key`` predicts its value, so a model that
    answers without calling :class:`LookupTool` is right by chance only (10**-digits)."""
    digest = hashlib.blake2b(key.encode(), key=f"rlpipe-lookup-{secret}".encode(), digest_size=8).digest()
    return str(int.from_bytes(digest, "little") % 10**digits).zfill(digits)


@dataclass
class LookupTool:
    """``lookup(key)``: the secret table's value for ``key`` (see :func:`lookup_value`)."""

    secret: int = 0
    digits: int = 1
    name: str = "lookup"

    def run(self, arguments: Mapping[str, Any]) -> ToolOutput:
        key = arguments.get("key")
        if not isinstance(key, str) or not key.isalnum():
            return ToolOutput("error: lookup needs a string argument `key` of letters and digits", ok=False)
        return ToolOutput(lookup_value(key, self.secret, self.digits))


TOOLS.add("lookup", lambda settings: LookupTool(**settings))


# -- python (rlpipe.agents.sandbox) --------------------------------------------------

TOOLS.add("python", lambda settings: PythonTool(SandboxLimits(**settings)))
