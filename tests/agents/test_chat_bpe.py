"""Multi-turn records with a real BPE tokenizer and a Qwen-style chat template: the chat session, a real model
behind the gateway driven by the `openai` client over HTTP, and the tool agent.

With merges, tokenizing a conversation's text as a whole gives other ids than the ones the engine
produced turn by turn; the session must keep the engine's ids (mask 1) and tokenize only what the
template and the client added (mask 0), including the ``\\n`` Qwen's template puts after ``<|im_end|>``,
which the model never generates.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rlpipe.agents.chat import ChatSession, render
from rlpipe.inference.contract import GenerationResult

from bpe_tokenizer import IM_END, train_bpe_tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    corpus = [f"What is {a} * {b}? Use the calculator. The answer is {a * b}." for a in range(10) for b in range(10)]
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), corpus)


def engine_reply(tok, text: str) -> GenerationResult:
    """A reply as an engine may sample it: one token per character (a valid but non-canonical
    segmentation under BPE), then ``<|im_end|>``."""
    ids = [tok.convert_tokens_to_ids(piece) for ch in text for piece in tok.tokenize(ch)] + [tok.eos_token_id]
    n = len(ids)
    return GenerationResult("x", np.array(ids, np.int32), np.full(n, -0.5, np.float32), np.zeros(n, np.int32), "stop")


def test_every_turn_keeps_the_engines_ids_under_a_bpe_chat_template(bpe):
    tok = bpe
    assert tok.eos_token == IM_END
    session = ChatSession("s", tok)
    convo = [{"role": "user", "content": "What is 6 * 7? Use the calculator."}]
    prompt = session.prompt_for(convo).tolist()
    assert prompt == tok(render(tok, convo), add_special_tokens=False)["input_ids"]

    replies = [engine_reply(tok, "calculator(6 * 7)"), engine_reply(tok, "The answer is 42.")]
    content = session.record(replies[0])
    assert content == "calculator(6 * 7)"  # the client's text: no special tokens
    convo += [{"role": "assistant", "content": content}, {"role": "tool", "content": "42"}]
    ids = session.prompt_for(convo).tolist()
    content = session.record(replies[1])
    convo += [{"role": "assistant", "content": content}]

    seg = session.current
    first, second = (r.response_ids.tolist() for r in replies)
    generated = render(tok, convo[:1]) + convo[1]["content"] + IM_END  # what the engine has seen and produced
    added_text = render(tok, convo[:3])[len(generated):]
    assert added_text.startswith("\n<|im_start|>tool\n42<|im_end|>\n")  # the template's tail opens the addition
    added = tok(added_text, add_special_tokens=False)["input_ids"]
    assert seg.ids == first + added + second  # the engine's ids, untouched; only the addition tokenized
    assert seg.mask == [1] * len(first) + [0] * len(added) + [1] * len(second)
    assert ids == seg.prompt_ids + first + added
    assert seg.spans == [(0, len(first)), (len(first) + len(added), len(seg.ids))]

    # the record is the template's rendering of the conversation as text...
    whole = render(tok, convo, add_generation_prompt=False)
    assert tok.decode(seg.prompt_ids + seg.ids, skip_special_tokens=False) == whole.removesuffix("\n")
    # ...but not its re-tokenization: BPE merges the characters the engine produced one by one
    retokenized = tok(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    assert retokenized != seg.prompt_ids + seg.ids and len(retokenized) < len(seg.prompt_ids) + len(seg.ids)


# -- the same promise where it matters: a real model behind the gateway's HTTP API, and the tool agent ------------

KEY = "bpe-key"


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def one_per_char(tok, text: str) -> list[int]:
    """``text`` one token per character: a valid segmentation, but not the one BPE's merges give."""
    return [tok.convert_tokens_to_ids(piece) for ch in text for piece in tok.tokenize(ch)]


CALL, ANSWER_REPLY = "calculator [12*3]", "The answer is 36"  # words the BPE merges learned from its corpus


