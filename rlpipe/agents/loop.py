"""The agent loop: episodes as explicit state machines, driven over any rollout engine (SPEC R5, seed 5.2).

An :class:`Episode` is one trajectory of an agent. Its phases::

    pending ──start──▶ generating ──turn done──▶ processing_tools ──observation──▶ generating ─ … ─▶ terminated
                            │  (no call / budget / turns)                │ (tool_error)
                            └──────────────────────────────────────────▶ terminated(reason)

with the termination reason one of ``eos`` (a turn ended without a tool call),
``max_turns``, ``max_length`` (the response budget, ``max_tokens`` of the
request, is spent), ``tool_error`` (a failed call under ``on_tool_error:
terminate``, or an infrastructure failure: status ``failed``) and ``aborted``.

Token accounting (seed 5.2.1-5.2.2): an episode holds one growing response —
the engine's token ids of every model turn, appended as returned (mask 1, their
logprobs and policy versions), and the tokenized observations between turns
(mask 0, logprob 0, the version of the turn they answer). The next turn's
prompt is the prompt followed by that response, token for token: nothing is
decoded and re-encoded, so there is no re-tokenization drift. Each model turn's
``[start, end)`` in the response is a generation span.

:class:`AgentEngine` is itself a :class:`~rlpipe.inference.contract.RolloutEngine`:
it takes the trajectory requests of the generate stage or the async modes'
rollout service, runs one episode per request, and drives the wrapped engine
(embedded, SGLang, vLLM: any) with one engine request per model turn through
``submit``/``step``. ``abort_all`` aborts the engine, keeps every unfinished
episode (an aborted turn keeps its partial tokens; running tools keep running)
and hands it back as an ``"abort"`` :class:`AgentResult`, whose ``resume`` gives
the request that re-attaches it: after a weight push, the aborted turn resumes
(``GenerationResult.resume``) under the new version, so one episode carries both
versions. A finished episode comes back as an :class:`AgentResult`, which
carries ``response_mask``, ``generation_spans``, the turn count and termination
for the trajectory table.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from rlpipe.inference.contract import EngineError, GenerationRequest, GenerationResult, RolloutEngine
from rlpipe.registry import registry
from rlpipe.schemas.batch import STATUS_FAILED, STATUS_OK, STATUS_TRUNCATED

AGENTS = registry("agent")
"""name → ``build(engine, tokenizer, generate_params) -> RolloutEngine``."""

TERMINATIONS = ("eos", "max_turns", "max_length", "tool_error", "aborted", "timeout")
"""Why an episode ended; ``timeout`` is the gateway agent's (its program ran out of time)."""


class Phase(str, enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


@dataclass(frozen=True)
class AgentRequest(GenerationRequest):
    """A trajectory request naming its agent (the per-sample ``agent`` column), or re-attaching an aborted
    episode (made by :meth:`AgentResult.resume`)."""

    episode: Any = None
    agent: str | None = None  # None: the engine's default agent (generate.params.agent)


@dataclass
class AgentResult(GenerationResult):
    """A finished (or aborted) episode: the response with its mask, spans and how it ended."""

    response_mask: np.ndarray | None = None  # int8 [R]: 1 model token, 0 observation
    generation_spans: np.ndarray | None = None  # int32 [T, 2]: [start, end) of each model turn
    num_turns: int = 0
    termination: str = ""
    status: str = STATUS_OK
    prompt_ids: np.ndarray | None = None  # the episode's own prompt when it differs from the request's (gateway)
    episode: Any = None  # set on "abort" results: the episode to re-attach

    def resume(self, request: GenerationRequest) -> GenerationRequest:
        if self.episode is None:
            return super().resume(request)
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(GenerationRequest)}
        return AgentRequest(**fields, episode=self.episode, agent=getattr(request, "agent", None))

    def __getstate__(self):  # an episode (threads, futures) stays in its process
        return {**self.__dict__, "episode": None}


