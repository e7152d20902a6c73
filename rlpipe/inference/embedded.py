"""The embedded rollout engine: sampling from a Hugging Face causal LM on CPU.

Our own decode loop with a KV cache: a cohort of requests is prefilled together
(left-padded, attention mask, position ids), then decoded one forward per step
for the whole cohort. Qwen2 / Llama models run the lean forward of
``rlpipe.backends.lean_forward`` with a cache preallocated per cohort; other
models their own forward with a transformers ``DynamicCache`` (chosen once, at
construction). Requests submitted while others run form a new cohort at
the next ``step()`` and join the running one at the step after (the lean forward's
caches are merged: left-padded to one length, the positions no live row attends to
dropped), so every step is one decode forward over every running request;
finished rows leave their cohort (the cache is compacted). The API is the one
continuous batching needs: ``submit`` / ``step`` / ``abort_all`` / ``has_active``.
(The model's own forward, for other families, keeps one cohort per arrival.)

Randomness is counter-based: the uniform that picks response token ``j`` of a
request is a hash of (seed, request id, j), and a token is drawn by inverse CDF.
A trajectory therefore depends only on its seed, id and the weights, not on
which other requests shared its batch (up to float rounding of the batched
forward), and a resume without a weight change redraws the same tokens. The returned logprob is the one of the *sampling*
distribution (after temperature, top-k, top-p).

Versions (SPEC R6): the engine holds the policy ``version`` of its weights and
stamps every token it samples with it. A push (``load_weights``) is refused
while requests are in flight; callers ``abort_all()`` first and resubmit the
partial trajectories, which are re-prefilled under the new weights (the old KV
cache is invalid), so their versions switch exactly at the push. With ``trainer.lora``
a push carries only the adapters: the engine keeps the base weights of the adapted
layers and merges each push into its model (``rlpipe.backends.lora.MergedAdapter``),
so decoding runs on plain weights at full speed.

Requests of one cohort with equal tokens (the n samples of a prompt) are prefilled
once and share the KV rows. Left out: greedy decoding (temperature must be > 0), stop
strings, prefix-cache reuse across cohorts and for partly equal prompts, speculative
decoding, and trimming of left padding that finished rows leave behind in a
cohort no request joins.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rlpipe.inference import sampling
from rlpipe.inference.contract import (
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    check_new_requests,
    make_result,
    validate_request,
)
from rlpipe.backends.lean_forward import LeanForward, StaticKV, lean_unsupported
from rlpipe.backends.lora import MergedAdapter
from rlpipe.backends.weights import LocalTensors, WeightBucket, load_buckets, load_tensors
from rlpipe.jagged import distinct_rows

if TYPE_CHECKING:  # transformers costs seconds to import; stage modules import this one at plan time
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = ["EmbeddedEngine", "EngineError", "GenerationRequest", "GenerationResult", "SamplingParams"]


@dataclass
class _Cohort:
    """Requests prefilled together, sharing one KV cache; row i of every tensor is requests[i]."""

    requests: list[GenerationRequest]
    cache: Any  # transformers.DynamicCache
    attention_mask: torch.Tensor  # [B, L] over prompt + response so far
    next_position: torch.Tensor  # [B] position id of the next input token
    budget: torch.Tensor  # [B] tokens this cohort may still add per row
    uniforms: torch.Tensor  # [B, longest budget] the draw of each response position, made at prefill
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    ignore_eos: torch.Tensor  # [B] bool
    stop_extra: torch.Tensor  # [B, S] each row's stop_token_ids besides eos, padded with -1
    out_tokens: torch.Tensor  # [B, longest budget] the ids sampled so far, row i's first filled[i]
    out_logprobs: torch.Tensor  # [B, longest budget]
    filled: torch.Tensor  # [B] tokens sampled per row (rows of merged cohorts differ)
    last_token: torch.Tensor | None = None  # [B] the token each row feeds next


class EmbeddedEngine(RolloutEngine):
    """Embedded CPU inference engine holding one model, its tokenizer and its policy version.

    The engine owns ``model`` (it switches it to eval mode and overwrites its
    parameters on every push); give a trainer its own copy.
    """

    decodes_in_process = True

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, version: int = 0,
                 lean: bool = True, adapter: MergedAdapter | None = None):
        self.model = model.eval()
        self.adapter = adapter
        """With trainer.lora: the kept base weights into which every push (adapters only) is merged."""
        reason = lean_unsupported(model) if lean else "turned off"
        self.forward: _HFForward | _LeanForward = _LeanForward(model) if reason is None else _HFForward(model)
        """How the cohort forwards run, chosen once: the lean forward (rlpipe.backends.lean_forward) for the
        Qwen2 / Llama family, the model's own forward otherwise."""
        log.info("embedded engine: %s", "lean forward" if reason is None else f"the model's own forward ({reason})")
        self.tokenizer = tokenizer
        self.version = version
        self.max_positions = int(model.config.max_position_embeddings)
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = torch.tensor([tokenizer.eos_token_id])
        self._pending: list[GenerationRequest] = []
        self._cohorts: list[_Cohort] = []
        self._done: list[GenerationResult] = []
        self._asleep = False
        self._discarded: dict[str, torch.Size] | None = None  # shapes of weights freed by sleep

    # -- requests -------------------------------------------------------------------

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Queue requests; they are prefilled by the next ``step()``."""
        self._check_ready()
        requests = list(requests)
        in_flight = {r.request_id for r in self._pending} | {r.request_id for c in self._cohorts for r in c.requests}
        check_new_requests(requests, in_flight, self._validate)
        for request in requests:
            if len(request.response_ids) >= request.max_tokens:
                self._done.append(make_result(request, (), (), self.version, "length"))
            elif (len(request.response_ids) and not request.sampling.ignore_eos
                  and int(request.response_ids[-1]) in (*self.stop_ids.tolist(), *request.sampling.stop_token_ids)):  # with ignore_eos an eos inside the partial is just a token
                self._done.append(make_result(request, (), (), self.version, "stop"))
            else:
                self._pending.append(request)

    def num_running(self) -> int:
        """Requests queued or decoding (finished ones waiting for collection not counted)."""
        return len(self._pending) + sum(len(c.requests) for c in self._cohorts)

    def has_active(self) -> bool:
        """True while some request is queued, decoding, or finished but not yet collected."""
        return bool(self._pending or self._cohorts or self._done)

    def num_waiting(self) -> int:
        """Queued requests whose ``ready_at`` has not come yet (they take no compute)."""
        now = time.monotonic()
        return sum(r.ready_at > now for r in self._pending)

    def next_ready_in(self) -> float:
        """Seconds until ``step()`` has work: 0 when it has now, ``inf`` when nothing is active."""
        if self._cohorts or self._done:
            return 0.0
        if not self._pending:
            return math.inf
        return max(0.0, min(r.ready_at for r in self._pending) - time.monotonic())

    @torch.no_grad()
    def step(self) -> list[GenerationResult]:
        """Prefill queued requests, decode one token for every running one; returns those that finished."""
        self._check_ready()
        if len(self._cohorts) > 1 and isinstance(self.forward, _LeanForward):
            # one forward for every running request (continuous batching): at this scale a forward's cost is
            # mostly per operation, so decoding each cohort apart multiplies it by the number of cohorts
            self._cohorts = [_merge(self._cohorts)]
        for cohort in self._cohorts:
            self._advance(cohort, self._decode_logits(cohort))
        if self._pending:
            now = time.monotonic()
            ready = [r for r in self._pending if r.ready_at <= now]  # per request, not per token
            if ready:
                self._pending = [r for r in self._pending if r.ready_at > now]
                cohort, logits = self._prefill(ready)
                self._cohorts.append(cohort)
                self._advance(cohort, logits)
        self._cohorts = [c for c in self._cohorts if c.requests]
        done, self._done = self._done, []
        return done

    def _keep_for_next_step(self, results: list[GenerationResult]) -> None:
        self._done.extend(results)

    def abort_all(self) -> list[GenerationResult]:
        """Stop every request; each returns its partial tokens with finish_reason "abort"."""
        aborted = [make_result(r, (), (), self.version, "abort") for r in self._pending]
        for cohort in self._cohorts:
            tokens, logprobs = _stacked(cohort)
            for row, request in enumerate(cohort.requests):
                aborted.append(make_result(request, tokens[row], logprobs[row], self.version, "abort"))
        done, self._done, self._pending, self._cohorts = self._done, [], [], []
        return done + aborted

    # -- weights and memory ---------------------------------------------------------

    def load_weights(self, buckets: Sequence[WeightBucket] | LocalTensors, version: int) -> dict[str, float]:
        """Load pushed weights (checked before any is written) and adopt their policy ``version``; a
        :class:`~rlpipe.backends.weights.LocalTensors` push (a trainer in this process) is copied straight in."""
        self._check_push(version)
        start = time.perf_counter()
        self._reallocate()
        if self.adapter is not None:  # adapters only: each adapted weight becomes W0 + scale·B·A, from the kept W0
            self.adapter.load(buckets)
        elif isinstance(buckets, LocalTensors):
            load_tensors(self.model, buckets.tensors)
        else:
            load_buckets(self.model, buckets)
        self._discarded = None
        loaded = time.perf_counter()
        self.version = version
        self.reset_prefix_cache()
        nbytes = buckets.nbytes if isinstance(buckets, LocalTensors) else sum(b.nbytes for b in buckets)
        return {"load_s": loaded - start, "cache_reset_s": time.perf_counter() - loaded, "bytes": float(nbytes)}

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: no KV cache outlives its cohort (prefix reuse across requests is left out),
        and a load happens only with no cohort alive."""

    def sleep(self, discard_weights: bool = False) -> None:
        """Release memory between rollouts.

        On CPU there is no separate device memory: sleeping drops the KV caches
        (none exist between rollouts) and marks the engine asleep. With
        ``discard_weights`` the parameter storage is freed too (what a colocated
        trainer wants); the next ``load_weights`` reallocates and fills it.
        """
        if self.num_running():
            raise EngineError("abort or finish in-flight requests before sleep()")
        if discard_weights and self._discarded is None:
            # with an adapter a push brings A and B only: just the merged weights can be dropped (the next push
            # recomputes them from the kept base); the others stay
            droppable = None if self.adapter is None else set(self.adapter.weight_names)
            self._discarded = {}
            for name, param in self.model.named_parameters():
                if droppable is None or name in droppable:
                    self._discarded[name] = param.shape
                    param.data = torch.empty(0, dtype=param.dtype)
        self._asleep = True

    def wake(self) -> None:
        """Undo ``sleep()``; discarded weights stay unusable until ``load_weights``."""
        self._asleep = False

    @property
    def asleep(self) -> bool:
        """True between sleep() and wake()."""
        return self._asleep

    def health(self) -> dict:
        self._check_ready()
        return {"version": self.version, "running": self.num_running()}

    def _reallocate(self) -> None:
        if self._discarded is None:
            return
        for name, param in self.model.named_parameters():
            if name in self._discarded:
                param.data = torch.empty(self._discarded[name], dtype=param.dtype)

    def _check_ready(self) -> None:
        if self._asleep:
            raise EngineError("the rollout engine is asleep; call wake() before generating")
        if self._discarded is not None:
            raise EngineError("the engine's weights were discarded by sleep(); push weights (load_weights) first")

    def _validate(self, r: GenerationRequest) -> None:
        validate_request(r, self.max_positions, "the model's max_position_embeddings")

    # -- the decode loop ------------------------------------------------------------

    def _prefill(self, requests: list[GenerationRequest]) -> tuple[_Cohort, torch.Tensor]:
        seqs = [np.concatenate([r.prompt_ids, r.response_ids]).astype(np.int64) for r in requests]
        lens = torch.tensor([len(s) for s in seqs])
        width = int(lens.max())
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attention_mask = (torch.arange(width)[None, :] >= (width - lens)[:, None]).long()
        input_ids[attention_mask.bool()] = torch.from_numpy(np.concatenate(seqs))
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        prefix = torch.tensor([len(r.response_ids) for r in requests])
        budget = torch.tensor([r.max_tokens for r in requests]) - prefix
        # n samples of one prompt arrive as n requests with equal tokens: prefill each distinct sequence once and
        # repeat its KV cache rows (vLLM/SGLang get the same from their prefix caches)
        distinct_ids, distinct_mask, distinct_positions, row_of = distinct_rows(input_ids, attention_mask)
        shared = 2 * len(distinct_ids) <= len(seqs)
        if shared:
            input_ids, attention_mask, position_ids = distinct_ids, distinct_mask, distinct_positions
        cache, logits, attention_mask = self.forward.prefill(input_ids, attention_mask, position_ids, int(budget.max()))
        if shared:
            cache.batch_select_indices(row_of)
            logits, attention_mask = logits[row_of], attention_mask[row_of]
        keys = torch.tensor([sampling.stream_key(r.sampling.seed, r.request_id) for r in requests])
        # Every uniform the cohort can need, in one vectorized call instead of one per decode step;
        # each is still the pure function of (request key, response position) that makes a
        # trajectory independent of its batch.
        width = int(budget.max())
        positions = prefix[:, None] + torch.arange(width)[None, :]
        cohort = _Cohort(
            requests=list(requests), cache=cache, attention_mask=attention_mask, next_position=lens,
            budget=budget, uniforms=sampling.uniforms(keys[:, None], positions),
            out_tokens=torch.zeros(len(requests), width, dtype=torch.long),
            out_logprobs=torch.zeros(len(requests), width, dtype=torch.float32),
            filled=torch.zeros(len(requests), dtype=torch.long),
            temperature=torch.tensor([r.sampling.temperature for r in requests], dtype=torch.float32),
            top_k=torch.tensor([r.sampling.top_k for r in requests]),
            top_p=torch.tensor([r.sampling.top_p for r in requests], dtype=torch.float32),
            ignore_eos=torch.tensor([r.sampling.ignore_eos for r in requests], dtype=torch.bool),
            stop_extra=_padded_stops([r.sampling.stop_token_ids for r in requests]),
        )
        return cohort, logits

    def _decode_logits(self, c: _Cohort) -> torch.Tensor:
        logits, c.attention_mask = self.forward.decode(c.last_token, c.next_position, c.attention_mask, c.cache)
        c.next_position = c.next_position + 1
        return logits

    def _advance(self, c: _Cohort, logits: torch.Tensor) -> None:
        """Sample one token per row, then retire rows that hit eos or their budget."""
        at = c.filled[:, None]
        token, logprob = sampling.sample(logits, c.temperature, c.top_k, c.top_p, c.uniforms.gather(1, at)[:, 0])
        c.out_tokens.scatter_(1, at, token[:, None])
        c.out_logprobs.scatter_(1, at, logprob.to(c.out_logprobs.dtype)[:, None])
        c.filled += 1
        c.last_token = token
        stop = (torch.isin(token, self.stop_ids) | (token[:, None] == c.stop_extra).any(1)) & ~c.ignore_eos
        done = stop | (c.budget <= c.filled)
        if not done.any():
            return
        tokens, logprobs = _stacked(c)
        for row in done.nonzero().flatten().tolist():  # once per finished row, not per token
            reason: FinishReason = "stop" if stop[row] else "length"
            self._done.append(make_result(c.requests[row], tokens[row], logprobs[row], self.version, reason))
        _retain(c, (~done).nonzero().flatten())


