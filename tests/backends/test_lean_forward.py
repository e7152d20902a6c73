"""The lean forward of the Qwen2 / Llama family equals transformers' forward, cached and not, and says when it
cannot run a model."""

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlpipe.backends.lean_forward import LeanForward, lean_forward_for, lean_unsupported
from rlpipe.inference.embedded import EmbeddedEngine, GenerationRequest, SamplingParams

SIZES = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
             max_position_embeddings=64)


def qwen2(kv_heads=2, **extra):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SIZES, num_key_value_heads=kv_heads, **extra)).eval()


def llama(kv_heads=4):
    torch.manual_seed(1)  # with every bias on: the lean forward takes each module's bias as it is
    return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=kv_heads, attention_bias=True,
                                        mlp_bias=True, tie_word_embeddings=False)).eval()


def left_padded(lengths, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (len(lengths), width), generator=gen)
    mask = torch.arange(width)[None, :] >= (width - torch.tensor(lengths))[:, None]
    return ids, mask, (mask.long().cumsum(1) - 1).clamp(min=0)


@pytest.mark.parametrize("make", [qwen2, llama, lambda: qwen2(kv_heads=1)], ids=["qwen2-gqa", "llama-bias-mha", "mqa"])
@torch.no_grad()
def test_prefill_and_decode_equal_transformers_with_a_kv_cache(make):
    model = make()
    lean = LeanForward(model)
    ids, mask, positions = left_padded([6, 2, 4, 1, 6], 6)
    new = 4
    key_mask = torch.cat([mask, torch.ones(5, new, dtype=torch.bool)], dim=1)
    hf_cache = DynamicCache(config=model.config)
    hf = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, cache=hf_cache, use_cache=True).logits
    cache = lean.static_cache(5, 6 + new)
    out = lean(ids, positions, key_mask, cache)
    torch.testing.assert_close(out[mask], hf[mask], rtol=0, atol=1e-5)  # real positions (padding is never read)
    hf_mask, token, position = mask.long(), hf[:, -1].argmax(-1), positions[:, -1]
    for _ in range(new):
        position = position + 1
        hf_mask = torch.cat([hf_mask, torch.ones(5, 1, dtype=torch.long)], dim=1)
        hf = model(input_ids=token[:, None], attention_mask=hf_mask, position_ids=position[:, None], cache=hf_cache,
                   use_cache=True).logits[:, -1]
        out = lean(token[:, None], position[:, None], key_mask, cache)[:, -1]
        torch.testing.assert_close(out, hf, rtol=0, atol=1e-5)
        token = hf.argmax(-1)
    assert cache.length == 6 + new
    with pytest.raises(ValueError, match="holds 10 positions; 11 asked for"):
        lean(token[:, None], position[:, None] + 1, key_mask, cache)


@torch.no_grad()
def test_a_cache_of_distinct_prompts_serves_their_repeated_rows():
    model = qwen2()
    lean = LeanForward(model)
    ids, mask, positions = left_padded([5, 3], 5)
    rows = torch.tensor([0, 0, 1, 1, 1])
    key_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
    cache = lean.static_cache(2, 6)
    lean(ids, positions, key_mask, cache)
    cache.batch_select_indices(rows)
    token = torch.tensor([7, 8, 9, 10, 11])
    shared = lean(token[:, None], positions[rows, -1:] + 1, key_mask[rows], lean_cache := cache)[:, -1]
    assert lean_cache.k.shape[1] == 5
    full_ids = torch.cat([ids[rows], token[:, None]], dim=1)
    full_mask = torch.cat([mask[rows], torch.ones(5, 1, dtype=torch.bool)], dim=1)
    plain = model(input_ids=full_ids, attention_mask=full_mask.long(),
                  position_ids=(full_mask.long().cumsum(1) - 1).clamp(min=0)).logits[:, -1]
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def test_gradients_through_a_growing_cache_equal_the_plain_forward():
    model = qwen2().train()
    lean = LeanForward(model)
    prompt, prompt_mask, prompt_positions = left_padded([4, 2], 4)
    rows = torch.tensor([0, 1, 1])
    response = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    full_mask = torch.cat([prompt_mask[rows], torch.ones(3, 3, dtype=torch.bool)], dim=1)
    full_positions = (full_mask.long().cumsum(1) - 1).clamp(min=0)

    def grads(logits_of):
        model.zero_grad()
        logits_of().logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    def lean_logits():
        cache = lean.growing_cache()
        lean(prompt, prompt_positions, prompt_mask, cache)
        cache.batch_select_indices(rows)
        return lean(response, full_positions[:, 4:], full_mask, cache)

    def hf_logits():
        return model(input_ids=torch.cat([prompt[rows], response], dim=1), attention_mask=full_mask.long(),
                     position_ids=full_positions).logits[:, 4:]

    torch.testing.assert_close(lean_logits(), hf_logits(), rtol=0, atol=1e-5)
    for a, b in zip(grads(lean_logits), grads(hf_logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_models_it_cannot_run_are_named_with_the_reason():
    assert lean_unsupported(qwen2()) is None
    sliding = qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding-window" in lean_unsupported(sliding)
    assert "GPT2LMHeadModel is not one of" in lean_unsupported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    dynamic = qwen2(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "rope_type 'dynamic'" in lean_unsupported(dynamic)
    wrapped = qwen2()
    wrapped.model.layers[1].mlp.up_proj = torch.nn.Sequential(wrapped.model.layers[1].mlp.up_proj)
    assert "not a plain Linear" in lean_unsupported(wrapped)
    with pytest.raises(ValueError, match="cannot run this model: sliding-window"):
        LeanForward(sliding)


def test_the_lean_forward_is_built_once_and_not_under_activation_checkpointing():
    model = qwen2()
    assert lean_forward_for(model) is lean_forward_for(model) is not None
    model.activation_checkpointing_enable()
    assert lean_forward_for(model) is None  # it would keep every activation the user asked to recompute
    model.activation_checkpointing_disable()
    assert lean_forward_for(qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)) is None


def test_the_engine_samples_the_same_tokens_with_either_forward():
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.schemas.config import TokenizerConfig

    tokenizer = build_tokenizer(TokenizerConfig(chars="abcdefgh 0123456789+="))
    model = Qwen2ForCausalLM(Qwen2Config(**{**SIZES, "vocab_size": len(tokenizer)}, num_key_value_heads=2,
                                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    prompts = ["1+2=", "abc de", "9", "h 77 + 1 ="]
    requests = [GenerationRequest(f"r{i}", tokenizer.encode(prompts[i % 4]), 12, SamplingParams(seed=3))
                for i in range(16)]
    lean = EmbeddedEngine(model, tokenizer)
    plain = EmbeddedEngine(model, tokenizer, lean=False)
    assert type(lean.forward).__name__ == "_LeanForward" and type(plain.forward).__name__ == "_HFForward"
    by_lean = {r.request_id: r for r in lean.generate(requests)}
    by_plain = {r.request_id: r for r in plain.generate(requests)}
    for rid, result in by_plain.items():
        assert by_lean[rid].response_ids.tolist() == result.response_ids.tolist()
        torch.testing.assert_close(torch.from_numpy(by_lean[rid].logprobs), torch.from_numpy(result.logprobs),
                                   rtol=0, atol=1e-5)
