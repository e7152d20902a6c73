"""The rollout engine contract: requests in, results out (SPEC R5, seed 5.x and 6.x).

Every rollout engine — the embedded CPU engine, the vLLM server rlpipe starts,
an SGLang server (or rlpipe's embedded engine behind SGLang's protocol) — is a
:class:`RolloutEngine`. The ``generate`` stage, the async modes' rollout
service, partial rollout and ``weight_sync`` talk to that class only, so
``generate.params.engine`` picks the engine and nothing else changes.

Requests and results are plain dataclasses of numpy arrays and Python scalars,
so they pickle cheaply through Ray, and they are token-level: token ids in,
token ids, their logprobs and per-token policy versions out (no re-tokenization
anywhere).

A request carries ``max_tokens``, the one source of truth for the response cap;
a resumed request also carries its partial response with that part's logprobs
and versions. A result always has as many logprobs and versions as tokens, and
an aborted request returns its partial tokens with ``finish_reason="abort"``,
never an error.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from rlpipe.errors import RlpipeError

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RlpipeError):
    """The rollout engine was asked something it cannot do in its current state."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``max_tokens`` lives on the request (one source of truth)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    ignore_eos: bool = False  # generate exactly max_tokens (load generation, benchmarks)
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end the response like eos (kept in it, "stop")


@dataclass(frozen=True)
class GenerationRequest:
    """One trajectory to generate or, with a partial response, to resume."""

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int  # cap on the whole response, partial tokens included
    sampling: SamplingParams = SamplingParams()
    response_ids: Sequence[int] = ()
    logprobs: Sequence[float] = ()
    versions: Sequence[int] = ()
    ready_at: float = 0.0
    """``time.monotonic()`` before which the engine does not start the request: an environment's
    latency before the first token (a sandbox starting, a tool answering). A resumed request keeps it."""


