"""Pace a test by what a vLLM server is decoding right now.

The engine's calls are non-streaming: the client learns a request's tokens only when it ends, and
vLLM's Prometheus counters are published after the tokens they count. On an idle machine both let
a tiny model finish every request before a test's "abort mid-response" arrived. A streaming probe
request, sent right after the requests under test, decodes in the same scheduler batch: when it has
streamed ``k`` tokens, every request submitted before it has sampled about ``k`` tokens too.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request


class StreamingProbe:
    """A streaming ``/inference/v1/generate`` request whose token count is read while it decodes."""

    def __init__(self, server_url: str, prompt_ids: list[int], max_tokens: int):
        self.tokens = 0
        self.finished = threading.Event()
        body = {"request_id": f"probe-{time.monotonic_ns()}", "token_ids": [int(t) for t in prompt_ids],
                "stream": True,
                "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 1,
                                    "detokenize": False}}
        self._request = urllib.request.Request(server_url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                               method="POST", headers={"Content-Type": "application/json"})
        self._thread = threading.Thread(target=self._read, daemon=True, name="vllm-probe")
        self._thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self._request, timeout=120) as response:
                for line in response:
                    line = line.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    for choice in json.loads(line[5:]).get("choices", []):
                        self.tokens += len(choice.get("token_ids") or [])
        except OSError:
            pass  # an abort may cut the stream: the count so far stands
        finally:
            self.finished.set()

    def wait_for(self, tokens: int, timeout: float = 120.0) -> None:
        """Return once the probe streamed ``tokens`` tokens; fail if it ended or ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self.tokens < tokens:
            assert not self.finished.is_set(), f"the probe ended after {self.tokens} tokens (wanted {tokens})"
            assert time.monotonic() < deadline, f"the probe streamed {self.tokens} of {tokens} tokens in {timeout} s"
            time.sleep(0.005)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the probe's stream to end (an abort of every request ends it too)."""
        self._thread.join(timeout)
