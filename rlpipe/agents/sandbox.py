"""The ``python`` tool: run model-written code in a sandboxed subprocess.

Each call starts ``python -I`` in a fresh temporary directory with an empty
environment, in its own process group (``start_new_session``); the child sets
its ``setrlimit`` limits before it runs the code: CPU seconds (``RLIMIT_CPU``, the kernel
kills with SIGXCPU/SIGKILL), address space (``RLIMIT_AS``: an allocation past it
raises MemoryError), file size (``RLIMIT_FSIZE``) and open files. A wall-clock
limit kills the whole process group (the code and every child it forked).

Network: when ``unshare`` can create namespaces (root, or unprivileged user
namespaces), the code runs in a new user + network + PID namespace
(``unshare -rn -p -f --kill-child``): there is no network interface but a
down loopback, so every connection fails, and when the namespace's first process
dies the kernel kills everything left in it — also a child that escaped the
process group with ``setsid``. Without ``unshare`` the network is *not* cut (a
warning is logged once; :func:`network_isolated` says which case holds).

Outcomes: the code's failure (non-zero exit, a traceback, a limit hit, a
timeout) is an observation with ``ok=False`` and the reason; a failure to start
the sandbox at all raises :class:`~rlpipe.agents.tools.ToolInfraError`.

Left out: a filesystem jail (the code runs as this user in its temp dir and can
read and write what the user can), seccomp filters, GPU isolation, and
persistent interpreter state between calls (each call is a fresh process).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from rlpipe.agents.tools import ToolInfraError, ToolOutput

log = logging.getLogger(__name__)

_UNSHARE = ("unshare", "-rn", "-p", "-f", "--kill-child")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (``agent_loop.tool_settings.python`` sets them)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 256
    max_file_mb: int = 16
    max_output_chars: int = 2000
    isolate_network: bool = True


@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """True when ``unshare`` can give the sandbox its own (empty) network and PID namespaces here."""
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        log.warning("python sandbox: `unshare -rn -p -f` is not permitted here (%s); sandboxed code keeps "
                    "network access", done.stderr.decode(errors="replace").strip())
    return done.returncode == 0


# The child sets its own limits, then runs the code (not preexec_fn: Python documents it as unsafe in
# threaded processes, and tool calls run on a thread pool).
_BOOT = """
import resource, sys
cpu, memory, fsize = (int(x) for x in sys.argv[1:4])
code = sys.argv[4]
del sys.argv[1:]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
del resource, cpu, memory, fsize
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolOutput:
    """Run ``code`` under ``limits``; the observation is its stdout+stderr (or why it was stopped)."""
    command = [sys.executable, "-I", "-c", _BOOT, str(limits.cpu_s), str(limits.memory_mb * 2**20),
               str(limits.max_file_mb * 2**20), code]
    if limits.isolate_network and network_isolated():
        command = [*_UNSHARE, *command]
    workdir = tempfile.mkdtemp(prefix="rlpipe-sandbox-")
    try:
        try:
            proc = subprocess.Popen(
                command, cwd=workdir, env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise ToolInfraError(f"python sandbox: cannot start {command[0]!r}: {exc}") from exc
        try:
            out, _ = proc.communicate(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, _ = proc.communicate()
        _kill_group(proc.pid)  # children the code left behind in its group
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode(errors="replace")
    relayed = "unshare: sigprocmask" in text  # unshare's init could not re-raise the signal that killed the code
    text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("unshare: "))
    text = text[-limits.max_output_chars:]
    if timed_out:
        return ToolOutput(f"{text}\nerror: killed after the wall-clock limit of {limits.wall_s:g} s", ok=False)
    if proc.returncode == 0:
        return ToolOutput(text)
    why = f"killed by a signal (CPU limit {limits.cpu_s} s)" if relayed else _why(proc.returncode, limits)
    return ToolOutput(f"{text}\nerror: {why}", ok=False)


def _why(returncode: int, limits: SandboxLimits) -> str:
    if returncode < 0:
        sig = signal.Signals(-returncode)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return f"killed by {sig.name} (CPU limit {limits.cpu_s} s)"
        return f"killed by {sig.name}"
    if returncode in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):  # relayed by unshare's init
        return f"killed by {signal.Signals(returncode - 128).name} (CPU limit {limits.cpu_s} s)"
    return f"exit code {returncode}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class PythonTool:
    """``python(code)``: run code in the sandbox; prints are the observation."""

    limits: SandboxLimits = SandboxLimits()
    name: str = "python"

    def run(self, arguments: Mapping[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput("error: python needs a string argument `code`", ok=False)
        return run_python(code, self.limits)
