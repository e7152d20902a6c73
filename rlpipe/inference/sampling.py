"""Vectorized token sampling for the embedded rollout engine.

Temperature, top-k and top-p (nucleus) per row, then one inverse-CDF draw per
row from a counter-based uniform: ``uniforms(keys, positions)`` hashes a
request's 32-bit stream key with the response position (Chris Wellons'
``lowbias32`` mixer, two draws for 53 bits), so a draw never depends on the
other rows of the batch or on a shared generator's history.

Top-k is applied first, then top-p on the renormalized top-k distribution
(vLLM's and SGLang's order). The returned logprob is the log-probability of the
sampled token under that final distribution; with temperature 1, top_k 0 and
top_p 1 it is the model's plain log-softmax.

Left out: min-p, repetition/frequency penalties, logit bias.
"""

from __future__ import annotations

import hashlib

import torch

_MASK32 = 0xFFFFFFFF


def stream_key(seed: int, request_id: str) -> int:
    """32-bit key of a request's random stream: a function of its seed and id only."""
    digest = hashlib.blake2b(f"{seed}\x00{request_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values.

    Products may wrap around int64; the low 32 bits, all we keep, are still exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per (key, position) pair, a pure function of both."""
    keys = keys.long() & _MASK32
    positions = positions.long() & _MASK32
    hi = _mix32((keys + _mix32(2 * positions)) & _MASK32)
    lo = _mix32((keys + _mix32(2 * positions + 1)) & _MASK32)
    return ((hi << 21) | (lo >> 11)).double() / float(1 << 53)


def filter_logits(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p drop from logits sorted in descending order."""
    vocab = sorted_logits.shape[-1]
    ranks = torch.arange(vocab)
    k = torch.where(top_k > 0, top_k, vocab)
    logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # Rows with top_p == 1 skip the test: float rounding would otherwise cut their tail.
    drop = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    return logits.masked_fill(drop, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; returns ``(token ids [B], logprobs [B] float32)``."""
    logits = logits.float() / temperature[:, None]
    order = None
    if bool((top_k > 0).any() or (top_p < 1).any()):
        logits, order = logits.sort(dim=-1, descending=True)
        logits = filter_logits(logits, top_k, top_p)
    logp = torch.log_softmax(logits, dim=-1)
    cdf = logp.double().exp().cumsum(-1)
    total = cdf[:, -1:]
    choice = torch.searchsorted(cdf, u[:, None] * total, right=True)
    # Rounding can push the draw past the last token with mass; the first index
    # where the CDF reaches its total is that token.
    choice = torch.minimum(choice, (cdf < total).sum(-1, keepdim=True))
    logprob = logp.gather(1, choice).squeeze(1)
    token = (order.gather(1, choice) if order is not None else choice).squeeze(1)
    return token, logprob
