"""The ``code`` scorer: a solution runs against the data's unit tests in the agents' sandbox.

Rule-based reward for code (verl's ``prime_code`` / ``sandbox_fusion`` rewards, done locally): the
response's last fenced code block (or the whole response) is scored against the ground truth's tests (a
JSON list of snippets, or Python source with one test per top-level statement). Score = tests passed /
tests, in [0, 1].

Integrity — the solution must not decide its own score. A harness that runs in the solution's interpreter
cannot hold: the solution reaches anything in that interpreter (``sys._getframe().f_back``,
``gc.get_objects()``, a per-run nonce in memory, the report's file object), inherits its file descriptors
(``os.write`` to each of 0..64, ``/proc/self/fd``), and runs before the tests, so it can also hook them. So
each row runs as two sandboxed processes (:func:`rlpipe.agents.sandbox.spawn_python`; programs in
:mod:`rlpipe.stages.code_judge`):

* the **worker** runs the solution. Its only descriptors are /dev/null and two pipes to the judge; its
  stdout and stderr go nowhere. Whatever it writes on the pipes is read as the solution's *answers* (data,
  parsed strictly), never as a verdict.
* the **judge** runs the tests, with the solution's names bound to proxies: a call sends the arguments to
  the worker and gets data back. ``assert``, ``==`` and the count happen in the judge, on its own objects
  (an object whose ``__eq__`` always says yes never leaves the worker). The judge alone holds the report
  pipe to this process, the per-row nonce and the tests: they reach it on its stdin, which it reads to the
  end before the worker is started (no file another row's solution could read; the solution itself reaches
  the worker through the judge). None of that is in the worker's memory, descriptors or command line. The
  judge writes ``<nonce> ready``, ``<nonce> up`` (the worker answered, before it got the solution) and
  ``<nonce> passed <k>`` after each test.

So the worst a solution can do with its own channel is return wrong data or break the wire, which fails its
tests. (Closing the report's descriptor before the solution runs, or a nonce alone, would not do: in one
interpreter the harness's frames and objects still hold both.) Reaching the judge itself would take the OS:
where ``unshare`` works, each process has its own PID namespace (so neither signals nor ``ptrace`` can name
the judge) and, where ``--mount-proc`` is permitted, a private ``/proc`` without the judge's or this
process's descriptors; everywhere the sandbox's audit hook refuses other processes' ``/proc/<pid>``
entries. Without ``unshare`` only that hook stands, which CPython says is no boundary against native code.

The report is parsed strictly (:func:`read_verdict`): lines with the nonce must be exactly one of the three
forms and ``k`` at most the number of tests, else the row scores 0 (a warning); the score is clamped to
[0, 1]. Outcomes: a wrong answer, an exception, a timeout, a memory or file-size limit, a crash, junk on the
wire score what passed before it (usually 0). Only a sandbox that did not come up — the judge did not say
"ready", or the worker did not say "up" before the wall-clock limit — is an infrastructure failure
(:class:`~rlpipe.stages.scorers.ScorerInfraError`): the reward stage marks those rows ``status = "failed"``
so DAPO and the advantage leave them out instead of teaching them as wrong, and counts them
(``reward/infra_failures``). The solution cannot cause that: nothing of it runs before "up".

Both processes keep the sandbox's limits (CPU, address-space, file-size rlimits; no network and their own
PID namespaces via ``unshare``; an audit hook refusing processes, sockets, ``ctypes`` and writes outside
their directories) under one wall-clock limit that kills both process groups.

Left out: what a *test* may do with the solution's objects is limited (see ``code_judge``: no callables
passed in, no in-place mutation seen, proxies compare by identity, solution names that shadow builtins are
not bound); stdin/stdout-style tests and per-test timeouts. The sandbox is not a VM: for adversarial
settings against native-code escapes, use an external service (e.g. sandbox-fusion).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import Field, ValidationError

from rlpipe.agents.sandbox import SandboxLimits, kill_group, spawn_python
from rlpipe.stages import code_judge
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
"""Wall-clock seconds allowed on top of ``timeout_s`` for starting the two interpreters. A sandbox that is
killed before both came up is an infrastructure failure of its row, and on a loaded node (a reward pool's
other sandboxes, a rollout engine on the same cores) one start alone has taken over 1.5 s; the allowance
costs only solutions that hang, which hold their sandbox that much longer."""
MAX_SPEC_CHARS = 1_000_000
"""A row whose solution and tests together are longer scores 0 with a warning (no unit-tested function is
that long; both travel through the judge, whose memory limit they would only eat into)."""
MAX_REPORT_BYTES = 2**20
"""Of the judge's report (its own lines, or a traceback if it failed to start) at most this much is kept."""
REAP_S = 5.0
"""Seconds to wait for a killed sandbox process to be reaped before giving up on it (with a warning)."""

_PROGRAM = Path(code_judge.__file__).read_text(encoding="utf-8")
_VERDICT = re.compile(r"ready|up|passed (0|[1-9][0-9]{0,8})")

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


@dataclass(frozen=True)
class Verdict:
    """What the judge's report says: whether both processes came up, the last count, and a line not its own."""

    ready: bool = False
    up: bool = False
    passed: int = 0
    forged: str | None = None


def read_verdict(report: str, nonce: str, n_tests: int) -> Verdict:
    """The judge's report, parsed strictly: only lines that begin with ``nonce`` count, and each must be
    ``ready``, ``up`` or ``passed <k>`` with ``0 <= k <= n_tests``; the first that is not is ``forged``."""
    ready = up = False
    passed, forged = 0, None
    for line in report.split("\n"):
        if not line.startswith(nonce):
            continue  # not the judge's: a traceback, or unshare's messages
        match = _VERDICT.fullmatch(line[len(nonce) + 1:]) if line[len(nonce):len(nonce) + 1] == " " else None
        if match is None or (match[1] is not None and int(match[1]) > n_tests):
            forged = forged or line[:200]
        elif match[0] == "ready":
            ready = True
        elif match[0] == "up":
            up = True
        else:
            passed = int(match[1])
    return Verdict(ready, up, passed, forged)