@dataclass
class GenerationResult:
    """A finished (or aborted) trajectory: response tokens with per-token logprobs and versions."""

    request_id: str
    response_ids: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R]
    versions: np.ndarray  # int32 [R]
    finish_reason: FinishReason

    def resume(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` continued from this partial result (after an abort)."""
        return dataclasses.replace(
            request, response_ids=self.response_ids, logprobs=self.logprobs, versions=self.versions
        )


def make_result(
    request: GenerationRequest, new_ids, new_logprobs, version: int, reason: FinishReason
) -> GenerationResult:
    """The result of ``request``: its partial response (if resumed) followed by new tokens of ``version``."""
    return GenerationResult(
        request_id=request.request_id,
        response_ids=np.concatenate([np.asarray(request.response_ids, np.int32), np.asarray(new_ids, np.int32)]),
        logprobs=np.concatenate([np.asarray(request.logprobs, np.float32), np.asarray(new_logprobs, np.float32)]),
        versions=np.concatenate([np.asarray(request.versions, np.int32), np.full(len(new_ids), version, np.int32)]),
        finish_reason=reason,
    )


def validate_request(r: GenerationRequest, max_len: int | None = None, limit: str = "",
                     allow_greedy: bool = False) -> None:
    """EngineError listing what is wrong with ``r``: empty prompt, max_tokens < 1, prompt + max_tokens over
    ``max_len`` (``limit`` names that bound), sampling out of range (temperature 0 only with ``allow_greedy``),
    a resumed partial whose logprobs/versions do not match its tokens."""
    s, problems = r.sampling, []
    if not len(r.prompt_ids):
        problems.append("the prompt is empty")
    if r.max_tokens < 1:
        problems.append(f"max_tokens must be >= 1, got {r.max_tokens}")
    if max_len is not None and len(r.prompt_ids) + r.max_tokens > max_len:
        problems.append(f"prompt ({len(r.prompt_ids)} tokens) + max_tokens ({r.max_tokens}) exceeds {limit} "
                        f"({max_len}); shorten the prompt or lower max_tokens")
    temperature_ok = s.temperature >= 0 if allow_greedy else s.temperature > 0
    if not (temperature_ok and 0 < s.top_p <= 1 and s.top_k >= 0):
        problems.append(f"need temperature {'>=' if allow_greedy else '>'} 0, 0 < top_p <= 1, top_k >= 0; got {s}")
    if not len(r.response_ids) == len(r.logprobs) == len(r.versions):
        problems.append("a resumed request needs as many logprobs and versions as response_ids")
    if problems:
        raise EngineError(f"request {r.request_id!r}: " + "; ".join(problems))


def check_new_requests(requests: Sequence[GenerationRequest], in_flight: set[str],
                       validate: Callable[[GenerationRequest], None]) -> None:
    """Validate every request and refuse ids already in flight (or repeated), before any is queued."""
    known = set(in_flight)
    for request in requests:
        validate(request)
        if request.request_id in known:
            raise EngineError(f"request id {request.request_id!r} is already in flight; ids must be unique")
        known.add(request.request_id)


class RolloutEngine(abc.ABC):
    """The engine contract: continuous batching driven by ``submit`` / ``step``, plus weights and memory.

    Semantics every implementation keeps (tests/inference/test_contract.py runs them on each):

    - ``submit`` queues requests (ids unique among those in flight); ``step`` advances
      generation and returns the requests that finished since the last call — for an
      in-process engine one decode step, for a server client whatever completed within
      a short wait. ``generate`` is submit + step until all of its requests are back.
    - ``abort_all`` stops every request and returns each one's partial tokens with
      ``finish_reason="abort"`` (plus results finished but not yet collected); it never
      raises because requests were in flight.
    - ``load_weights`` is refused while requests are in flight (callers abort first and
      resume the partials: partial rollout); it adopts the pushed policy ``version``,
      stamps every later token with it, and invalidates the prefix cache (a cached
      prefix of the old weights must not serve the new version).
    - ``sleep`` / ``wake`` release and restore memory between rollouts; ``health`` raises
      :class:`EngineError` naming what is wrong when the engine cannot serve.
    - ``close`` releases everything the engine owns (a server process, its threads);
      it is idempotent.
    """

    version: int
    """Policy version of the weights the engine samples with; stamped on every token."""

    @abc.abstractmethod
    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Queue requests; invalid ones raise EngineError before any is queued."""

    decodes_in_process: bool = False
    """True when ``step()`` is one decode iteration computed in the calling thread (the embedded engine): its
    duration is what an iteration costs, and that thread's CPU time what it needed (the rollout service records
    both for ``rlpipe simulate``). A server client's ``step`` waits on another process: neither."""

    @abc.abstractmethod
    def step(self) -> list[GenerationResult]:
        """Advance generation; return the requests that finished since the last call."""

    @abc.abstractmethod
    def abort_all(self) -> list[GenerationResult]:
        """Stop every request; in-flight ones come back with their partial tokens and ``"abort"``."""

    @abc.abstractmethod
    def num_running(self) -> int:
        """Requests queued or generating (finished ones waiting for collection not counted)."""

    @abc.abstractmethod
    def has_active(self) -> bool:
        """True while some request is queued, generating, or finished but not yet collected."""

    def num_waiting(self) -> int:
        """Queued requests whose ``ready_at`` has not come (they take no compute)."""
        return 0

    def next_ready_in(self) -> float:
        """Seconds until ``step()`` has work: 0 when it has now, ``inf`` when nothing is active."""
        return 0.0 if self.has_active() else math.inf

    @abc.abstractmethod
    def load_weights(self, buckets: Sequence[Any], version: int) -> dict[str, float]:
        """Load pushed weight buckets (all checked before any is used), adopt ``version``, reset the
        prefix cache. Returns per-boundary timings/sizes (``transport_s``, ``load_s``,
        ``cache_reset_s``, ``bytes``: whatever applies to this engine)."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (KV blocks computed under earlier weights)."""

    @abc.abstractmethod
    def sleep(self, discard_weights: bool = False) -> None:
        """Release memory between rollouts (the KV cache; with ``discard_weights`` the weights too,
        which the next ``load_weights`` restores). Refused while requests are in flight."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Undo ``sleep()``."""

    @property
    @abc.abstractmethod
    def asleep(self) -> bool:
        """True between sleep() and wake()."""

    def health(self) -> dict[str, Any]:
        """Raise EngineError when the engine cannot serve; else a few facts about it."""
        return {"version": self.version}

    def close(self) -> None:
        """Release what the engine owns (processes, threads, connections); idempotent."""

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationResult]:
        """Submit ``requests`` and step until all of them finished; results in request order.

        Results of other callers' requests that finish meanwhile stay for their next ``step()``."""
        requests = list(requests)
        self.submit(requests)
        wanted = {r.request_id for r in requests}
        found: dict[str, GenerationResult] = {}
        others: list[GenerationResult] = []
        while len(found) < len(wanted):
            if 0 < (wait := self.next_ready_in()) < math.inf:  # only requests waiting for their environment
                time.sleep(wait)
            for result in self.step():
                if result.request_id in wanted:
                    found[result.request_id] = result
                else:
                    others.append(result)
        self._keep_for_next_step(others)
        return [found[r.request_id] for r in requests]

    def _check_push(self, version: int) -> None:
        """What every engine refuses at a weight push: requests in flight, a version that goes back."""
        if self.num_running():
            raise EngineError(f"{self.num_running()} request(s) in flight: abort or finish in-flight requests "
                              "before a weight push")
        if version < self.version:
            raise EngineError(f"weight version {version} is older than the engine's {self.version}; versions only grow")

    def _keep_for_next_step(self, results: list[GenerationResult]) -> None:
        """Hand results of other callers back so the next ``step()`` returns them."""
        if results:
            raise EngineError(f"{len(results)} result(s) of other callers arrived during generate(); "
                              f"{type(self).__name__} cannot hold them for the next step()")
