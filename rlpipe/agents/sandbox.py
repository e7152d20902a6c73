"""The ``python`` tool: run model-written code in a sandboxed subprocess.

Each call starts ``python -I -B`` in a fresh temporary directory with an empty
environment, in its own process group (``start_new_session``); the child sets
its ``setrlimit`` limits before it runs the code: CPU seconds (``RLIMIT_CPU``, the kernel
kills with SIGXCPU/SIGKILL), address space (``RLIMIT_AS``: an allocation past it
raises MemoryError), file size (``RLIMIT_FSIZE``) and open files. A wall-clock
limit kills the whole process group (the code and every child it forked).

Before the code runs, the child installs a Python audit hook (PEP 578, see
``_BOOT``) that raises PermissionError for: opening a file for writing, or
creating, removing, renaming, linking, chmod-ing a path, *outside its temp dir*;
creating or using sockets; starting processes (fork, exec, spawn, subprocess,
system; ``allow_processes`` lifts this); signalling other processes, or opening
another process's ``/proc/<pid>`` entries (its file descriptors, memory, command line); ctypes
symbol lookups and foreign calls, and importing _posixsubprocess (they reach the
OS without audit events); and rebinding a function's code. The code sees the error as a traceback, which
becomes the observation. This stops what model-written code does by accident or
naively (a fork bomb, ``open("/etc/x", "w")``, ``urllib.request.urlopen``); it is
*not* a security boundary against code written to escape: CPython documents
audit hooks as not suitable for sandboxing (a C extension, or a bug in the
interpreter, goes around them). Reads are not restricted.

Network: when ``unshare`` can create namespaces (root, or unprivileged user
namespaces), the code runs in a new user + network + PID namespace
(``unshare -rn -p -f --kill-child``): there is no network interface but a
down loopback, so every connection fails, and when the namespace's first process
dies the kernel kills everything left in it — also a child that escaped the
process group with ``setsid``. Where the kernel lets it mount one (``-m --mount-proc``;
refused e.g. in a container whose ``/proc`` is partly masked), the code also gets a
private ``/proc`` that shows only its own PID namespace: no other process's file
descriptors, memory or command line (the host's, the trainer's, another sandbox's) can
be named, let alone opened. Without ``unshare`` the network is *not* cut (a
warning is logged once; :func:`network_isolated` says which case holds).

Outcomes: the code's failure (non-zero exit, a traceback, a limit hit, a
timeout) is an observation with ``ok=False`` and the reason; a failure to start
the sandbox at all raises :class:`~rlpipe.agents.tool_types.ToolInfraError`.

Left out: a filesystem jail (no chroot or mount namespace without root: the code
runs as this user and can *read* what the user can), seccomp filters, GPU
isolation, and persistent interpreter state between calls (each call is a fresh
process). For code written to escape, run the tool in a container or VM.
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

from rlpipe.agents.tool_types import ToolInfraError, ToolOutput

log = logging.getLogger(__name__)

_UNSHARE = ("unshare", "-rn", "-p", "-f", "--kill-child")
_PRIVATE_PROC = ("-m", "--mount-proc")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (``agent_loop.tool_settings.python`` sets them)."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 256
    max_file_mb: int = 16
    max_output_chars: int = 2000
    isolate_network: bool = True
    allow_processes: bool = False  # let the code fork/exec/spawn (then the wall limit kills the whole group)


@functools.lru_cache(maxsize=1)
def unshare_prefix() -> tuple[str, ...]:
    """The strongest ``unshare`` command prefix that works here: own user, network and PID namespaces plus a
    private ``/proc``; without the private ``/proc`` where mounting it is refused; ``()`` without ``unshare``."""
    if shutil.which("unshare") is None:
        return ()
    why = ""
    for prefix in ((*_UNSHARE, *_PRIVATE_PROC), _UNSHARE):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as exc:
            why = str(exc)
            continue
        if done.returncode == 0:
            if prefix == _UNSHARE:
                log.warning("python sandbox: `unshare --mount-proc` is not permitted here (%s); sandboxed code "
                            "sees the host's /proc (the audit hook still refuses other processes' entries)", why)
            return prefix
        why = done.stderr.decode(errors="replace").strip()
    log.warning("python sandbox: `unshare -rn -p -f` is not permitted here (%s); sandboxed code keeps "
                "network access", why)
    return ()


def network_isolated() -> bool:
    """True when ``unshare`` can give the sandbox its own (empty) network and PID namespaces here."""
    return bool(unshare_prefix())


# The child sets its own limits and installs the guard, then runs the code (not preexec_fn: Python documents it
# as unsafe in threaded processes, and tool calls run on a thread pool). The guard is an audit hook (PEP 578):
# CPython calls it before every audited operation, and a hook cannot be removed once added. It refuses, with a
# PermissionError naming the rule: opening a file for writing, or creating/removing/renaming/linking/chmod-ing a
# path, outside the temp dir; sockets; new processes (fork, exec, spawn, subprocess, system) unless allowed;
# signals to other processes; opening another process's /proc/<pid> entries (where the private /proc of
# unshare_prefix is not permitted, they name the trainer's and other sandboxes' pipes and memory); what would
# step around the hooks (ctypes symbol lookups and calls, importing _posixsubprocess); and rebinding a
# function's code (how one would rewrite the guard). Importing ctypes stays allowed: numpy imports it.
_BOOT = """
import os, resource, sys
cpu, memory, fsize, allow_processes = (int(x) for x in sys.argv[1:5])
code = sys.argv[5]
del sys.argv[1:]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.dont_write_bytecode = True

