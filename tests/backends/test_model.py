"""Models built from config: deterministic init, families, dtypes, save and reload."""

import pytest
import torch

from rlpipe.backends.model import build_model, save_hf_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig


def tiny(family="qwen2", **overrides) -> ModelConfig:
    sizes = dict(family=family, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    sizes.update(overrides)
    return ModelConfig(architecture=ArchitectureConfig(**sizes))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TokenizerConfig(chars="abc 0123456789"))


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_init_is_a_function_of_the_seed(tok, family):
    rng_before = torch.random.get_rng_state()
    a, b, c = (build_model(tiny(family), tok, seed) for seed in (1, 1, 2))
    assert same(a, b) and not same(a, c)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG stream is untouched
    assert a.config.vocab_size == len(tok)
    assert (a.config.pad_token_id, a.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert type(a).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[family]


def test_dtype_and_save_reload_round_trip(tok, tmp_path):
    model = build_model(tiny(), tok, 0)
    save_hf_model(model, tok, tmp_path / "hf")
    again = build_model(ModelConfig(path=str(tmp_path / "hf"), dtype="bfloat16"), tok, seed=123)
    assert again.dtype == torch.bfloat16
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), name
    ids = torch.tensor([tok.encode("ab 12")])
    exact = build_model(ModelConfig(path=str(tmp_path / "hf")), tok, seed=0).eval()
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, exact(ids).logits)


def test_bad_sizes_and_paths_say_what_to_do(tok, tmp_path):
    with pytest.raises(ConfigError, match="not divisible by num_heads"):
        build_model(tiny(hidden_size=30, num_heads=4), tok, 0)
    with pytest.raises(ConfigError, match="not a multiple of num_kv_heads"):
        build_model(tiny(num_heads=4, num_kv_heads=3), tok, 0)
    with pytest.raises(ConfigError, match="not a directory"):
        build_model(ModelConfig(path=str(tmp_path / "missing")), tok, 0)


def test_a_model_smaller_than_the_tokenizer_is_refused(tok, tmp_path):
    small = build_model(tiny(), build_tokenizer(TokenizerConfig(chars="ab")), 0)
    save_hf_model(small, tok, tmp_path)
    with pytest.raises(ConfigError, match="tokenizer has"):
        build_model(ModelConfig(path=str(tmp_path)), tok, 0)