@pytest.fixture(scope="module")
def bpe_episode(bpe):
    """A 2-layer model taught one tool-calling chat under the BPE template, its own turns spelled one token per
    character (as an engine may sample them): "12*3=" → "calculator [12*3]", then after the tool's "36" → "The answer is 36"."""
    from agent_fixtures import teach
    from rlpipe.backends.model import build_model
    from rlpipe.schemas.config import ArchitectureConfig, ModelConfig

    tok = bpe
    user = [{"role": "user", "content": "12*3="}]
    prompt = ids_of(tok, render(tok, user))
    turn1 = one_per_char(tok, CALL) + [tok.eos_token_id]
    seen = render(tok, user) + CALL + IM_END
    tail = render(tok, user + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "36"}])
    added = ids_of(tok, tail[len(seen):])
    turn2 = one_per_char(tok, ANSWER_REPLY) + [tok.eos_token_id]
    arch = ArchitectureConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                              max_position_embeddings=128)
    model = build_model(ModelConfig(architecture=arch), tok, seed=3)
    loss = teach(model, tok, [prompt + turn1 + added + turn2], steps=200)
    assert loss < 0.05, f"the model did not memorize its chat (loss {loss})"
    return model, prompt, turn1, added, turn2


def test_an_openai_client_over_http_gets_a_record_of_the_engines_own_bpe_ids(bpe, bpe_episode):
    import openai

    from rlpipe.agents.gateway import EngineDriver, Gateway
    from rlpipe.inference.embedded import EmbeddedEngine

    tok = bpe
    model, prompt, turn1, added, turn2 = bpe_episode
    assert turn1[:-1] != ids_of(tok, CALL)  # the engine's spelling is not the canonical one
    driver = EngineDriver([EmbeddedEngine(model, tok)])
    gateway = Gateway(driver, tok, api_key=KEY, default_max_tokens=32).start()
    try:
        client = openai.OpenAI(base_url=gateway.session_url("s1"), api_key=KEY, max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "12*3="}]
        first = client.chat.completions.create(model="rlpipe-policy", messages=messages, temperature=0)
        assert first.choices[0].message.content == CALL
        messages += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "36"}]
        second = client.chat.completions.create(model="rlpipe-policy", messages=messages, temperature=0)
        assert second.choices[0].message.content == ANSWER_REPLY
        seg = gateway.end_session("s1").current
    finally:
        gateway.close()
        driver.close()
    assert seg.prompt_ids == prompt
    assert seg.ids == turn1 + added + turn2  # the engine's ids as produced; only the client's addition tokenized
    assert seg.mask == [1] * len(turn1) + [0] * len(added) + [1] * len(turn2)
    assert seg.spans == [(0, len(turn1)), (len(turn1) + len(added), len(seg.ids))]
    whole = render(tok, messages + [{"role": "assistant", "content": ANSWER_REPLY}], add_generation_prompt=False)
    assert tok.decode(seg.prompt_ids + seg.ids, skip_special_tokens=False) == whole.removesuffix("\n")
    assert ids_of(tok, whole.removesuffix("\n")) != seg.prompt_ids + seg.ids  # a re-tokenized record would differ


def test_the_tool_agent_keeps_the_engines_bpe_ids_and_tokenizes_only_observations(bpe):
    from rlpipe.agents.config import AgentLoopParams
    from rlpipe.agents.loop import Phase
    from rlpipe.agents.tool_agent import ToolEpisode, ToolSession
    from rlpipe.inference.contract import GenerationRequest, SamplingParams

    tok = bpe
    prompt = ids_of(tok, render(tok, [{"role": "user", "content": "What is 6 * 7? Use the calculator."}]))
    episode = ToolEpisode(GenerationRequest("r", prompt, 80, SamplingParams(seed=1)),
                          ToolSession(AgentLoopParams(parser="compact"), tok))
    episode.start()
    episode.take_requests()
    turn1 = engine_reply(tok, "calculator: [6*7]")
    episode.deliver(GenerationResult("r#turn0", turn1.response_ids, turn1.logprobs, turn1.versions, "stop"))
    deadline = time.monotonic() + 10
    while episode.phase is Phase.PROCESSING_TOOLS and time.monotonic() < deadline:
        episode.poll()
        time.sleep(0.005)
    [nxt] = episode.take_requests()
    observation = ids_of(tok, "=42;")
    first = turn1.response_ids.tolist()
    assert list(nxt.prompt_ids) == prompt + first + observation  # nothing of the engine's turn re-encoded
    turn2 = engine_reply(tok, "The answer is 42.")
    episode.deliver(GenerationResult(nxt.request_id, turn2.response_ids, turn2.logprobs, turn2.versions, "stop"))
    result = episode.result()
    second = turn2.response_ids.tolist()
    assert result.response_ids.tolist() == first + observation + second
    assert result.response_mask.tolist() == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    text = tok.decode(result.response_ids.tolist(), skip_special_tokens=False)
    assert text == f"calculator: [6*7]{IM_END}=42;The answer is 42.{IM_END}"
    assert ids_of(tok, text) != result.response_ids.tolist()  # re-encoding the text would merge other pieces
