"""Multi-turn records with a real BPE tokenizer and a Qwen-style chat template (issue 23 item 3).

With merges, tokenizing a conversation's text as a whole gives other ids than the ones the engine
produced turn by turn; the session must keep the engine's ids (mask 1) and tokenize only what the
template and the client added (mask 0), including the ``\\n`` Qwen's template puts after ``<|im_end|>``,
which the model never generates.
"""

from __future__ import annotations

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