class _HFForward:
    """Cohort forwards through the model's own forward and a transformers ``DynamicCache``."""

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                new_tokens: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The cache, the last position's logits ``[B, V]`` and the attention mask the decode steps extend."""
        from transformers import DynamicCache  # lazy: see the TYPE_CHECKING import above

        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        return cache, logits, attention_mask

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
               cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, V]`` after feeding ``tokens`` ``[B]`` at ``positions``, and the grown attention mask."""
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=positions[:, None],
                         cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], attention_mask


class _LeanForward:
    """Cohort forwards through :class:`~rlpipe.backends.lean_forward.LeanForward`: a cache preallocated for the
    cohort's longest budget, and a key mask over all of it (the prompt's padding, then the response positions)."""

    def __init__(self, model: PreTrainedModel):
        self.lean = LeanForward(model)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                new_tokens: int) -> tuple[StaticKV, torch.Tensor, torch.Tensor]:
        key_mask = torch.cat([attention_mask.bool(), torch.ones(len(input_ids), new_tokens, dtype=torch.bool)], dim=1)
        cache = self.lean.static_cache(len(input_ids), key_mask.shape[1])
        logits = self.lean(input_ids, position_ids, key_mask, cache, logits_at=slice(-1, None))[:, -1]
        return cache, logits, key_mask

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
               cache: StaticKV) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lean(tokens[:, None], positions[:, None], key_mask, cache)[:, -1], key_mask


def _padded_stops(stops: list[tuple[int, ...]]) -> torch.Tensor:
    """[B, S] stop ids per row, -1 where a row has fewer (never a sampled id); S >= 1 keeps shapes simple."""
    width = max((len(s) for s in stops), default=0) or 1
    out = torch.full((len(stops), width), -1, dtype=torch.long)
    rows = [i for i, s in enumerate(stops) if s]  # usually none: one tensor per row costs ~10 µs
    for i in rows:
        out[i, : len(stops[i])] = torch.tensor(stops[i], dtype=torch.long)
    return out


def _stacked(c: _Cohort) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row, the tokens and logprobs sampled so far."""
    tokens, logprobs, filled = c.out_tokens.numpy(), c.out_logprobs.numpy(), c.filled.tolist()
    return [tokens[i, :n] for i, n in enumerate(filled)], [logprobs[i, :n] for i, n in enumerate(filled)]