class Episode:
    """One agent trajectory: its phase, its token-level response, and the engine requests it wants sent.

    Subclasses implement :meth:`start`, :meth:`on_generation` and (for work outside
    the engine) :meth:`poll`; the base keeps the response, the phase history and
    the bookkeeping of aborted turns.
    """

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.phase = Phase.PENDING
        self.history: list[Phase] = [Phase.PENDING]
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.spans: list[tuple[int, int]] = []
        self.turns = 0
        self.termination: str | None = None
        self.status = STATUS_OK
        self.prompt_ids: Sequence[int] | None = None
        self._outbox: list[GenerationRequest] = []
        self._in_engine: dict[str, GenerationRequest] = {}
        self._partials: list[GenerationResult] = []
        self._lock = threading.Lock()

    # -- subclass hooks ---------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def on_generation(self, result: GenerationResult) -> None:
        raise NotImplementedError

    def poll(self) -> None:
        """Advance work outside the engine (tools, an agent program); called every step."""

    def waiting(self) -> bool:
        """True while the episode waits for something outside the engine."""
        return self.phase is Phase.PROCESSING_TOOLS

    def close(self) -> None:
        """Release what the episode holds (called once it is terminated and collected)."""

    def reject(self, request: GenerationRequest, error: Exception) -> None:
        """The engine refused one of this episode's requests (too long for its context, ...): by default
        that is the caller's error, raised; the gateway answers its client with it instead."""
        self._in_engine.pop(request.request_id, None)
        raise error

    # -- state and tokens -------------------------------------------------------------

    def enter(self, phase: Phase) -> None:
        if self.phase is Phase.TERMINATED:
            raise EngineError(f"episode {self.request.request_id!r} is terminated; it cannot enter {phase.value}")
        self.phase = phase
        self.history.append(phase)

    def terminate(self, reason: str, status: str | None = None) -> None:
        if reason not in TERMINATIONS:
            raise ValueError(f"unknown termination {reason!r}; known: {', '.join(TERMINATIONS)}")
        self.termination = reason
        self.status = status or (STATUS_OK if reason in ("eos", "tool_error") else STATUS_TRUNCATED)
        self.enter(Phase.TERMINATED)

    def add_model_tokens(self, result: GenerationResult) -> None:
        """Append one turn's tokens as the engine returned them: mask 1, their logprobs and versions."""
        start = len(self.ids)
        self.ids.extend(int(t) for t in result.response_ids)
        self.mask.extend([1] * len(result.response_ids))
        self.logprobs.extend(float(x) for x in result.logprobs)
        self.versions.extend(int(v) for v in result.versions)
        self.spans.append((start, len(self.ids)))
        self.turns += 1

    def add_observation(self, token_ids: Sequence[int], version: int | None = None) -> None:
        """Append tokens not produced by the model: mask 0, logprob 0, the version of the last model token."""
        if version is None:
            version = self.versions[-1] if self.versions else 0
        self.ids.extend(int(t) for t in token_ids)
        self.mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([int(version)] * len(token_ids))

    def budget(self) -> int:
        """Response tokens still allowed (the request's max_tokens caps model and observation tokens together)."""
        return self.request.max_tokens - len(self.ids)

    def send(self, request: GenerationRequest) -> None:
        with self._lock:
            self._outbox.append(request)

    # -- engine side (AgentEngine) ----------------------------------------------------

    def take_requests(self) -> list[GenerationRequest]:
        with self._lock:
            out, self._outbox = self._outbox, []
        for request in out:
            self._in_engine[request.request_id] = request
        return out

    def deliver(self, result: GenerationResult) -> None:
        request = self._in_engine.pop(result.request_id)
        if result.finish_reason == "abort":
            self._partials.append(result)
            self._in_engine[result.request_id] = request  # remembered for the resume
        else:
            self.on_generation(result)

    def reattach(self) -> None:
        """After an abort: resubmit the aborted turns with their partial tokens (GenerationResult.resume)."""
        partials, self._partials = self._partials, []
        for partial in partials:
            self.send(partial.resume(self._in_engine.pop(partial.request_id)))

    def result(self, finish_reason: str | None = None) -> AgentResult:
        """The trajectory so far; an ``"abort"`` result also shows the partial tokens of its aborted turns."""
        reason = finish_reason or {"eos": "stop", "tool_error": "stop"}.get(self.termination or "", "length")
        ids, logprobs, versions, mask, spans = self.ids, self.logprobs, self.versions, self.mask, self.spans
        for partial in self._partials if reason == "abort" else ():
            k = len(partial.response_ids)
            spans = [*spans, (len(ids), len(ids) + k)]
            ids, mask = [*ids, *partial.response_ids.tolist()], [*mask, *[1] * k]
            logprobs, versions = [*logprobs, *partial.logprobs.tolist()], [*versions, *partial.versions.tolist()]
        n = len(ids)
        return AgentResult(
            request_id=self.request.request_id, response_ids=np.asarray(ids, np.int32).reshape(n),
            logprobs=np.asarray(logprobs, np.float32).reshape(n),
            versions=np.asarray(versions, np.int32).reshape(n), finish_reason=reason,
            response_mask=np.asarray(mask, np.int8).reshape(n),
            generation_spans=np.asarray(spans, np.int32).reshape(len(spans), 2),
            num_turns=self.turns, termination=self.termination or "aborted", status=self.status,
            prompt_ids=None if self.prompt_ids is None else np.asarray(self.prompt_ids, np.int32),
        )


