"""HF Qwen2/Llama ⇄ megatron-core GPTModel state dicts (rlpipe.backends.megatron_convert).

Round trips are bit-exact for GQA and MHA, tied and untied, with and without QKV biases; the
fused QKV rows follow megatron's per-group [q…, k, v] order (checked on hand-labelled rows).
With megatron-core installed (the `megatron` extra; `make setup` installs 0.16.1 into .venv),
a GPTModel built on CPU (gloo world 1, local layer spec) loads the converted dict strictly.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlpipe.backends.megatron_convert import ConversionError, DecoderShape, hf_to_megatron, megatron_to_hf

ARCH = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def hf_model(kind: str, kv_heads: int, tied: bool):
    torch.manual_seed(0)
    cls, model = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    return model(cls(**ARCH, num_key_value_heads=kv_heads, tie_word_embeddings=tied))


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_is_bit_exact(kind, kv_heads, tied):
    model = hf_model(kind, kv_heads, tied)
    hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    shape = DecoderShape.from_hf(model.config)
    for fused in (False, True):
        mg = hf_to_megatron(hf, shape, fused_norms=fused)
        assert ("output_layer.weight" in mg) is not tied
        back = megatron_to_hf(mg, shape, fused_norms=fused)
        assert back.keys() == hf.keys()
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), name


def test_fused_qkv_is_grouped_per_key_value_head():
    shape = DecoderShape(num_layers=1, hidden_size=4, num_heads=4, num_kv_heads=2, head_dim=1, tied=True)
    rows = lambda *v: torch.tensor(v, dtype=torch.float32)[:, None].expand(-1, 4)  # noqa: E731
    hf = {"model.embed_tokens.weight": torch.zeros(3, 4), "model.norm.weight": torch.ones(4),
          "model.layers.0.input_layernorm.weight": torch.ones(4),
          "model.layers.0.post_attention_layernorm.weight": torch.ones(4),
          "model.layers.0.self_attn.q_proj.weight": rows(10, 11, 12, 13),
          "model.layers.0.self_attn.k_proj.weight": rows(20, 21), "model.layers.0.self_attn.v_proj.weight": rows(30, 31),
          "model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 4),
          "model.layers.0.mlp.gate_proj.weight": rows(1, 1), "model.layers.0.mlp.up_proj.weight": rows(2, 2),
          "model.layers.0.mlp.down_proj.weight": torch.zeros(4, 2)}  # fmt: skip
    mg = hf_to_megatron(hf, shape)
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 2, 2]


def test_a_missing_tensor_names_itself():
    model = hf_model("llama", 2, tied=False)
    hf = model.state_dict()
    del hf["lm_head.weight"]
    with pytest.raises(ConversionError, match="lm_head.weight"):
        hf_to_megatron(hf, DecoderShape.from_hf(model.config))


@pytest.fixture(scope="module")
def megatron_world():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("kind,kv_heads,tied", [("qwen2", 2, True), ("llama", 4, False)])
def test_converted_dict_loads_into_a_megatron_core_gpt_model(megatron_world, kind, kv_heads, tied):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    model = hf_model(kind, kv_heads, tied)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=kv_heads,
                            ffn_hidden_size=96, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=kind == "qwen2",
                            use_cpu_initialization=True, layernorm_epsilon=model.config.rms_norm_eps)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=96, max_sequence_length=64,
                   position_embedding_type="rope", share_embeddings_and_output_weights=tied)
    hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    mg = hf_to_megatron(hf, DecoderShape.from_hf(model.config))
    target = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(mg) == sorted(target)
    assert all(mg[k].shape == target[k].shape for k in target)
    result = gpt.load_state_dict(mg, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("_extra_state") for k in result.missing_keys)
    assert torch.equal(gpt.state_dict()["decoder.layers.1.self_attention.linear_qkv.weight"],
                       mg["decoder.layers.1.self_attention.linear_qkv.weight"])


@pytest.mark.parametrize("kind,kv_heads,tied", [("qwen2", 2, True), ("llama", 4, False)])
def test_the_megatron_backend_builds_its_gpt_model_from_the_hf_model(megatron_world, kind, kv_heads, tied):
    """rlpipe.backends.megatron_trainer.build_gpt (what trainer.backend megatron trains): same weights back under HF
    names bit for bit, the same rotary frequencies, and the loss settings the global denominator relies on."""
    from rlpipe.backends.megatron_trainer import build_gpt, hf_weights

    model = hf_model(kind, kv_heads, tied)
    gpt, shape, config = build_gpt(model, torch.device("cpu"))
    back = hf_weights(gpt, shape)
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    torch.testing.assert_close(gpt.rotary_pos_emb.inv_freq, model.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert config.calculate_per_token_loss and config.add_qkv_bias == (kind == "qwen2")
    assert config.num_query_groups == kv_heads and not config.masked_softmax_fusion
