"""Starting and stopping an SGLang-protocol server as a child process.

Both servers the SGLang client can launch go through here: real SGLang
(``python -m sglang.launch_server``, which needs its own CUDA environment) and
rlpipe's embedded engine behind the same protocol
(``python -m rlpipe.inference.sglang_server``). The child gets a free loopback
port, its own process group (so ``kill`` takes its helpers with it) and
``PR_SET_PDEATHSIG`` = SIGKILL on Linux (so it dies with the process that
launched it, even when that one is killed without cleanup). Its output goes to a
log file that every startup error names.

Note: Linux sends the death signal when the *thread* that forked the child exits;
launch from a thread that lives as long as the engine (the main thread, an actor's).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from rlpipe.inference.contract import EngineError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def embedded_command(model_dir: str, port: int, weight_version: str, host: str = "127.0.0.1",
                     python: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """Command line of rlpipe's embedded engine behind the SGLang protocol.

    It decodes with the launching process's torch threads (the replica's share of the thread budget; the replica
    itself only waits on HTTP), not torch's default of one per core: two intra-op threads per process on a loaded
    machine wait on each other (beside 12 busy processes a 120-token answer took 0.4-5.9 s with 2 threads, 0.1-0.2 s
    with 1)."""
    import torch

    threads = [] if "--num-threads" in extra else ["--num-threads", str(torch.get_num_threads())]
    return [python or sys.executable, "-m", "rlpipe.inference.sglang_server", "--model-dir", model_dir,
            "--host", host, "--port", str(port), "--weight-version", weight_version, *threads, *extra]


def sglang_command(model_path: str, port: int, weight_version: str, host: str = "127.0.0.1",
                   python: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """Command line of a real SGLang server (flags as in sglang 0.5.23's server args).

    For the engine's sleep/wake (/release_memory_occupation, /resume_memory_occupation)
    add ``--enable-memory-saver`` to ``extra`` (it needs the torch_memory_saver package).
    """
    return [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--host", host, "--port", str(port), "--weight-version", weight_version, *extra]


class ServerProcess:
    """A launched server: its process, URL and log file; ``kill()`` is idempotent."""

    def __init__(self, command: Sequence[str], url: str, log_path: Path, env: dict[str, str] | None = None):
        self.command = list(command)
        self.url = url
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent, env=env,
        )
        log.info("launched %s (pid %d), log %s", " ".join(self.command[:4]), self.process.pid, self.log_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout_s: float, probe: str = "/health") -> None:
        """Poll ``probe`` until it answers 200; raise EngineError naming the log file otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise EngineError(
                    f"the server process exited with code {self.process.returncode} before answering {probe}; "
                    f"see its log {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + probe, timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise EngineError(
                    f"the server at {self.url} did not answer {probe} within {timeout_s:.0f} s; see its log "
                    f"{self.log_path} (raise startup_timeout_s if it is only slow)")
            time.sleep(0.2)

    def kill(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; wait for the child."""
        if self.process.returncode is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=grace_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.process.returncode is None:
            self.process.wait()
        if not self._log.closed:
            self._log.close()


def launch(command: Sequence[str], url: str, log_path: Path, startup_timeout_s: float,
           env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``command`` and wait until it serves ``/health``."""
    server = ServerProcess(command, url, log_path, env)
    server.wait_healthy(startup_timeout_s)
    return server
