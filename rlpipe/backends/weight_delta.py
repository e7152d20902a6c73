"""Delta weight pushes: send only the 4-byte words that changed since the last push.

Builds on the delta format of :mod:`rlpipe.backends.weights` (``delta_bucket`` /
``apply_delta``, checksums of both ends). The trainer's rank 0 keeps its last export
(:class:`DeltaSender`); every rollout replica keeps the buckets it last loaded
(:class:`DeltaReceiver`). A push carries, per bucket, either the changed words or the
whole bucket, whichever is smaller: after a dense AdamW step nearly every float32 word
changes and a delta (8-12 bytes per changed word) would be larger than the bucket, so
deltas pay off where few words change (bfloat16 weights under small updates, frozen
layers, sparse fine-tuning).

Full flush: push number ``k`` (the policy version it installs, the same number on the
trainer and on every replica) is a full push when ``(k - 1) % full_every == 0``, so
a replica that was restarted, or missed a push, is whole again at the next flush; both
ends compute it from the version and the receiver refuses a push whose kind disagrees.
A delta against another base than the receiver's copy, or whose result does not hash
to the sender's checksum, is refused before any weight is written.

Left out: index compression (run-length or bitmaps), deltas of deltas, and a receiver
that asks for a full push by itself after a refused delta (the push fails naming the
replica; the next flush, or a restart of the run, heals it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlpipe.backends.weights import (
    DeltaBucket, WeightBucket, WeightPush, WeightTransportError, apply_delta, checksum, delta_bucket,
)


def is_full_push(version: int, full_every: int) -> bool:
    """Whether the push installing ``version`` (1, 2, ...) sends every bucket whole."""
    if full_every < 1:
        raise WeightTransportError(f"full_every must be >= 1, got {full_every}")
    return (version - 1) % full_every == 0


@dataclass(frozen=True)
class DeltaPush:
    """One push as it leaves the trainer: per bucket a :class:`DeltaBucket` or a whole :class:`WeightBucket`."""

    parts: tuple[WeightBucket | DeltaBucket, ...]
    version: int
    """The policy version this push installs (decides whether it must be a full push)."""
    full: bool
    """True for a flush: every part is a whole bucket."""
    full_bytes: int
    """Bytes of the same push sent whole (for the saving metric)."""
    export_s: float
    exported_at: float

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def delta_parts(self) -> int:
        return sum(isinstance(p, DeltaBucket) for p in self.parts)


class DeltaSender:
    """The trainer side: remembers the last export and diffs the next one against it."""

    def __init__(self) -> None:
        self._base: tuple[WeightBucket, ...] | None = None

    def make(self, buckets: list[WeightBucket], version: int, full_every: int, export_s: float) -> DeltaPush:
        """The push installing ``version`` made of ``buckets`` (this export); remembers them as the next base."""
        full = is_full_push(version, full_every)
        base = self._base
        # no previous export (first push, or the trainer was resumed from a checkpoint) or another layout:
        # every bucket goes whole, which any receiver can load
        whole = full or base is None or len(base) != len(buckets)
        parts: list[WeightBucket | DeltaBucket] = []
        for i, bucket in enumerate(buckets):
            if whole or base[i].tensors != bucket.tensors:
                parts.append(bucket)
                continue
            delta = delta_bucket(base[i], bucket)
            parts.append(delta if delta.nbytes < bucket.nbytes else bucket)
        self._base = tuple(buckets)
        return DeltaPush(tuple(parts), version, full, sum(b.nbytes for b in buckets), export_s, time.time())


class DeltaReceiver:
    """The replica side: rebuilds whole buckets from a push and its copy of the last one."""

    def __init__(self) -> None:
        self._base: tuple[WeightBucket, ...] | None = None

    def rebuild(self, push: DeltaPush, full_every: int) -> tuple[WeightBucket, ...]:
        """Whole, checksum-verified buckets of ``push`` (not yet remembered: call :meth:`commit` once loaded)."""
        expected = is_full_push(push.version, full_every)
        if push.full != expected:
            raise WeightTransportError(
                f"push of version {push.version} is {'full' if push.full else 'a delta'} but full_every={full_every} "
                f"makes it {'full' if expected else 'a delta'} here: trainer and replica disagree on the flush count"
            )
        out = []
        for i, part in enumerate(push.parts):
            if isinstance(part, WeightBucket):
                if checksum(part.data) != part.checksum:
                    raise WeightTransportError(f"bucket {i} of the push of version {push.version}: checksum mismatch "
                                               "(the bytes changed in transit)")
                out.append(part)
                continue
            if self._base is None or i >= len(self._base):
                raise WeightTransportError(
                    f"bucket {i} of the push of version {push.version} is a delta but this replica holds no previous "
                    "push to apply it to (it was restarted); the next full push heals it"
                )
            try:
                out.append(apply_delta(self._base[i], part))
            except WeightTransportError as exc:
                raise WeightTransportError(f"bucket {i} of the push of version {push.version}: {exc}") from exc
        return tuple(out)

    def commit(self, buckets: tuple[WeightBucket, ...]) -> None:
        """Remember ``buckets`` (just loaded) as the base of the next delta."""
        self._base = buckets


def as_weight_push(push: DeltaPush, buckets: tuple[WeightBucket, ...]) -> WeightPush:
    """The rebuilt ``buckets`` as an ordinary push (timings of ``push`` kept)."""
    return WeightPush(buckets, export_s=push.export_s, exported_at=push.exported_at)


def changed_words(push: DeltaPush) -> int:
    """Words sent as deltas (for tests and metrics)."""
    return int(sum(len(p.indices) for p in push.parts if isinstance(p, DeltaBucket)))