def _guard(root=os.path.realpath(os.getcwd()) + os.sep, realpath=os.path.realpath, fspath=os.fspath,
           normpath=os.path.normpath, join=os.path.join, fsdecode=os.fsdecode,
           getpid=os.getpid, sep=os.sep, allow_processes=bool(allow_processes), Error=PermissionError,
           write_flags=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC,
           paths={"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
                  "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
                  "os.mkfifo": (0,), "os.mknod": (0,), "shutil.rmtree": (0,), "os.chdir": ()},
           processes=("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                      "subprocess.Popen", "os.startfile", "pty.spawn"),
           modules=("_xxsubinterpreters", "_interpreters"),
           foreign=("ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
                    "ctypes.cdata/buffer", "ctypes.addressof", "ctypes.string_at", "ctypes.wstring_at")):
    own_proc = {str(getpid()), os.path.basename(realpath("/proc/self"))}  # in a PID namespace the two differ

    def other_process(path):  # /proc/<pid>/... of another process, as written or through a link
        for p in (normpath(join(root, fsdecode(fspath(path)))), realpath(fspath(path))):
            parts = fsdecode(p).split(sep)
            if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] not in own_proc:
                return True
        return False

    def inside(path):
        if isinstance(path, int):  # a file descriptor the code already holds
            return True
        p = realpath(fspath(path))
        return p + sep == root or p.startswith(root) or p == "/dev/null"

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") if mode is not None else bool(flags & write_flags)
            if writing and path is not None and not inside(path):
                raise Error(f"sandbox: writing {path!r} is not allowed: only files under the temp dir {root}")
            if path is not None and not isinstance(path, int) and other_process(path):
                raise Error(f"sandbox: opening {path!r} is not allowed: another process's /proc entry")
        elif event in paths:
            for i in paths[event]:
                if args[i] is not None and not inside(args[i]):
                    raise Error(f"sandbox: {event} on {args[i]!r} is not allowed outside the temp dir {root}")
        elif event.startswith("socket.") and event != "socket.getservbyname":
            raise Error(f"sandbox: network access ({event}) is not allowed")
        elif event in processes and not allow_processes:
            raise Error(f"sandbox: starting processes ({event}) is not allowed")
        elif event == "import" and args[0] == "_posixsubprocess" and not allow_processes:  # fork_exec: no audit event
            raise Error("sandbox: starting processes (import subprocess) is not allowed")
        elif event in ("os.kill", "os.killpg") and args[0] not in (0, getpid()):
            raise Error(f"sandbox: signals to other processes ({event}) are not allowed")
        elif event == "import" and args[0] in modules:
            raise Error(f"sandbox: importing {args[0]} is not allowed")
        elif event in foreign:
            raise Error(f"sandbox: calling foreign code ({event}) is not allowed")
        elif event == "object.__setattr__" and args[1] == "__code__":
            raise Error("sandbox: rebinding a function's code is not allowed")
    return hook

sys.addaudithook(_guard())
del os, resource, cpu, memory, fsize, allow_processes, _guard
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def spawn_python(code: str, limits: SandboxLimits, workdir: str, **popen: Any) -> subprocess.Popen:
    """Start ``code`` under ``limits`` in ``workdir``, in a session of its own (the caller kills its group with
    :func:`kill_group` and enforces ``limits.wall_s``); ``popen``: the streams and ``pass_fds``. Raises OSError."""
    command = [sys.executable, "-I", "-B", "-c", _BOOT, str(limits.cpu_s), str(limits.memory_mb * 2**20),
               str(limits.max_file_mb * 2**20), str(int(limits.allow_processes)), code]
    if limits.isolate_network and network_isolated():
        command = [*unshare_prefix(), *command]
    return subprocess.Popen(command, cwd=workdir, env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir},
                            start_new_session=True, **popen)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolOutput:
    """Run ``code`` under ``limits``; the observation is its stdout+stderr (or why it was stopped)."""
    workdir = tempfile.mkdtemp(prefix="rlpipe-sandbox-")
    try:
        try:
            proc = spawn_python(code, limits, workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        except OSError as exc:
            raise ToolInfraError(f"python sandbox: cannot start {sys.executable!r}: {exc}") from exc
        try:
            out, _ = proc.communicate(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc.pid)
            out, _ = proc.communicate()
        kill_group(proc.pid)  # children the code left behind in its group
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


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (a sandbox started by :func:`spawn_python`); gone already is fine."""
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
