"""The OpenAI-compatible gateway over real HTTP: an OpenAI-style client loop → a recorded token-level session;
auth and error statuses; concurrent sessions; and the `gateway` agent running a program and a script."""

from __future__ import annotations

import copy
import json
import textwrap
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_fixtures import CHAT, TURN1, TURN2, chat_model, serve_gateway, tok  # noqa: F401 (fixtures)
from rlpipe.agents.chat import render
from rlpipe.agents.gateway import EngineDriver, Gateway
from rlpipe.agents.loop import build_agent
from rlpipe.agents.programs import calculator_client, chat_completion
from rlpipe.inference.contract import GenerationRequest, SamplingParams
from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.stages.generate import GenerateParams

KEY = "test-key"


@pytest.fixture
def gateway(serve_gateway):
    return serve_gateway(api_key=KEY, default_max_tokens=12)


def post(url, payload, key=KEY, raw=None):
    data = raw if raw is not None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_client_loop_records_the_session_token_by_token(tok, gateway):
    url = gateway.session_url("s1")
    calculator_client(url, KEY, "12*3=", max_turns=3)  # a plain OpenAI-style loop: call, run the tool, answer
    session = gateway.end_session("s1")
    seg = session.current
    eos = tok.eos_token_id
    assert seg.prompt_ids == tok.encode("\nU:12*3=\nA:")
    first, added, second = tok.encode(TURN1) + [eos], tok.encode("\nT:36\nA:"), tok.encode(TURN2) + [eos]
    assert seg.ids == first + added + second  # the model's ids as the engine returned them, the client's mask 0
    assert seg.mask == [1] * len(first) + [0] * len(added) + [1] * len(second)
    assert seg.spans == [(0, 7), (15, 18)]
    assert seg.versions == [0] * 18 and all(lp == 0 for lp in seg.logprobs[7:15])
    assert all(lp < 0 for lp in seg.logprobs[:7] + seg.logprobs[15:])
    assert session.turns == 2 and len(session.segments) == 1
    # the whole record is the chat template's rendering of the conversation, token for token
    convo = [{"role": "user", "content": "12*3="}, {"role": "assistant", "content": TURN1},
             {"role": "tool", "content": "36"}, {"role": "assistant", "content": TURN2}]
    assert tok.decode(seg.prompt_ids + seg.ids, skip_special_tokens=False) == render(tok, convo, False)
    status, _ = post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "1"}]})
    assert status == 409  # ended


