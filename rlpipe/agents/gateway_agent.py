"""``gateway``: black-box agent programs as trajectories (seed 5.3-5.4).

Each trajectory request starts an agent *program* — a registered function
(registry ``agent_program``, :mod:`rlpipe.agents.programs`: ``fn(base_url, api_key,
prompt)``) run in a thread, or a Python script run as a subprocess with ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and the prompt on stdin — pointed at this replica's
:class:`~rlpipe.agents.gateway.Gateway` with a base URL that carries the
session id. The program talks OpenAI chat completions; the gateway records the
session token by token; when the program returns (or times out) the session
ends and becomes the trajectory: its first templated prompt is the row's
``prompt_ids`` and everything after it the response (model tokens mask 1,
everything the program added mask 0).

The stage's sampling settings (temperature, top-p/k, seed) replace whatever the
program asks for: the trainer's logprobs assume them. The gateway's engine calls go through the :class:`~rlpipe.agents.loop.AgentEngine`
like the tool agent's turns, so a weight push aborts a turn in flight and
resumes it after the push while the program's HTTP request simply waits.

Phases: ``processing_tools`` while the program works on its side,
``generating`` while one of its requests is in the engine, ``terminated`` with
``eos`` (the program returned), ``timeout`` (status truncated), ``max_length``
(the session hit its token cap) or ``tool_error`` with status ``failed`` (the
program raised or exited non-zero, or never called the gateway).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from rlpipe.agents.config import GatewayAgentParams
from rlpipe.agents.gateway import Gateway, GatewayError
from rlpipe.agents.loop import AGENTS, AgentEngine, Episode, Phase
from rlpipe.agents.programs import AGENT_PROGRAMS
from rlpipe.inference.contract import GenerationRequest, GenerationResult, RolloutEngine
from rlpipe.schemas.batch import STATUS_FAILED, STATUS_TRUNCATED

log = logging.getLogger(__name__)


def run_script(script: str, base_url: str, api_key: str | None, prompt: str, timeout: float) -> None:
    """Run an agent script (fresh interpreter, own process group, killed with its children on timeout)."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key or "none"}
    proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(prompt.encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"agent script {script} ran past {timeout:g} s and was killed") from None
    if proc.returncode:
        tail = out.decode(errors="replace")[-2000:]
        raise RuntimeError(f"agent script {script} exited with code {proc.returncode}:\n{tail}")


