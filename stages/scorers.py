"""Rule-based reward scorers (registry kind ``scorer``).

A scorer is ``fn(responses, ground_truths, **kwargs) -> np.ndarray[float32]`` with
one score in [0, 1] per row; ``responses`` and ``ground_truths`` are lists of
strings or Arrow string arrays (nulls read as ""); keyword arguments are its
options (``scorer_params`` of the reward stage, checked against the signature, so
a scorer declares them explicitly rather than swallowing ``**kwargs``). The
``reward`` stage routes each row to a scorer by its ``data_source``.

Built-ins:

* ``exact_match`` — 1 if the stripped response equals the stripped ground truth.
* ``digits`` — partial credit for the toy task: matching positions of the response
  (whitespace removed) and the target, over the longer of the two, so the first
  ``len(target)`` characters earn credit and only the exact answer scores 1.
* ``tool_answer`` — for agent trajectories: the final answer is the text after
  the last tool observation (after the last ``</tool_response>`` or the compact
  format's ``;``), scored like ``digits`` (partial credit per matching position).
* ``math`` / ``gsm8k`` — extract the final answer (after the last ``####``, else
  the last ``\\boxed{}``, else the last number), verify with ``math_verify``, fall
  back to numeric comparison; 0 or 1.
* ``code`` — run the response (its last fenced code block, if any) against unit
  tests in a subprocess with time, CPU and memory limits; the score is the fraction
  of tests passed; a timeout or crash scores 0. A sandbox that cannot start is an
  infrastructure failure: :class:`ScorerInfraError`, which the reward stage turns
  into ``status == "failed"`` for those rows.

Left out: network isolation and syscall filtering of the code sandbox (use
nsjail/firejail/containers in production — the rlimits here stop runaway programs,
not adversaries; tests run in the response's own interpreter, so a hostile
response can fake passing), stdin/stdout-style tests, and per-test timeouts.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import pyarrow as pa

from rlpipe.errors import RlpipeError
from rlpipe.registry import registry

SCORERS = registry("scorer")

TextColumn = Sequence[str | None] | pa.Array | pa.ChunkedArray | np.ndarray


class ScorerError(RlpipeError):
    """A scorer cannot score its input (e.g. malformed ground truth) or returned invalid scores."""


class ScorerInfraError(RlpipeError):
    """Scoring infrastructure failed (sandbox could not start, verifier unreachable).

    ``failed``: indices (within the scorer call) of the rows that could not be scored;
    None means all of them. ``scores``: scores of the other rows, when there are any.
    """

    def __init__(self, message: str, failed: Sequence[int] | None = None, scores: Sequence[float] | None = None):
        super().__init__(message)
        self.failed = None if failed is None else np.asarray(failed, dtype=np.int64)
        self.scores = None if scores is None else np.asarray(scores, dtype=np.float32)

    def __reduce__(self):  # keep the fields across processes
        return (type(self), (str(self), self.failed, self.scores))


def texts(values: TextColumn) -> list[str]:
    """A text column as a list of Python strings (nulls → "")."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = values.to_pylist()
    return ["" if v is None else str(v) for v in values]