def test_models_auth_and_malformed_requests(gateway):
    base = gateway.base_url
    with urllib.request.urlopen(urllib.request.Request(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"})) as r:
        assert json.loads(r.read())["data"][0]["id"] == "rlpipe-policy"
    ok = {"messages": [{"role": "user", "content": "12*3="}], "user": "u1"}
    assert post(f"{base}/chat/completions", ok, key="wrong")[0] == 401
    assert post(f"{base}/chat/completions", ok, key=None)[0] == 401
    status, body = post(f"{base}/chat/completions", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert post(f"{base}/chat/completions", {"messages": []})[0] == 400
    assert post(f"{base}/chat/completions", {"messages": [{"role": 1}]})[0] == 400
    assert post(f"{base}/chat/completions", {**ok, "n": 2})[0] == 400
    status, body = post(f"{base}/chat/completions", {**ok, "tools": [{"type": "function"}]})
    assert status == 400 and "`tools` must be a list" in body["error"]["message"]
    status, body = post(f"{base}/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert status == 400 and "messages[0].content" in body["error"]["message"]
    assert post(f"{base}/nope", ok)[0] == 404
    status, body = post(f"{base}/chat/completions", ok)
    assert status == 200 and body["choices"][0]["message"]["content"] == TURN1
    assert gateway.sessions() == ["u1"]  # the `user` field named the session


def test_session_cap_cuts_but_keeps_the_session(tok, chat_model):
    driver = EngineDriver([EmbeddedEngine(copy.deepcopy(chat_model), tok)])
    gw = Gateway(driver, tok, max_session_tokens=4).start()
    try:
        messages = [{"role": "user", "content": "12*3="}]
        r1 = chat_completion(gw.session_url("c"), None, messages)
        assert r1["choices"][0]["finish_reason"] == "length" and r1["usage"]["completion_tokens"] == 4
        r2 = chat_completion(gw.session_url("c"), None, messages + [
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": "1"}])
        assert r2["choices"][0]["finish_reason"] == "length" and r2["choices"][0]["message"]["content"] == ""
        session = gw.end_session("c")
        assert session.cut and session.current.mask == [1] * 4  # the user's message past the cap was cut
    finally:
        gw.close()
        driver.close()


def test_fifty_concurrent_sessions_are_recorded_apart(tok, gateway):
    def run(i):
        chat_completion(gateway.base_url, KEY, [{"role": "user", "content": f"{i}*3="}], user=f"c{i}", max_tokens=6)
        return gateway.end_session(f"c{i}")

    with ThreadPoolExecutor(50) as pool:
        sessions = list(pool.map(run, range(50)))
    for i, session in enumerate(sessions):
        seg = session.current
        assert tok.decode(seg.prompt_ids) == f"\nU:{i}*3=\nA:"  # never another session's prompt
        assert 1 <= len(seg.ids) <= 6 and seg.mask == [1] * len(seg.ids) and session.turns == 1


def test_gateway_agent_runs_programs_and_scripts_as_trajectories(tok, chat_model, tmp_path):
    params = GenerateParams(n=1, max_tokens=24, temperature=0.05, agent="gateway")
    agent = build_agent(EmbeddedEngine(copy.deepcopy(chat_model), tok), tok, params)
    request = GenerationRequest("p0/0", tok.encode("12*3="), 24, SamplingParams(temperature=0.05, seed=1))
    try:
        [r] = agent.generate([request])
    finally:
        agent.close()
    eos = tok.eos_token_id
    assert r.prompt_ids.tolist() == tok.encode("\nU:12*3=\nA:")
    assert r.response_ids.tolist() == tok.encode(TURN1) + [eos] + tok.encode("\nT:36\nA:") + tok.encode(TURN2) + [eos]
    assert r.response_mask.tolist() == [1] * 7 + [0] * 8 + [1] * 3
    assert (r.termination, r.status, r.num_turns) == ("eos", "ok", 2)

    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys, urllib.request
        prompt = sys.stdin.read()
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
        req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                     {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "Content-Type": "application/json"})
        print(json.loads(urllib.request.urlopen(req).read())["choices"][0]["message"]["content"])
        if len(sys.argv) > 1: sys.exit(3)
    """))
    params = GenerateParams(n=1, max_tokens=24, temperature=0.05, agent="gateway", gateway={"script": str(script)})
    agent = build_agent(EmbeddedEngine(copy.deepcopy(chat_model), tok), tok, params)
    try:
        [r] = agent.generate([request])
    finally:
        agent.close()
    assert r.response_ids.tolist() == tok.encode(TURN1) + [eos] and r.response_mask.tolist() == [1] * 7
    assert (r.termination, r.num_turns) == ("eos", 1)


def test_gateway_agent_turn_aborted_by_a_push_resumes_with_both_versions(tok, chat_model):
    from rlpipe.backends.weights import export_buckets

    params = GenerateParams(n=1, max_tokens=24, temperature=0.05, agent="gateway")
    agent = build_agent(EmbeddedEngine(copy.deepcopy(chat_model), tok), tok, params)
    request = GenerationRequest("p0/0", tok.encode("12*3="), 24, SamplingParams(temperature=0.05, seed=1))
    try:
        agent.submit([request])
        for _ in range(2000):  # until the program's first request is in the engine and has 3 tokens
            agent.step()
            if agent.engine.num_running():
                break
        for _ in range(3):
            agent.step()
        [partial] = agent.abort_all()  # the program's HTTP request just waits
        # mid-turn: how many tokens depends on when the program's HTTP request reached the engine (a thread)
        k = len(partial.response_ids)
        assert partial.finish_reason == "abort" and 0 < k < 7, k
        agent.load_weights(export_buckets(chat_model), version=1)
        [r] = agent.generate([partial.resume(request)])
    finally:
        agent.close()
    assert r.versions.tolist() == [0] * k + [1] * (18 - k)
    assert r.response_mask.tolist() == [1] * 7 + [0] * 8 + [1] * 3 and r.termination == "eos"


def _result(tok, ids):
    import numpy as np

    from rlpipe.inference.contract import GenerationResult

    n = len(ids)
    return GenerationResult("x", np.array(ids, np.int32), np.full(n, -1.0, np.float32), np.zeros(n, np.int32),
                            "stop" if ids[-1] == tok.eos_token_id else "length")


def test_chat_session_keeps_special_tokens_adds_the_template_tail_and_splits_on_rewritten_history(tok):
    from rlpipe.agents.chat import ChatSession

    s = ChatSession("s", tok)
    user = [{"role": "user", "content": "1+1="}]
    s.prompt_for(user)
    reply = tok.encode("2") + [tok.pad_token_id] + tok.encode("2")  # a special token inside, no <eos>: cut
    content = s.record(_result(tok, reply))
    assert content == "22"  # the client sees no special tokens...
    convo = user + [{"role": "assistant", "content": content}, {"role": "tool", "content": "ok"}]
    ids = s.prompt_for(convo).tolist()
    seg = s.current
    # ...but the record keeps them, and the <eos> the template adds after the cut reply is an addition (mask 0)
    assert seg.ids == reply + [tok.eos_token_id] + tok.encode("\nT:ok\nA:")
    assert seg.mask == [1, 1, 1] + [0] * 9 and ids == seg.prompt_ids + seg.ids
    s.prompt_for([{"role": "user", "content": "other"}])  # rewritten history: a new segment
    assert len(s.segments) == 2 and s.current.ids == []


def test_a_stop_string_ends_the_reply_and_the_record_keeps_the_tokens_that_made_it(tok):
    """OpenAI's `stop`: the client gets the text before the string, finish reason stop; the trajectory keeps the
    tokens the model produced up to the one that completed the string (token-true), the rest is dropped."""
    from rlpipe.agents.chat import ChatSession, cut_at_stop

    s = ChatSession("s", tok)
    user = [{"role": "user", "content": "1+1="}]
    s.prompt_for(user)
    reply = _result(tok, tok.encode("2+2=4"))  # one token per character
    result, content = cut_at_stop(reply, ["=4", "+2"], tok)
    assert content == "2" and result.finish_reason == "stop"  # the earliest stop string wins
    assert result.response_ids.tolist() == tok.encode("2+2") and len(result.logprobs) == len(result.versions) == 3
    assert s.record(result, content) == "2"
    s.prompt_for(user + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "1"}])
    seg = s.current
    assert seg.ids == tok.encode("2+2") + [tok.eos_token_id] + tok.encode("\nU:1\nA:")  # the client's history matched
    assert seg.mask == [1, 1, 1] + [0] * 8
    same, none = cut_at_stop(reply, ["9", "42"], tok)
    assert none is None and same is reply