class GatewayContext:
    """What the gateway episodes of one replica share: the gateway, the program runner, the thread pool."""

    def __init__(self, params: GatewayAgentParams, tokenizer: Any, max_tokens: int):
        self.params = params
        self.tokenizer = tokenizer
        self.api_key = secrets.token_hex(16)
        self.episodes: dict[str, "GatewayEpisode"] = {}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(params.workers, thread_name_prefix="rlpipe-agent-program")
        self.gateway = Gateway(self, tokenizer, api_key=self.api_key, default_max_tokens=max_tokens,
                               max_session_tokens=params.max_session_tokens or max_tokens,
                               tool_parser=params.tool_parser, limits=params.limits).start()
        self.notify: Callable[[], None] = lambda: None
        self.run: Callable[[str, str | None, str], None]
        if params.script is not None:
            self.run = lambda url, key, prompt: run_script(params.script, url, key, prompt, params.timeout_s)
        else:
            self.run = AGENT_PROGRAMS.get(params.program)

    def complete(self, session_id: str, request: GenerationRequest) -> GenerationResult:
        """The gateway's backend: the session's episode sends the turn through the agent engine."""
        with self.lock:
            episode = self.episodes.get(session_id)
        if episode is None:
            raise GatewayError(f"unknown session {session_id!r}: use the base URL the program was given", 404)
        # the stage's sampling (temperature, top-p/k, seed) overrides the client's: the trainer assumes it
        future = episode.ask(dataclasses.replace(request, sampling=episode.request.sampling))
        self.notify()
        return future.result()

    def close(self) -> None:
        self.gateway.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class GatewayEpisode(Episode):
    """One program run = one gateway session = one trajectory."""

    def __init__(self, request: GenerationRequest, ctx: GatewayContext):
        super().__init__(request)
        self.ctx = ctx
        self.session_id = re.sub(r"[^\w.:@-]", "_", request.request_id)[:128]  # deterministic: it keys the sampling
        self._waiters: dict[str, Future] = {}
        self.program: Future | None = None
        self.deadline = 0.0

    def start(self) -> None:
        with self.ctx.lock:
            self.ctx.episodes[self.session_id] = self
        self.ctx.gateway.reopen(self.session_id)
        self.enter(Phase.PROCESSING_TOOLS)
        prompt = self.ctx.tokenizer.decode(list(self.request.prompt_ids), skip_special_tokens=True)
        self.program = self.ctx.pool.submit(self.ctx.run, self.ctx.gateway.session_url(self.session_id),
                                            self.ctx.api_key, prompt)
        self.program.add_done_callback(lambda _: self.ctx.notify())
        self.deadline = time.monotonic() + self.ctx.params.timeout_s

    def ask(self, request: GenerationRequest) -> Future:
        """Called by a gateway handler thread: queue one turn for the engine."""
        future: Future = Future()
        if self.phase is Phase.TERMINATED:
            future.set_exception(GatewayError(f"session {self.session_id!r} has ended", 409))
            return future
        with self._lock:
            self._waiters[request.request_id] = future
        self.send(request)
        return future

    def take_requests(self) -> list[GenerationRequest]:
        out = super().take_requests()
        if out and self.phase is Phase.PROCESSING_TOOLS:
            self.enter(Phase.GENERATING)
        return out

    def on_generation(self, result: GenerationResult) -> None:
        with self._lock:
            future = self._waiters.pop(result.request_id)
        if self.phase is Phase.GENERATING and not self._in_engine:
            self.enter(Phase.PROCESSING_TOOLS)
        future.set_result(result)

    def reject(self, request: GenerationRequest, error: Exception) -> None:
        """The engine refused the program's request: the program gets a 400, the episode goes on."""
        self._in_engine.pop(request.request_id, None)
        with self._lock:
            future = self._waiters.pop(request.request_id)
        if self.phase is Phase.GENERATING and not self._in_engine:
            self.enter(Phase.PROCESSING_TOOLS)
        future.set_exception(GatewayError(f"the rollout engine refused the request: {error}", 400))

    def poll(self) -> None:
        if self._in_engine or self._waiters or self._outbox:
            return  # a turn is on its way: end only between turns
        if self.program.done():
            error = self.program.exception()
            if error is not None:
                log.warning("agent program of %s failed: %s", self.request.request_id, error)
            self._finish(error)
        elif time.monotonic() > self.deadline:
            self._finish(None, timed_out=True)

    def _finish(self, error: BaseException | None, timed_out: bool = False) -> None:
        with self.ctx.lock:
            self.ctx.episodes.pop(self.session_id, None)
        session = self.ctx.gateway.end_session(self.session_id, wait=False)
        seg = session.current if session is not None else None
        if seg is None:
            return self.terminate("tool_error", STATUS_FAILED)
        self.prompt_ids = seg.prompt_ids
        self.ids, self.mask, self.logprobs, self.versions = seg.ids, seg.mask, seg.logprobs, seg.versions
        self.spans, self.turns = seg.spans, session.turns
        if error is not None:
            self.terminate("tool_error", STATUS_FAILED)
        elif timed_out:
            self.terminate("timeout", STATUS_TRUNCATED)
        elif session.cut:
            self.terminate("max_length")
        else:
            self.terminate("eos")

    def waiting(self) -> bool:
        return self.phase is Phase.PROCESSING_TOOLS


def _gateway_agent(engine: RolloutEngine, tokenizer: Any, params: Any) -> RolloutEngine:
    ctx = GatewayContext(params.gateway, tokenizer, params.max_tokens)
    agent = AgentEngine(engine, lambda request: GatewayEpisode(request, ctx), on_close=ctx.close)
    ctx.notify = agent.notify
    agent.gateway = ctx.gateway
    return agent


AGENTS.add("gateway", _gateway_agent)