@SCORERS.register("exact_match")
def exact_match(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    return np.array([r.strip() == g.strip() for r, g in zip(texts(responses), texts(ground_truths))], np.float32)


@SCORERS.register("digits")
def digits(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """Positional matches / max(len(target), len(response)); an empty target scores 0."""
    targets = texts(ground_truths)
    width = max((len(t) for t in targets), default=0) or 1
    stripped = ["".join(r.split()) for r in texts(responses)]
    response_len = np.array([len(r) for r in stripped], dtype=np.int64)
    target_len = np.array([len(t) for t in targets], dtype=np.int64)
    # fixed-width UCS-4 arrays viewed as code points [B, width]; padding is 0
    resp = np.array([r[:width] for r in stripped], dtype=f"<U{width}").view(np.uint32).reshape(-1, width)
    tgt = np.array(targets, dtype=f"<U{width}").view(np.uint32).reshape(-1, width)
    matched = ((resp == tgt) & (tgt != 0)).sum(axis=1)
    denom = np.maximum(target_len, response_len)
    return np.where(target_len > 0, matched / np.maximum(denom, 1), 0.0).astype(np.float32)


_OBSERVATION_END = re.compile(r"</tool_response>|;")


@SCORERS.register("tool_answer")
def tool_answer(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """``digits`` on the text after the last tool observation (the whole response if it called no tool)."""
    finals = [_OBSERVATION_END.split(r)[-1] for r in texts(responses)]
    return digits(finals, ground_truths)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: after the last ``####``, else the last ``\\boxed{}``, else the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip().rstrip(".")
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def _to_float(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        if "/" in cleaned:
            num, den = cleaned.split("/", 1)
            return float(num) / float(den)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(gold: str, pred: str | None) -> bool:
    """``math_verify`` equivalence of two final answers, falling back to numeric comparison."""
    if not pred:
        return False
    import math_verify  # 0.5 s of sympy imports, paid on first use only

    # math_verify's timeouts use signal.alarm, which only works in the main thread
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        g = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        p = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
        if g and p and math_verify.verify(g, p, timeout_seconds=timeout):
            return True
    except Exception:  # noqa: BLE001 - a verifier error is a non-match; the numeric fallback decides
        pass
    a, b = _to_float(gold), _to_float(pred)
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(a))


@SCORERS.register("gsm8k")
@SCORERS.register("math")
def math_answer(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """1 if the response's final answer equals the ground truth's (``#### x`` in the ground truth is honored)."""
    golds = [(extract_answer(g) if "####" in g else g.strip()) for g in texts(ground_truths)]
    return np.array([answers_equal(g, extract_answer(r)) for r, g in zip(texts(responses), golds)], np.float32)


# The sandbox: a fresh interpreter sets its own limits, says "ready", silences the
# standard streams, runs the response, then each test; it reports on a private fd.
# (Limits are set here rather than in preexec_fn, which Python documents as unsafe
# in threaded processes — Ray workers and our thread pool are both threaded.)
_HARNESS = r"""
import json, os, resource, sys
spec = json.loads(sys.stdin.read())
mem = spec["memory_mb"] * 2**20
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (2**24, 2**24))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
out.write("ready\n"); out.flush()
ns, passed = {"__name__": "response"}, 0
try:
    exec(compile(spec["code"], "<response>", "exec"), ns)
    tests = spec["tests"]
except BaseException:
    tests = []
for test in tests:
    try:
        exec(compile(test, "<test>", "exec"), ns)
        passed += 1
    except BaseException:
        pass
out.write(json.dumps({"passed": passed}) + "\n"); out.flush()
"""

_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def response_code(text: str) -> str:
    """The last fenced code block of a response, or the whole response."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def parse_tests(ground_truth: str) -> list[str]:
    """Unit tests from a ground truth: a JSON list of snippets, or Python source (one test per top-level statement)."""
    try:
        value = json.loads(ground_truth)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return value
    try:
        tree = ast.parse(ground_truth)
    except SyntaxError as exc:
        raise ScorerError(f"code ground truth is neither a JSON list of tests nor Python source ({exc})") from None
    return [ast.get_source_segment(ground_truth, node) for node in tree.body]


class _SandboxDown(Exception):
    pass


def run_tests(code: str, tests: list[str], timeout_s: float, memory_mb: int) -> float:
    """Fraction of ``tests`` passed by ``code`` in a fresh sandboxed interpreter; raises _SandboxDown."""
    spec = json.dumps({"code": code, "tests": tests, "memory_mb": memory_mb, "cpu_s": int(timeout_s) + 1})
    with tempfile.TemporaryDirectory(prefix="rlpipe-code-") as tmp:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _HARNESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, cwd=tmp, env={"PATH": os.defpath, "HOME": tmp}, start_new_session=True,
            )
        except OSError as exc:
            raise _SandboxDown(f"could not start {sys.executable}: {exc}") from exc
        timed_out = False
        try:
            out, _ = proc.communicate(spec.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    lines = out.decode(errors="replace").splitlines()
    if not lines or lines[0] != "ready":
        raise _SandboxDown(f"sandbox did not start (exit code {proc.returncode}); is memory_mb={memory_mb} too low?")
    if timed_out or len(lines) < 2:
        return 0.0
    return json.loads(lines[-1])["passed"] / len(tests)


@SCORERS.register("code")
def code(
    responses: TextColumn,
    ground_truths: TextColumn,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_workers: int = 4,
) -> np.ndarray:
    """Fraction of the ground truth's unit tests passed; timeouts and crashes score 0."""
    if memory_mb < 32 or timeout_s <= 0:
        raise ScorerError(f"code scorer needs memory_mb >= 32 and timeout_s > 0 (got {memory_mb}, {timeout_s})")
    test_lists = []
    for i, truth in enumerate(texts(ground_truths)):
        tests = parse_tests(truth)
        if not tests:
            raise ScorerError(f"row {i}: code ground truth holds no tests")
        test_lists.append(tests)
    codes = [response_code(r) for r in texts(responses)]
    scores = np.zeros(len(codes), dtype=np.float32)
    failed: list[int] = []
    errors: list[str] = []

    def score(i: int) -> None:
        try:
            scores[i] = run_tests(codes[i], test_lists[i], timeout_s, memory_mb)
        except _SandboxDown as exc:
            failed.append(i)
            errors.append(str(exc))

    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        list(pool.map(score, range(len(codes))))
    if failed:
        raise ScorerInfraError(f"code sandbox failed on {len(failed)} of {len(codes)} rows: {errors[0]}",
                               failed=sorted(failed), scores=scores)
    return scores