class AgentEngine(RolloutEngine):
    """A rollout engine running one :class:`Episode` per request over ``engine`` (see the module doc)."""

    def __init__(self, engine: RolloutEngine, make_episode: Callable[[GenerationRequest], Episode],
                 on_close: Callable[[], None] | None = None):
        self.engine = engine
        self.make_episode = make_episode
        self._on_close = on_close
        self._episodes: dict[str, Episode] = {}  # attached, unfinished episodes by request id
        self._owner: dict[str, str] = {}  # engine (turn) request id -> episode request id
        self._done: list[GenerationResult] = []
        self._wake = threading.Event()

    version = property(lambda self: self.engine.version)

    def notify(self) -> None:
        """Wake a step waiting for tools (tool futures and gateway handlers call this)."""
        self._wake.set()

    # -- requests ---------------------------------------------------------------------

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        requests = list(requests)
        ids = [r.request_id for r in requests]
        clash = sorted(set(ids) & set(self._episodes)) or sorted({i for i in ids if ids.count(i) > 1})
        if clash:
            raise EngineError(f"request id(s) {clash[:5]} already in flight; ids must be unique")
        for request in requests:
            episode = getattr(request, "episode", None)
            if episode is not None:
                episode.request = dataclasses.replace(request, episode=None)
                episode.reattach()
            else:
                episode = self.make_episode(request)
                episode.start()
            self._episodes[request.request_id] = episode
        self._pump()

    def _pump(self) -> None:
        """Poll every episode, send the engine what they ask for, collect the terminated ones."""
        outgoing = []
        for rid, episode in list(self._episodes.items()):
            if episode.phase is not Phase.TERMINATED:
                episode.poll()
            for request in episode.take_requests():
                self._owner[request.request_id] = rid
                outgoing.append(request)
        if outgoing:
            self._submit(outgoing)
        for rid in [r for r, e in self._episodes.items() if e.phase is Phase.TERMINATED and not e._in_engine]:
            episode = self._episodes.pop(rid)
            self._done.append(episode.result())
            episode.close()

    def _submit(self, requests: list[GenerationRequest]) -> None:
        """Send turn requests to the engine; one it refuses goes back to its episode (``reject``)."""
        try:
            self.engine.submit(requests)
            return
        except EngineError as exc:
            first = exc
        refused = [(requests[0], first)] if len(requests) == 1 else []
        for request in requests if len(requests) > 1 else ():  # the engine takes all or none: one by one
            try:
                self.engine.submit([request])
            except EngineError as exc:
                refused.append((request, exc))
        for request, error in refused:
            self._episodes[self._owner.pop(request.request_id)].reject(request, error)

    def step(self) -> list[GenerationResult]:
        self._pump()
        if self.engine.has_active() and self.engine.next_ready_in() == 0:
            self._route(self.engine.step())
        elif self._episodes:
            wait = min(0.05, self.engine.next_ready_in())
            if self._wake.wait(wait):
                self._wake.clear()
            if self.engine.has_active() and self.engine.next_ready_in() == 0:
                self._route(self.engine.step())
        self._pump()
        done, self._done = self._done, []
        return done

    def _route(self, results: Iterable[GenerationResult]) -> None:
        for result in results:
            rid = self._owner.pop(result.request_id, None)
            if rid is None or rid not in self._episodes:
                continue  # an episode dropped meanwhile
            self._episodes[rid].deliver(result)

    def abort_all(self) -> list[GenerationResult]:
        self._route(self.engine.abort_all())  # aborted turns are remembered by their episodes
        self._pump_terminated()
        aborted = [dataclasses.replace(e.result("abort"), episode=e) for e in self._episodes.values()]
        self._episodes, self._owner = {}, {}
        done, self._done = self._done, []
        return done + aborted

    def _pump_terminated(self) -> None:
        for rid in [r for r, e in self._episodes.items() if e.phase is Phase.TERMINATED and not e._partials]:
            episode = self._episodes.pop(rid)
            self._done.append(episode.result())
            episode.close()

    def _keep_for_next_step(self, results: list[GenerationResult]) -> None:
        self._done.extend(results)

    def num_running(self) -> int:
        return len(self._episodes)

    def num_waiting(self) -> int:
        return sum(e.waiting() for e in self._episodes.values())

    def has_active(self) -> bool:
        return bool(self._episodes or self._done)

    def next_ready_in(self) -> float:
        return 0.0 if self.has_active() else self.engine.next_ready_in()

    # -- weights and memory: the wrapped engine's -------------------------------------

    def load_weights(self, buckets: Sequence[Any], version: int) -> dict[str, float]:
        if self._episodes:
            raise EngineError(f"{len(self._episodes)} agent episode(s) in flight: abort_all() (and resume the "
                              "returned partials after the push) before loading weights")
        return self.engine.load_weights(buckets, version)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def sleep(self, discard_weights: bool = False) -> None:
        if self._episodes:
            raise EngineError(f"{len(self._episodes)} agent episode(s) in flight: abort or finish them before sleep()")
        self.engine.sleep(discard_weights)

    def wake(self) -> None:
        self.engine.wake()

    asleep = property(lambda self: self.engine.asleep)

    def health(self) -> dict[str, Any]:
        return {**self.engine.health(), "episodes": len(self._episodes)}

    def close_agent(self) -> None:
        """Release the agent's own resources (tool threads, a gateway), not the wrapped engine; idempotent."""
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def close(self) -> None:
        self.close_agent()
        self.engine.close()


