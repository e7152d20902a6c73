"""Fixtures of the agent tests: a tiny char tokenizer, a real torch model taught one tool-calling episode, and
gateways serving it over loopback HTTP."""

from __future__ import annotations

import copy

import pytest
import torch

from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig

CHARS = "0123456789+-*=[]:abcdefghijklmnopqrstuvwxyz ().;\nUATS"
PROMPT = "12*3="
TURN1 = "[12*3]"  # compact call of the calculator, then <eos>
OBSERVATION = "=36;"  # what the compact parser makes of the calculator's "36"
TURN2 = "36"  # then <eos>


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer(TokenizerConfig(chars=CHARS))


def teach(model, tok, texts, steps=150, lr=1e-2):
    """Fit ``model`` to the token sequences of ``texts`` (lists of str / int pieces) by teacher forcing."""
    seqs = [sum(([p] if isinstance(p, int) else tok.encode(p) for p in text), []) for text in texts]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    mask = ids != tok.pad_token_id
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


@pytest.fixture(scope="session")
def scripted_model(tok):
    """A 2-layer model that, given "12*3=", calls the calculator ("[12*3]"), then answers "36" after "=36;"."""
    arch = ArchitectureConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                              max_position_embeddings=64)
    model = build_model(ModelConfig(architecture=arch), tok, seed=0)
    eos = tok.eos_token_id
    loss = teach(model, tok, [[PROMPT, TURN1, eos, OBSERVATION, TURN2, eos]])
    assert loss < 0.05, f"the scripted model did not memorize its episode (loss {loss})"
    return model


CHAT = ["\nU:12*3=\nA:", TURN1, "eos", "\nT:36\nA:", TURN2, "eos"]
"""The scripted episode through the default chat template: the client runs the calculator and sends "36"."""


@pytest.fixture(scope="session")
def chat_model(tok):
    """A 2-layer model that plays :data:`CHAT`'s assistant turns."""
    arch = ArchitectureConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                              max_position_embeddings=64)
    model = build_model(ModelConfig(architecture=arch), tok, seed=1)
    loss = teach(model, tok, [[tok.eos_token_id if p == "eos" else p for p in CHAT]])
    assert loss < 0.05, f"the chat model did not memorize its episode (loss {loss})"
    return model


@pytest.fixture
def serve_gateway(tok, chat_model):
    """``make(**gateway_kwargs)``: a started gateway over ``replicas`` (default 2) embedded engines playing
    :func:`chat_model`, on loopback; every gateway made is closed at teardown."""
    from rlpipe.agents.gateway import EngineDriver, Gateway
    from rlpipe.inference.embedded import EmbeddedEngine

    made = []

    def make(replicas: int = 2, **kwargs):
        driver = EngineDriver([EmbeddedEngine(copy.deepcopy(chat_model), tok) for _ in range(replicas)])
        made.append(driver)
        gateway = Gateway(driver, tok, **kwargs).start()
        made.append(gateway)
        return gateway

    yield make
    for thing in reversed(made):
        thing.close()
