"""The ``code`` scorer: a solution runs against the data's unit tests in the agents' sandbox.

Rule-based reward for code (verl's ``prime_code`` / ``sandbox_fusion`` rewards, done
locally): the response's last fenced code block (or the whole response) is executed in
a fresh interpreter by :func:`rlpipe.agents.sandbox.run_python` — the same sandbox as the
agents' ``python`` tool: CPU, address-space and file-size rlimits, a wall-clock limit
that kills the process group, and, where ``unshare`` works, its own network and PID
namespaces (no network; every process it forked dies with it). Inside, a small harness
runs the solution, then each test (a JSON list of snippets, or Python source with one
test per top-level statement), and reports the number of tests that passed. The score is
``passed / len(tests)``.

Before the solution runs, the harness installs a Python audit hook (PEP 578) that refuses
what a unit-tested function never needs: starting processes (fork, exec, spawn, system,
subprocess), sockets, ``ctypes``, and writes, deletions or renames outside the sandbox's
own temporary directory. This is defense in depth over the OS limits above (audit hooks
are not a security boundary by themselves: CPython says so), so a runaway or careless
solution cannot fork-bomb, phone out or scribble over the host even where ``unshare`` is
not permitted.

Outcomes: a wrong answer, an exception, a timeout, a memory or file-size limit, a crash
all score what passed before it (usually 0). Only a sandbox that did not come up — it
could not start, or died before the harness said "ready" — is an infrastructure failure
(:class:`~rlpipe.stages.scorers.ScorerInfraError`): the reward stage marks those rows
``status = "failed"`` so DAPO and the advantage leave them out instead of teaching them as
wrong, and counts them (``reward/infra_failures``).

Left out: integrity against a solution that *deliberately* forges its result (the tests run
in the solution's interpreter, which can reach the harness's frames); use a separate
judge process or an external service (e.g. sandbox-fusion) for adversarial settings.
Also stdin/stdout-style tests and per-test timeouts.
"""

from __future__ import annotations

import ast
import base64
import json
import logging
import math
import re
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from pydantic import Field, ValidationError

from rlpipe.agents.sandbox import SandboxLimits, run_python
from rlpipe.agents.tools import ToolInfraError
from rlpipe.stages.scorers import (
    SCORERS,
    ScorerError,
    ScorerInfraError,
    ScorerOptions,
    TextColumn,
    texts,
    with_options,
)

log = logging.getLogger(__name__)

STARTUP_S = 5.0
"""Wall-clock seconds allowed on top of ``timeout_s`` for starting the interpreter and the harness. A
sandbox that is killed before its harness said "ready" is an infrastructure failure of its row, and on
a loaded node (a reward pool's other sandboxes, a rollout engine on the same cores) the start alone has
taken over 1.5 s; the allowance costs only solutions that hang, which hold their sandbox that much longer."""
MAX_SPEC_CHARS = 100_000
"""The solution and tests travel compressed in the sandbox's command line (one argument may hold
128 KiB on Linux); a row whose spec is longer scores 0 with a warning."""

# Runs inside the sandbox. The streams are silenced for the solution; the harness reports on a
# private duplicate of stdout, each line prefixed with a per-call nonce (so printed text cannot be
# mistaken for a result).
_HARNESS = r'''
import base64, json, os, sys, zlib
_spec = json.loads(zlib.decompress(base64.b64decode("{blob}")))
_nonce, _root = _spec["nonce"], os.path.realpath(os.getcwd())
_out = os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_RDWR)
for _fd in (0, 1, 2):
    os.dup2(_null, _fd)
_out.write(_nonce + " ready\n"); _out.flush()

_PROCESS = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "ctypes.dlopen", "ctypes.dlsym"}
_PATHS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.symlink": 2, "os.link": 2,
          "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1, "shutil.rmtree": 1}

def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _root or real.startswith(_root + os.sep)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _writes(mode, flags):
    return any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)

def _guard(event, args):
    if event in _PROCESS:
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "open" and _writes(args[1], args[2]) and not _inside(args[0]):
        raise PermissionError("sandbox: writing outside the sandbox directory is not allowed")
    if event in _PATHS and not all(_inside(p) for p in args[:_PATHS[event]]):
        raise PermissionError("sandbox: " + event + " outside the sandbox directory is not allowed")

sys.addaudithook(_guard)
_ns, _passed, _tests = {"__name__": "solution"}, 0, _spec["tests"]
try:
    exec(compile(_spec["code"], "<solution>", "exec"), _ns)
except BaseException:
    _tests = []
for _test in _tests:
    try:
        exec(compile(_test, "<test>", "exec"), _ns)
        _passed += 1
    except BaseException:
        pass
_out.write(_nonce + " passed " + str(_passed) + "\n"); _out.flush()
'''

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
        raise ScorerError(f"code ground truth is neither a JSON list of tests nor Python source ({exc}); "
                          'give e.g. ["assert f(1) == 2", ...]') from None
    return [ast.get_source_segment(ground_truth, node) for node in tree.body]