def _padded(tensors: list[torch.Tensor], width: int, value: float) -> torch.Tensor:
    """``tensors`` (``[B_i, W_i]``) padded on the right to ``width`` with ``value`` and stacked by rows."""
    return torch.cat([F.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def _merge(cohorts: list[_Cohort]) -> _Cohort:
    """One cohort of every row of ``cohorts`` (lean forward caches): each cache's filled positions end at the
    longest one's length (left padding, masked out), so one decode forward serves all; every row keeps its own
    positions, budget, uniforms and sampled tokens, and samples exactly as it would have in its own cohort (up
    to float rounding of the batched forward). Positions no remaining row attends to (the left padding that
    finished rows leave behind) are dropped: a cohort that new requests keep joining never grows without bound."""
    spans = []  # per cohort: its first position any remaining row attends to, its filled length
    for c in cohorts:
        filled = c.cache.length
        starts = c.attention_mask[:, :filled].to(torch.uint8).argmax(1)  # every row has a real prompt token
        spans.append((int(starts.min()), filled))
    length = max(filled - start for start, filled in spans)
    left = max(int((c.budget - c.filled).max()) for c in cohorts)
    first = cohorts[0].cache
    layers, _, kv_heads, _, head_dim = first.k.shape
    cache = StaticKV(layers, sum(len(c.requests) for c in cohorts), kv_heads, length + left, head_dim,
                     first.k.dtype, first.k.device)
    cache.k.zero_()  # padding keys and values are read (and masked): no uninitialized NaN may reach the softmax
    cache.v.zero_()
    key_mask = torch.zeros(cache.k.shape[1], length + left, dtype=torch.bool)
    key_mask[:, length:] = True
    row = 0
    for c, (start, filled) in zip(cohorts, spans):
        rows, at = slice(row, row + len(c.requests)), length - (filled - start)
        cache.k[:, rows, :, at:length] = c.cache.k[:, :, :, start:filled]
        cache.v[:, rows, :, at:length] = c.cache.v[:, :, :, start:filled]
        key_mask[rows, at:length] = c.attention_mask[:, start:filled]
        row += len(c.requests)
    cache.length = length
    width = max(c.uniforms.shape[1] for c in cohorts)
    stops = max(c.stop_extra.shape[1] for c in cohorts)
    return _Cohort(
        requests=[r for c in cohorts for r in c.requests], cache=cache, attention_mask=key_mask,
        uniforms=_padded([c.uniforms for c in cohorts], width, 0.5),
        out_tokens=_padded([c.out_tokens for c in cohorts], width, 0),
        out_logprobs=_padded([c.out_logprobs for c in cohorts], width, 0.0),
        stop_extra=_padded([c.stop_extra for c in cohorts], stops, -1),
        **{name: torch.cat([getattr(c, name) for c in cohorts])
           for name in ("next_position", "budget", "filled", "last_token", "temperature", "top_k", "top_p",
                        "ignore_eos")})


def _retain(c: _Cohort, keep: torch.Tensor) -> None:
    """Drop finished rows from every per-row tensor and from the KV cache."""
    c.requests = [c.requests[i] for i in keep.tolist()]
    if not c.requests:
        return
    c.cache.batch_select_indices(keep)
    for name in ("attention_mask", "next_position", "budget", "uniforms", "temperature", "top_k", "top_p",
                 "ignore_eos", "stop_extra", "out_tokens", "out_logprobs", "filled", "last_token"):
        setattr(c, name, getattr(c, name)[keep])

