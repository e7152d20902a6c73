"""Worker calls awaited later: what lets the trainer go on while the rollout replicas load weights."""

from __future__ import annotations

import threading
from typing import Any

from rlpipe.errors import RlpipeError


class DeferredCalls:
    """Mixin of the workers facades (Ray and in-process): ``defer`` futures now, ``settle`` them later.

    The facade provides ``resolve(futures)``. Thread-safe: a mode's helper thread
    may settle while the driver's main thread defers the next push.
    """

    in_process = False
    """Every worker state lives in the caller's process (the inline backend): a weight push may hand the trainer's
    tensors over instead of buckets (weight_sync)."""

    def __init__(self) -> None:
        self._deferred: list[tuple[list[Any], str]] = []
        self._deferred_lock = threading.Lock()

    def defer(self, futures: list[Any], failure: str) -> None:
        """Keep ``call_async`` results to be awaited by ``settle``; ``failure`` prefixes their error."""
        with self._deferred_lock:
            self._deferred.append((list(futures), failure))

    def settle(self) -> list[Any]:
        """Wait for everything deferred so far; returns the results (flattened), raises the first failure."""
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, []
        results: list[Any] = []
        for futures, failure in deferred:
            try:
                results.extend(self.resolve(futures))
            except Exception as exc:
                # our own errors already say what failed (e.g. a dead worker, named): one message, no chain
                raise RlpipeError(f"{failure}: {exc}") from (None if isinstance(exc, RlpipeError) else exc)
        return results

    def resolve(self, futures: list[Any]) -> list[Any]:
        raise NotImplementedError