def run_tests(code: str, tests: list[str], limits: SandboxLimits) -> float:
    """Fraction of ``tests`` that ``code`` passes (module docstring: the judge and the worker); raises
    :class:`SandboxDown` when the sandbox did not come up."""
    if len(code) + sum(map(len, tests)) > MAX_SPEC_CHARS:
        log.warning("code scorer: solution + tests are over %d characters; the row scores 0", MAX_SPEC_CHARS)
        return 0.0
    nonce = secrets.token_hex(16)
    report = _run_pair(code, tests, nonce, limits).decode(errors="replace")
    verdict = read_verdict(report, nonce, len(tests))
    if not verdict.ready:
        raise SandboxDown(f"the judge's sandbox did not come up (memory_mb={limits.memory_mb} too low?): "
                          f"{report.strip()[-300:]}")
    if not verdict.up:
        raise SandboxDown(f"the solution's sandbox did not come up (memory_mb={limits.memory_mb} too low?)")
    if verdict.forged is not None:  # only the judge knows the nonce: its report was tampered with
        log.warning("code scorer: a line of the judge's report is not its own (%r); the row scores 0", verdict.forged)
        return 0.0
    return min(max(verdict.passed / len(tests), 0.0), 1.0)


def _run_pair(code: str, tests: list[str], nonce: str, limits: SandboxLimits) -> bytes:
    """Start the judge with its spec on stdin, and the worker once the judge is ready; the judge's report until it
    ends or the wall-clock limit. Both process groups are killed on the way out. OSError starting either (or
    making their folders) is :class:`SandboxDown`."""
    deadline = time.monotonic() + limits.wall_s
    call_r, call_w = os.pipe()  # judge → worker
    reply_r, reply_w = os.pipe()  # worker → judge
    open_fds, procs, dirs, report = {call_r, call_w, reply_r, reply_w}, [], [], bytearray()
    spec = json.dumps({"nonce": nonce, "tests": tests, "solution": code, "fds": [call_w, reply_r]}).encode()

    def close(*fds: int) -> None:  # this process's copies, so that an end of file reaches the other side
        for fd in open_fds.intersection(fds):
            os.close(fd)
            open_fds.discard(fd)

    try:
        dirs += [tempfile.mkdtemp(prefix="rlpipe-judge-"), tempfile.mkdtemp(prefix="rlpipe-solution-")]
        procs.append(spawn_python(_PROGRAM + "\njudge_main()\n", limits, dirs[0], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(call_w, reply_r)))
        close(call_w, reply_r)
        if _exchange(procs[0], spec, report, deadline, until=f"{nonce} ready\n".encode()):
            procs.append(spawn_python(_PROGRAM + "\nworker_main()\n", limits, dirs[1], stdin=call_r,
                                      stdout=reply_w, stderr=subprocess.DEVNULL))
        close(call_r, reply_w)
        _exchange(procs[0], b"", report, deadline)
    except OSError as exc:
        raise SandboxDown(f"cannot start the sandbox: {exc}") from exc
    finally:
        close(*list(open_fds))
        for proc in procs:
            kill_group(proc.pid)  # the worker serves until its stdin closes; anything either left behind
        for proc in procs:
            try:
                proc.wait(timeout=REAP_S)
            except subprocess.TimeoutExpired:
                log.warning("code scorer: sandbox process %d not reaped %g s after SIGKILL", proc.pid, REAP_S)
        for stream in (procs[0].stdin, procs[0].stdout) if procs else ():
            stream.close()
        for folder in dirs:
            shutil.rmtree(folder, ignore_errors=True)
    return bytes(report)


def _exchange(judge: subprocess.Popen, data: bytes, report: bytearray, deadline: float,
              until: bytes | None = None) -> bool:
    """Write ``data`` to the judge's stdin (then close it) while appending its stdout to ``report``, until the
    line ``until`` is in the report (True), or its end of file or ``deadline`` (False). Never blocks on either
    pipe (a spec over the pipe's buffer waits on the judge's reads); polls, as ``select`` cannot watch
    descriptor numbers over 1023 (a busy process has them)."""
    poller, out = select.poll(), judge.stdout.fileno()
    poller.register(out, select.POLLIN)
    if data:
        os.set_blocking(judge.stdin.fileno(), False)
        poller.register(judge.stdin.fileno(), select.POLLOUT)
    while until is None or (b"\n" + report).find(b"\n" + until) < 0:
        left = deadline - time.monotonic()
        events = poller.poll(left * 1000) if left > 0 else []
        if not events:
            return False
        for fd, _ in events:
            if fd == out:
                chunk = os.read(out, 65536)
                if not chunk:
                    return False
                if len(report) < MAX_REPORT_BYTES:
                    report += chunk
                continue
            try:
                data = data[os.write(fd, data[:65536]):]
            except BlockingIOError:
                continue
            except BrokenPipeError:  # the judge died: its report says so (no "ready")
                data = b""
            if not data:
                poller.unregister(fd)
                judge.stdin.close()
    return True


class CodeScorerOptions(ScorerOptions):
    """Options of the ``code`` scorer (reward ``scorer_params.code``)."""

    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock seconds for the solution and its tests (the sandbox adds its start-up time)."""
    memory_mb: int = Field(1024, ge=32)
    """Address-space limit of each of the two sandboxed interpreters (the solution's, the tests'), in MiB."""
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
