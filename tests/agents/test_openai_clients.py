"""The gateway driven by real clients: the `openai` Python client and the OpenAI Agents SDK's runner with a function
tool. Each check compares the recorded session with the tokens the engine produced (a tap on the real engine
driver), so a gateway that re-tokenized, mixed sessions up or dropped a turn fails."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import defaultdict

import agents  # the OpenAI Agents SDK (dev dependency `openai-agents`)
import openai
import pytest

from agent_fixtures import TURN1, TURN2, chat_model, tok  # noqa: F401 (fixtures)
from rlpipe.agents.gateway import EngineDriver, Gateway
from rlpipe.inference.embedded import EmbeddedEngine

KEY = "run-key"


class Tap:
    """The gateway's backend: the real engine driver, with every result it returned kept per session."""

    def __init__(self, driver: EngineDriver):
        self.driver = driver
        self.results = defaultdict(list)
        self._lock = threading.Lock()

    def complete(self, session_id, request):
        result = self.driver.complete(session_id, request)
        with self._lock:
            self.results[session_id].append(result)
        return result


@pytest.fixture
def served(tok, chat_model):
    driver = EngineDriver([EmbeddedEngine(copy.deepcopy(chat_model), tok) for _ in range(2)])
    tap = Tap(driver)
    ended = []
    gw = Gateway(tap, tok, api_key=KEY, default_max_tokens=12, tool_parser="compact", on_session=ended.append)
    gw.start()
    yield gw, tap, ended
    gw.close()
    driver.close()


def assert_recorded_as_produced(session, results):
    """The session's model turns are, token for token, what the engine returned, with its logprobs and versions."""
    seg = session.current
    assert len(seg.spans) == len(results) >= 1
    for (start, end), result in zip(seg.spans, results):
        assert seg.ids[start:end] == result.response_ids.tolist()
        assert seg.logprobs[start:end] == pytest.approx(result.logprobs.tolist())
        assert seg.versions[start:end] == result.versions.tolist()
        assert seg.mask[start:end] == [1] * (end - start)
    assert sum(seg.mask) == sum(len(r.response_ids) for r in results)  # every other token is the client's: mask 0


def test_openai_client_session_auth_and_errors(tok, served):
    gw, tap, _ = served
    client = openai.OpenAI(base_url=gw.session_url("s1"), api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["rlpipe-policy"]
    messages = [{"role": "user", "content": "12*3="}]
    first = client.chat.completions.create(model="rlpipe-policy", messages=messages, temperature=0)
    assert first.choices[0].message.content == TURN1 and first.choices[0].finish_reason == "stop"  # no `tools`: text
    messages += [{"role": "assistant", "content": TURN1}, {"role": "tool", "content": "36"}]
    second = client.chat.completions.create(model="rlpipe-policy", messages=messages, temperature=0)
    assert second.choices[0].message.content == TURN2
    session = gw.end_session("s1")
    assert_recorded_as_produced(session, tap.results["s1"])
    eos = tok.eos_token_id
    assert session.current.ids == tok.encode(TURN1) + [eos] + tok.encode("\nT:36\nA:") + tok.encode(TURN2) + [eos]

    wrong = openai.OpenAI(base_url=gw.base_url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(model="rlpipe-policy", messages=messages)
    assert err.value.status_code == 401
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="rlpipe-policy", messages=[])
    assert err.value.status_code == 400 and "messages" in str(err.value)
    with pytest.raises(openai.ConflictError):  # the session has ended
        client.chat.completions.create(model="rlpipe-policy", messages=messages)


def test_openai_client_tool_calls_and_streaming(tok, served):
    gw, tap, _ = served
    client = openai.OpenAI(base_url=gw.session_url("t1"), api_key=KEY, max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    messages = [{"role": "user", "content": "12*3="}]
    reply = client.chat.completions.create(model="rlpipe-policy", messages=messages, tools=tools, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "calculator" and call.function.arguments == '{"expression": "12*3"}'
    # the client sends the call back as OpenAI objects; the gateway renders the model's raw text for it
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "36"}]
    chunks = list(client.chat.completions.create(model="rlpipe-policy", messages=messages, tools=tools,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TURN2
    assert chunks[-1].choices[0].finish_reason == "stop"
    session = gw.end_session("t1")
    assert_recorded_as_produced(session, tap.results["t1"])
    eos = tok.eos_token_id
    assert session.current.ids == tok.encode(TURN1) + [eos] + tok.encode("\nT:36\nA:") + tok.encode(TURN2) + [eos]
    assert len(session.segments) == 1  # the history matched: one trajectory, not a restart


def test_fifty_concurrent_openai_sessions_are_recorded_apart(tok, served):
    gw, tap, _ = served
    client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=KEY, max_retries=0, timeout=120)

    async def one(i):
        reply = await client.chat.completions.create(
            model="rlpipe-policy", messages=[{"role": "user", "content": f"{i}*3="}], max_tokens=6,
            extra_headers={"X-Session-Id": f"c{i}"})
        return reply.choices[0].message.content

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(50)))
        finally:
            await client.close()

    contents = asyncio.run(run_all())
    for i, content in enumerate(contents):
        session = gw.end_session(f"c{i}")
        assert tok.decode(session.current.prompt_ids) == f"\nU:{i}*3=\nA:"  # never another session's prompt
        assert_recorded_as_produced(session, tap.results[f"c{i}"])
        assert content == tok.decode(session.current.ids, skip_special_tokens=True)  # and its own reply
    assert len(tap.results) == 50


def test_idle_session_is_ended_and_handed_on(tok, chat_model):
    driver = EngineDriver([EmbeddedEngine(copy.deepcopy(chat_model), tok)])
    tap, ended = Tap(driver), []
    gw = Gateway(tap, tok, default_max_tokens=12, idle_timeout_s=0.3, on_session=ended.append).start()
    try:
        client = openai.OpenAI(base_url=gw.session_url("idle"), api_key="unused", max_retries=0, timeout=60)
        client.chat.completions.create(model="rlpipe-policy", messages=[{"role": "user", "content": "12*3="}])
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [s.id for s in ended] == ["idle"], "the idle session was not ended within 10 s"
        assert_recorded_as_produced(ended[0], tap.results["idle"])
        assert gw.sessions() == []
    finally:
        gw.close()
        driver.close()


def test_openai_agents_sdk_runner_with_a_function_tool(tok, served):
    gw, tap, _ = served
    agents.set_tracing_disabled(True)  # no trace upload: nothing leaves the machine
    calls = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        from rlpipe.agents.tools import evaluate, format_number

        return format_number(evaluate(expression))

    client = openai.AsyncOpenAI(base_url=gw.session_url("sdk"), api_key=KEY, max_retries=0, timeout=60)
    model = agents.OpenAIChatCompletionsModel(model="rlpipe-policy", openai_client=client)
    agent = agents.Agent(name="calc", tools=[calculator], model=model,
                         model_settings=agents.ModelSettings(temperature=0))

    async def run():
        try:
            return await agents.Runner.run(agent, "12*3=", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls == ["12*3"]  # the SDK ran its function tool on the gateway's tool_calls
    assert result.final_output == TURN2
    session = gw.end_session("sdk")
    assert_recorded_as_produced(session, tap.results["sdk"])
    eos = tok.eos_token_id
    assert session.current.prompt_ids == tok.encode("\nU:12*3=\nA:")
    assert session.current.ids == tok.encode(TURN1) + [eos] + tok.encode("\nT:36\nA:") + tok.encode(TURN2) + [eos]
    assert len(session.segments) == 1
