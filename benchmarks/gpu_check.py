"""megatron-core vs transformers on one GPU: same weights, same batch → loss, grad norm, tokens/s.

Builds a random Qwen2 (or Llama) model with transformers, converts its weights with
``rlpipe.backends.megatron_convert.hf_to_megatron`` into a megatron-core GPTModel (local layer
spec, TP=1, PP=1, float32, no fusions), runs forward + backward on the same random batch in
both, and prints one JSON line: loss and grad norm of each (they must agree to ~1e-4 relative),
max |logit difference|, and forward+backward tokens/s of each. Needs CUDA; run by
benchmarks/gpu_check.sh, which lists the wheels it needs. Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def hf_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, model = (Qwen2Config, Qwen2ForCausalLM) if args.family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cls(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
              num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
              tie_word_embeddings=args.tied, attn_implementation="eager")
    torch.manual_seed(0)
    return model(cfg).cuda().float()


def megatron_model(hf, args):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from rlpipe.backends.megatron_convert import DecoderShape, hf_to_megatron

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    c = hf.config
    cfg = TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, ffn_hidden_size=c.intermediate_size, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=args.family == "qwen2", hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=c.vocab_size,
                   max_sequence_length=args.seq, position_embedding_type="rope",
                   rotary_base=int(getattr(c, "rope_theta", 10000)),
                   share_embeddings_and_output_weights=c.tie_word_embeddings).cuda().float()
    hf_sd = {k: v for k, v in hf.state_dict().items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = gpt.load_state_dict(hf_to_megatron(hf_sd, DecoderShape.from_hf(c)), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return gpt


def run(name, forward, model, ids, labels, repeats):
    model.zero_grad(set_to_none=True)
    logits = forward(ids)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    norm = torch.sqrt(sum(p.grad.float().square().sum() for p in model.parameters() if p.grad is not None))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        out = forward(ids)
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), labels.reshape(-1)).backward()
    torch.cuda.synchronize()
    tps = repeats * ids.numel() / (time.perf_counter() - start)
    return {f"{name}_loss": float(loss), f"{name}_grad_norm": float(norm), f"{name}_tokens_per_s": tps}, logits.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device")
    hf = hf_model(args)
    gpt = megatron_model(hf, args)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).cuda()
    ids, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    positions = torch.arange(args.seq, device="cuda").expand(args.batch, -1)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    stats, hf_logits = run("hf", lambda x: hf(input_ids=x).logits, hf, ids, labels, args.repeats)
    result.update(stats)
    stats, mg_logits = run("megatron", lambda x: gpt(x, positions, None), gpt, ids, labels, args.repeats)
    result.update(stats)
    result["max_abs_logit_diff"] = float((hf_logits - mg_logits).abs().max())
    result["loss_rel_diff"] = abs(result["hf_loss"] - result["megatron_loss"]) / abs(result["hf_loss"])
    result["grad_norm_rel_diff"] = abs(result["hf_grad_norm"] - result["megatron_grad_norm"]) / result["hf_grad_norm"]
    result["agree"] = result["loss_rel_diff"] < 1e-4 and result["grad_norm_rel_diff"] < 1e-3
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
