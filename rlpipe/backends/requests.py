"""The rollout engine contract: requests in, results out (SPEC R5).

Shared by every rollout backend (the embedded CPU engine today; an SGLang client
would map the same types onto its HTTP protocol). Plain dataclasses of numpy
arrays and Python scalars, so they pickle cheaply through Ray.

A request carries ``max_tokens``, the one source of truth for the response cap;
a resumed request also carries its partial response with that part's logprobs
and versions. A result always has as many logprobs and versions as tokens, and
an aborted request returns its partial tokens with ``finish_reason="abort"``,
never an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Sequence

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