class SingleTurnEpisode(Episode):
    """One generation as an episode: how ``single_turn`` rows run beside other agents in one engine."""

    def start(self) -> None:
        self.enter(Phase.GENERATING)
        self.send(dataclasses.replace(self.request, request_id=f"{self.request.request_id}#turn0"))

    def on_generation(self, result: GenerationResult) -> None:
        self.add_model_tokens(result)
        self.terminate("eos" if result.finish_reason == "stop" else "max_length")


def agent_names(params: Any) -> list[str]:
    """The agents an engine built for ``params`` serves: ``params.agent`` (the default) and ``params.agents``."""
    names = [getattr(params, "agent", "single_turn")]
    return names + [n for n in getattr(params, "agents", ()) if n not in names]


def build_agent(engine: RolloutEngine, tokenizer: Any, params: Any) -> RolloutEngine:
    """``engine`` behind the agent ``params.agent`` names (``single_turn``: the engine itself); with
    ``params.agents`` one agent engine serving all of them, each request by its ``agent`` (default: params.agent)."""
    names = agent_names(params)
    if len(names) == 1:
        return AGENTS.get(names[0])(engine, tokenizer, params)
    parts = {name: AGENTS.get(name)(engine, tokenizer, params.model_copy(update={"agent": name, "agents": []}))
             for name in names if name != "single_turn"}
    default = names[0]

    def make_episode(request: GenerationRequest) -> Episode:
        name = getattr(request, "agent", None) or default
        if name == "single_turn":
            return SingleTurnEpisode(request)
        if name not in parts:
            raise EngineError(f"request {request.request_id!r} names agent {name!r}, which this engine does not "
                              f"serve ({', '.join(names)}); add it to generate.params.agents")
        return parts[name].make_episode(request)

    def close() -> None:
        for part in parts.values():
            part.close_agent()

    routed = AgentEngine(engine, make_episode, on_close=close)
    for part in parts.values():
        part._wake = routed._wake  # their tools and gateways wake the engine that steps the episodes
        if hasattr(part, "gateway"):
            routed.gateway = part.gateway
    return routed
AGENTS.add("single_turn", lambda engine, tokenizer, params: engine)

