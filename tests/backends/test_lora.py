"""rlpipe.backends.lora against the formula: y = x·W0ᵀ + b + (alpha/r)·x·Aᵀ·Bᵀ; the lean forward honours adapters;
the engine's merge is recomputed from the kept base."""

from __future__ import annotations

import pytest
import torch

from rlpipe.backends.lean_forward import lean_forward_for
from rlpipe.backends.lora import (
    LoRALinear, MergedAdapter, adapted_modules, apply_lora, base_checksum, is_adapter, linear_module_names,
    merged_parameters,
)
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import export_buckets, pack_buckets
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig
from rlpipe.schemas.lora import LoRAConfig

MODEL = ModelConfig(architecture=ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                    intermediate_size=48, max_position_embeddings=32))
IDS = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 3, 3, 4, 10, 2]])


def _model(seed: int = 0):
    return build_model(MODEL, build_tokenizer(TokenizerConfig(chars="0123456789=")), seed)


def _randomize_b(model, seed: int = 1) -> None:
    """B starts at zero (the delta is 0); tests that need a delta give B values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in adapted_modules(model).values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.1)


def test_the_output_is_the_base_plus_the_scaled_low_rank_product():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    lora = LoRALinear(base, rank=3, alpha=12.0, dropout=0.0)
    x = torch.randn(4, 6)
    assert torch.equal(lora(x), base(x))  # B = 0: the adapted layer is the base layer
    with torch.no_grad():
        lora.lora_B.normal_()
    expected = x @ (base.weight + 4.0 * lora.lora_B @ lora.lora_A).T + base.bias  # scale = alpha / rank = 4
    torch.testing.assert_close(lora(x), expected, rtol=1e-5, atol=1e-5)
    assert lora.weight is base.weight and lora.bias is base.bias  # the base's own parameters, not copies


def test_dropout_acts_only_where_gradients_flow():
    torch.manual_seed(0)
    lora = LoRALinear(torch.nn.Linear(8, 8), rank=2, alpha=2.0, dropout=0.5)
    with torch.no_grad():
        lora.lora_B.fill_(1.0)
    x = torch.randn(16, 8)
    with torch.no_grad():
        first, second = lora(x), lora(x)
    assert torch.equal(first, second)  # π_old / reference / engine passes: no dropout
    assert not torch.equal(lora(x), lora(x))  # the update's passes (grad enabled, train mode): dropout


def test_apply_lora_freezes_the_base_and_only_adapters_train():
    model = _model()
    names = apply_lora(model, LoRAConfig(rank=4, target_modules=["q_proj", "down_proj"]), seed=0)
    assert names == ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
                     "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable) and len(trainable) == 2 * len(names)
    # the adapters are drawn from the seed and leave the caller's random stream alone
    state = torch.get_rng_state()
    again = _model()
    apply_lora(again, LoRAConfig(rank=4, target_modules=["q_proj", "down_proj"]), seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_a_name_that_is_no_linear_module_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"'qkv_proj' is not a linear module of Qwen2ForCausalLM; its linear modules "
                                          r"are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        apply_lora(_model(), LoRAConfig(target_modules=["q_proj", "qkv_proj"]), seed=0)
    with pytest.raises(ConfigError, match="lm_head"):  # the LM head is never a target (tied embeddings)
        apply_lora(_model(), LoRAConfig(target_modules=["lm_head"]), seed=0)
    name, names = linear_module_names(MODEL)  # the same names from the config alone (meta device)
    assert name == "Qwen2ForCausalLM" and names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"}


def test_the_lean_forward_applies_the_adapters_as_the_models_own_forward_does():
    model = _model()
    apply_lora(model, LoRAConfig(rank=4), seed=0)
    _randomize_b(model)
    lean = lean_forward_for(model)
    assert lean is not None  # LoRA keeps the lean forward (no fallback to transformers')
    mask = torch.ones_like(IDS, dtype=torch.bool)
    positions = torch.arange(IDS.shape[1]).expand_as(IDS)
    lean_logits = lean(IDS, positions, mask)
    hf_logits = model(input_ids=IDS).logits
    torch.testing.assert_close(lean_logits, hf_logits, rtol=1e-5, atol=1e-5)
    lean_logits.square().mean().backward()
    lean_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    hf_logits.square().mean().backward()
    for name, grad in lean_grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
    # and the merged plain model computes the same function
    plain = _model()
    merged = dict(merged_parameters(model.named_parameters(), set(adapted_modules(model)), 16.0 / 4))
    plain.load_state_dict(merged, strict=False)
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    torch.testing.assert_close(plain(input_ids=IDS).logits, hf_logits, rtol=1e-4, atol=1e-5)


def test_the_engine_merges_each_push_into_the_kept_base_never_accumulating():
    cfg = LoRAConfig(rank=4, alpha=8.0)
    trainer = _model()
    apply_lora(trainer, cfg, seed=0)
    engine_model = _model()
    adapter = MergedAdapter(engine_model, cfg)
    base = {n: engine_model.get_submodule(n).weight.detach().clone() for n in adapter.names}
    for seed in (1, 2):  # two pushes: the second is merged into the base, not into the first merge
        _randomize_b(trainer, seed)
        adapter.load(pack_buckets((n, p.detach()) for n, p in trainer.named_parameters() if is_adapter(n)))
        for name, module in adapted_modules(trainer).items():
            expected = base[name] + 2.0 * module.lora_B.detach() @ module.lora_A.detach()
            torch.testing.assert_close(engine_model.get_submodule(name).weight, expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(engine_model(input_ids=IDS).logits, trainer(input_ids=IDS).logits,
                                   rtol=1e-4, atol=1e-5)
    # a push of the whole model (another layout) is refused before anything is written
    before = {n: p.clone() for n, p in engine_model.named_parameters()}
    with pytest.raises(Exception, match="is not a parameter of the engine's model"):
        adapter.load(export_buckets(_model()))
    assert all(torch.equal(before[n], p) for n, p in engine_model.named_parameters())


def test_the_base_checksum_sees_the_base_weights_and_ignores_the_adapters():
    model = _model()
    apply_lora(model, LoRAConfig(rank=2), seed=0)
    digest = base_checksum(model.state_dict().items())
    _randomize_b(model)
    assert base_checksum(model.state_dict().items()) == digest
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    assert base_checksum(model.state_dict().items()) != digest
    assert base_checksum(_model(seed=1).state_dict().items()) != base_checksum(_model().state_dict().items())