class SandboxDown(Exception):
    """The sandbox did not come up (could not start, or died before running the solution)."""


def run_tests(code: str, tests: list[str], limits: SandboxLimits) -> float:
    """Fraction of ``tests`` that ``code`` passes in one sandboxed run; raises :class:`SandboxDown`."""
    nonce = secrets.token_hex(8)
    blob = base64.b64encode(zlib.compress(json.dumps({"nonce": nonce, "code": code, "tests": tests}).encode()))
    if len(blob) > MAX_SPEC_CHARS:
        log.warning("code scorer: solution + tests compress to %d chars (limit %d); the row scores 0",
                    len(blob), MAX_SPEC_CHARS)
        return 0.0
    try:
        output = run_python(_HARNESS.replace("{blob}", blob.decode()), limits)
    except ToolInfraError as exc:
        raise SandboxDown(str(exc)) from exc
    lines = [line.split(" ", 2)[1:] for line in output.text.splitlines() if line.startswith(nonce + " ")]
    if ["ready"] not in lines:
        raise SandboxDown(f"sandbox died before running the solution (memory_mb={limits.memory_mb} too low?): "
                          f"{output.text.strip()[-300:]}")
    passed = [int(rest[1]) for rest in lines if rest and rest[0] == "passed"]
    return passed[-1] / len(tests) if passed else 0.0  # no result: timeout, limit or crash → what passed: none


class CodeScorerOptions(ScorerOptions):
    """Options of the ``code`` scorer (reward ``scorer_params.code``)."""

    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock seconds for the solution and its tests (the sandbox adds its start-up time)."""
    memory_mb: int = Field(1024, ge=32)
    """Address-space limit of the sandboxed interpreter, in MiB."""
    max_file_mb: int = Field(16, ge=1)
    """Largest file the solution may write (in its own directory), in MiB."""
    max_workers: int = Field(4, ge=1)
    """Sandboxes run at once."""


@SCORERS.register("code")
@with_options(CodeScorerOptions)
def code(responses: TextColumn, ground_truths: TextColumn, **options) -> np.ndarray:
    """Fraction of the ground truth's unit tests passed; timeouts, limits and crashes score what passed (0).
    ``options``: :class:`CodeScorerOptions` (a bad value raises a ScorerError naming ``scorer_params.code``)."""
    try:
        opts = CodeScorerOptions.model_validate(options)
    except ValidationError as exc:
        raise ScorerError(f"code scorer: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}; fix reward "
                          "scorer_params.code") from None
    timeout_s, memory_mb, max_file_mb, max_workers = opts.timeout_s, opts.memory_mb, opts.max_file_mb, opts.max_workers
    test_lists = []
    for i, truth in enumerate(texts(ground_truths)):
        tests = parse_tests(truth)
        if not tests:
            raise ScorerError(f"row {i}: code ground truth holds no tests")
        test_lists.append(tests)
    limits = SandboxLimits(cpu_s=math.ceil(timeout_s) + 1, wall_s=timeout_s + STARTUP_S, memory_mb=memory_mb,
                           max_file_mb=max_file_mb)
    codes = [response_code(r) for r in texts(responses)]
    scores = np.zeros(len(codes), dtype=np.float32)
    failed: dict[int, str] = {}

    def score(i: int) -> None:
        try:
            scores[i] = run_tests(codes[i], test_lists[i], limits)
        except SandboxDown as exc:
            failed[i] = str(exc)

    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(score, range(len(codes))))
    if failed:
        first = min(failed)
        raise ScorerInfraError(f"code sandbox failed on {len(failed)} of {len(codes)} rows (row {first}: "
                               f"{failed[first]})", failed=sorted(failed), scores=scores)
    return scores
