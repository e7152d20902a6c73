"""``tool_agent``: the multi-turn tool-calling agent (verl's ToolAgentLoop, seed 5.2).

Each model turn ends at end-of-sequence; its text (special tokens skipped) is
parsed for tool calls (:mod:`rlpipe.agents.parsers`). No call: the episode ends
(``eos``). Calls: they run concurrently on a thread pool (up to
``max_calls_per_turn``), and their outputs, formatted by the parser, are
tokenized *alone* (no special tokens added), truncated to
``max_observation_tokens`` on the configured side and appended with mask 0; the
next turn then continues from the whole token sequence. The response budget
(``max_tokens``) caps model and observation tokens together; an observation
that does not fit is cut to the budget and the episode ends (``max_length``).

A failed call (unknown tool, malformed call, the tool's own error, a timeout)
is an error observation, or with ``on_tool_error: terminate`` ends the episode
(``tool_error``). A tool raising :class:`~rlpipe.agents.tools.ToolInfraError`,
or any unexpected exception, ends it with ``tool_error`` and status ``failed``.

Left out: tools that keep state across calls of one episode, and stop strings
(a turn ends only at end-of-sequence or the budget).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from rlpipe.agents.config import AgentLoopParams
from rlpipe.agents.loop import AGENTS, AgentEngine, Episode, Phase
from rlpipe.agents.parsers import ParsedCall, build_parser
from rlpipe.agents.tools import Tool, ToolOutput, build_tool
from rlpipe.inference.contract import GenerationRequest, GenerationResult, RolloutEngine
from rlpipe.schemas.batch import STATUS_FAILED

log = logging.getLogger(__name__)


class ToolSession:
    """What every episode of one tool agent shares: settings, tokenizer, parser, tools and the thread pool."""

    def __init__(self, params: AgentLoopParams, tokenizer: Any, notify=lambda: None):
        self.params = params
        self.tokenizer = tokenizer
        self.parser = build_parser(params.parser, params.tools[0])
        self.tools: dict[str, Tool] = {name: build_tool(name, params.tool_settings.get(name)) for name in params.tools}
        self.pool = ThreadPoolExecutor(params.tool_workers, thread_name_prefix="rlpipe-tool")
        self.notify = notify
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> tuple[int, ...]:
        """With ``stop_at_call``: the token of the parser's closing character, if it is one token."""
        stop = getattr(self.parser, "STOP", None)
        if not self.params.stop_at_call or stop is None:
            return ()
        ids = self.tokenizer.encode(stop, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"agent_loop.stop_at_call: the call's closing {stop!r} is {len(ids)} tokens for this "
                             "tokenizer, not one; add it to the tokenizer's characters or set stop_at_call: false")
        return tuple(ids)

    def run_call(self, parsed: ParsedCall) -> ToolOutput:
        if parsed.call is None:
            return ToolOutput(parsed.error or "error: malformed tool call", ok=False)
        tool = self.tools.get(parsed.call.name)
        if tool is None:
            return ToolOutput(f"error: unknown tool {parsed.call.name!r}; tools: {', '.join(sorted(self.tools))}",
                              ok=False)
        return tool.run(parsed.call.arguments)

    def observation_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        cap = self.params.max_observation_tokens
        if len(ids) > cap:
            ids = ids[:cap] if self.params.observation_truncation == "right" else ids[-cap:]
        return ids

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ToolEpisode(Episode):
    """One tool-agent trajectory (phases in :mod:`rlpipe.agents.loop`)."""

    def __init__(self, request: GenerationRequest, session: ToolSession):
        super().__init__(request)
        self.session = session
        self.calls: list[Future] = []
        self.deadline = 0.0
        self.tool_calls = 0
        self.tool_errors = 0
        self.prompt_text: str | None = None

    def start(self) -> None:
        self.enter(Phase.GENERATING)
        self.send(self._turn_request())

    def _prompt_text(self) -> str:
        """The prompt as text, for parsers that read it (``trigger``); decoded once, never put back into tokens."""
        if self.prompt_text is None:
            self.prompt_text = self.session.tokenizer.decode(list(self.request.prompt_ids), skip_special_tokens=True)
        return self.prompt_text

    def _turn_request(self) -> GenerationRequest:
        """The engine request of the next model turn: the prompt followed by the response so far, token for token."""
        r = self.request
        if self.session.stop_ids:
            r = dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, stop_token_ids=self.session.stop_ids))
        if not self.ids:  # first turn: the request itself (a resumed request keeps its partial response)
            return dataclasses.replace(r, request_id=f"{r.request_id}#turn0")
        prompt = np.concatenate([np.asarray(r.prompt_ids, np.int32), np.asarray(self.ids, np.int32)])
        return dataclasses.replace(r, request_id=f"{r.request_id}#turn{self.turns}", prompt_ids=prompt,
                                   max_tokens=self.budget(), response_ids=(), logprobs=(), versions=(), ready_at=0.0)

    def on_generation(self, result: GenerationResult) -> None:
        self.add_model_tokens(result)
        if result.finish_reason == "length" or self.budget() <= 0:
            return self.terminate("max_length")
        text = self.session.tokenizer.decode(result.response_ids.tolist(), skip_special_tokens=True)
        parsed = self.session.parser.parse(text, self._prompt_text())
        if not parsed:
            return self.terminate("eos")
        if self.turns >= self.session.params.max_turns:
            return self.terminate("max_turns")
        self.enter(Phase.PROCESSING_TOOLS)
        cap = self.session.params.max_calls_per_turn
        over = ParsedCall(None, f"error: at most {cap} tool calls per turn")
        self.calls = [self.session.pool.submit(self.session.run_call, p if i < cap else over)
                      for i, p in enumerate(parsed)]
        for call in self.calls:
            call.add_done_callback(lambda _: self.session.notify())
        self.deadline = time.monotonic() + self.session.params.tool_timeout_s
        self.tool_calls += len(parsed)

    def poll(self) -> None:
        if self.phase is not Phase.PROCESSING_TOOLS:
            return
        timed_out = time.monotonic() > self.deadline
        if not timed_out and not all(c.done() for c in self.calls):
            return
        outputs = []
        for call in self.calls:
            if not call.done():
                outputs.append(ToolOutput(f"error: the tool did not answer within "
                                          f"{self.session.params.tool_timeout_s:g} s", ok=False))
            elif call.exception() is not None:  # infrastructure: the trajectory cannot be trusted
                log.warning("tool infrastructure failure in %s: %r", self.request.request_id, call.exception())
                self.calls = []
                return self.terminate("tool_error", STATUS_FAILED)
            else:
                outputs.append(call.result())
        self.calls = []
        self.tool_errors += sum(not o.ok for o in outputs)
        if self.session.params.on_tool_error == "terminate" and not all(o.ok for o in outputs):
            return self.terminate("tool_error")
        ids = self.session.observation_ids(self.session.parser.observation(outputs))
        if len(ids) >= self.budget():
            self.add_observation(ids[: self.budget()])
            return self.terminate("max_length")
        self.add_observation(ids)
        self.enter(Phase.GENERATING)
        self.send(self._turn_request())


def _tool_agent(engine: RolloutEngine, tokenizer: Any, params: Any) -> RolloutEngine:
    session = ToolSession(params.agent_loop, tokenizer)
    agent = AgentEngine(engine, lambda request: ToolEpisode(request, session), on_close=session.close)
    session.notify = agent.notify
    return agent


AGENTS.add("tool_agent", _tool_agent)
