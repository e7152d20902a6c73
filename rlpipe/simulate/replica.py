"""A rollout replica as ``rlpipe simulate`` sees it: a continuous-batching decode loop.

The engines rlpipe drives (the embedded one, vLLM, SGLang) decode every running request one
token per iteration, and an iteration costs more the more requests it carries. The model:
an iteration costs ``per_step_s + per_token_s × k`` for ``k`` running requests, so a request
of ``L`` tokens finishes ``L`` iterations after it started, and a batch submitted at once
takes ``per_step_s × (longest response) + per_token_s × (all its tokens)`` — the
fit :mod:`rlpipe.simulate.calibration` makes from a recorded sync run's generate calls.

The clock advances in one event per finished request, not per token: the replica counts
iterations as a fluid (``progress``), each request finishes at the progress it entered at plus
its length, and the next completion is the smallest of those (a heap). A request waits
for its environment (``ready_at``) without taking compute. A weight push pauses the loop (no
iteration while the new weights load) and stamps later tokens with the new version; requests
in flight keep their tokens (partial rollout), so one spans two versions; the engine prefills them again
under the new weights before it decodes on (their tokens so far, each at a running request's cost).

Where the replica shares cores with the trainer and the driver (:mod:`rlpipe.simulate.contention`),
its iterations run at the share of its speed the recording measured. Left out: prefill cost per
request (folded into the call overhead of sync calls); memory limits on the running batch (a real
engine queues past its KV cache).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from rlpipe.simulate.contention import Contention
from rlpipe.simulate.kernel import Kernel

_EPS = 1e-9  # progress is a float sum: requests finishing "together" differ by rounding


@dataclass
class Group:
    """The ``n`` requests of one prompt (a GRPO group) from submission to the buffer."""

    uid: int
    submit_step: int
    lengths: list[int]
    left: int = 0
    """Requests not finished yet."""
    min_version: int | None = None
    max_version: int | None = None
    finished_at: float | None = None
    on_done: Callable[["Group", "Replica"], None] | None = None
    """Called when the last request finishes (else the replica's ``on_group_done``)."""

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))


@dataclass
class Request:
    """One trajectory of a group: the tokens it will generate and when its environment lets it start."""

    group: Group
    tokens: int
    ready_at: float
    finish_progress: float = 0.0
    version: int = 0
    """The engine's version when the request started decoding (its oldest token's)."""


@dataclass
class Replica:
    """One rollout replica's decode loop (see the module docstring)."""

    kernel: Kernel
    index: int
    per_step_s: float
    per_token_s: float
    on_group_done: Callable[[Group, "Replica"], None]
    version: int = 0
    progress: float = 0.0
    busy_s: float = 0.0
    _running: list = field(default_factory=list)  # heap of (finish_progress, seq, Request)
    _waiting_env: int = 0
    _paused: int = 0
    _last: float = 0.0
    _turn: int = 0
    _seq: itertools.count = field(default_factory=itertools.count)
    contention: Contention | None = None
    """Its speed and the trainer's where they share cores (None: its own; rlpipe.simulate.contention)."""

    def __post_init__(self):
        if not (self.per_step_s > 0 or self.per_token_s > 0):  # free iterations: the loop would never advance time
            raise ValueError(f"rollout[{self.index}]: a decode iteration must cost time (per_step_s="
                             f"{self.per_step_s}, per_token_s={self.per_token_s}); the calibration has no generation cost")
        self.idle = self.kernel.signal(f"rollout[{self.index}] idle")

    # -- requests ------------------------------------------------------------------------------
    def submit(self, group: Group, ready_at: list[float]) -> None:
        """Queue a group's requests (``ready_at``: when each one's environment lets it start)."""
        group.left = len(group.lengths)
        for tokens, ready in zip(group.lengths, ready_at):
            request = Request(group, int(tokens), ready)
            if ready > self.kernel.now:
                self._waiting_env += 1
                self.kernel.call_at(ready, self._start_after_env, request)
            else:
                self._start(request)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (running or waiting for their environment)."""
        return len(self._running) + self._waiting_env

    def _start_after_env(self, request: Request) -> None:
        self._waiting_env -= 1
        self._start(request)

    def _start(self, request: Request) -> None:
        self._advance()
        was = self.decoding
        request.version = self.version
        if request.tokens <= 0:  # nothing to decode: finished on arrival
            self._finish(request)
            self._schedule()
            return
        request.finish_progress = self.progress + request.tokens
        heapq.heappush(self._running, (request.finish_progress, next(self._seq), request))
        self._schedule()
        self._decoding_may_change(was)

    # -- the loop --------------------------------------------------------------------------------
    def _iteration_s(self) -> float:
        return self._at_share(self.per_step_s + self.per_token_s * len(self._running))

    def _at_share(self, seconds: float) -> float:
        """Wall seconds of ``seconds`` of the loop's own work, at the share of its speed it runs at."""
        return seconds / self.contention.decode_share if self.contention is not None else seconds

    @property
    def decoding(self) -> bool:
        """Requests are decoding now (running, not paused)."""
        return bool(self._running) and not self._paused

    def _decoding_may_change(self, was: bool) -> None:
        if self.contention is not None and was != self.decoding:
            self.contention.replica_changed()

    def _advance(self) -> None:
        """Move ``progress`` to now (the iterations decoded since the last event)."""
        now = self.kernel.now
        if self._running and not self._paused:
            dt = now - self._last
            cost = self._iteration_s()
            if cost > 0:
                self.progress += dt / cost
            self.busy_s += dt
        self._last = now

    def _schedule(self) -> None:
        self._turn += 1
        if self._paused or not self._running:
            if not self._running and not self._waiting_env:
                self.idle.fire()
            return
        first = self._running[0][0]
        delay = max(0.0, first - self.progress) * self._iteration_s()
        self.kernel.call_later(delay, self._complete, self._turn)

    def _complete(self, turn: int) -> None:
        if turn != self._turn:  # superseded by a later arrival, pause or completion
            return
        self._advance()
        was = self.decoding
        while self._running and self._running[0][0] <= self.progress + _EPS:
            _, _, request = heapq.heappop(self._running)
            self.progress = max(self.progress, request.finish_progress)
            self._finish(request)
        self._schedule()
        self._decoding_may_change(was)

    def _finish(self, request: Request) -> None:
        group = request.group
        group.min_version = request.version if group.min_version is None else min(group.min_version, request.version)
        group.max_version = self.version if group.max_version is None else max(group.max_version, self.version)
        group.left -= 1
        if group.left == 0:
            group.finished_at = self.kernel.now
            (group.on_done or self.on_group_done)(group, self)

    # -- weight pushes -------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop decoding (the engine is released, or loads weights); requests keep their progress."""
        self._advance()
        was = self.decoding
        self._paused += 1
        self._turn += 1
        self._decoding_may_change(was)

    def resume(self, version: int | None = None) -> None:
        """Decode again, on weights ``version`` when given (later tokens carry it): the requests a push stopped are
        first prefilled again under the new weights — their tokens so far, each at a decoding request's cost."""
        self._advance()
        was = self.decoding
        self._paused = max(0, self._paused - 1)
        redo = 0.0
        if version is not None and version != self.version:
            redo = self.per_token_s * sum(r.tokens - (r.finish_progress - self.progress) for _, _, r in self._running)
            self.version = version
        if redo > 0 and not self._paused:
            self._paused += 1
            cost = self._at_share(redo)
            self.busy_s += cost
            self.kernel.call_later(cost, self.resume)
        self._schedule()
        self._decoding_may_change(was)

    @property
    def paused(self) -> bool:
        return self._paused > 0
