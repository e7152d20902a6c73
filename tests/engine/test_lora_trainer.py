"""trainer.lora in the torch trainer and the embedded engine: only adapters train and travel, the engine merges them
into its kept base, checkpoints hold adapters + the base's identity, the saved model is merged or peft's adapter."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from conftest import eval_logits
from rlpipe.backends.lora import is_adapter
from rlpipe.engine.execution.inline import LocalWorkerCalls
from rlpipe.engine.state.roles import RolloutState
from rlpipe.engine.state.train_state import TrainState
from rlpipe.errors import ConfigError
from rlpipe.inference.contract import GenerationRequest, SamplingParams
from rlpipe.schemas.config import (
    ArchitectureConfig, ModelConfig, OptimizerConfig, PipelineConfig, TokenizerConfig, TrainerConfig,
)
from rlpipe.stage import StageContext, stage_registry

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def config(seed: int = 0, lora: dict | None = None, **trainer) -> PipelineConfig:
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
    lora = {"rank": 4, "alpha": 8} if lora is None else lora
    return PipelineConfig(model=ModelConfig(architecture=arch), tokenizer=TokenizerConfig(chars="0123456789="),
                          trainer=TrainerConfig(optimizer=OptimizerConfig(lr=0.05), lora=lora, **trainer), stages=[],
                          seed=seed)


def train_one_step(trainer: TrainState) -> None:
    trainer.model(input_ids=IDS).logits.logsumexp(-1).mean().backward()
    trainer.optimizer_step()


def push(workers, step: int = 0) -> dict[str, float]:
    spec = stage_registry("weight_sync").get("object_store")
    ctx = StageContext(step=step, seed=0, workers=workers)
    return spec.fn(pa.table({"uid": ["a"]}), spec.params_model(), ctx).metrics


def adapter_bytes(trainer: TrainState) -> int:
    return sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if is_adapter(n))


@pytest.fixture
def roles():
    cfg = config()
    trainer, rollout = TrainState(cfg, 0, 1, None), RolloutState(cfg, 0, 1, None)
    return trainer, rollout, LocalWorkerCalls({"actor": [trainer], "rollout": [rollout]})


def test_only_adapters_train_and_the_optimizer_holds_only_theirs(roles):
    trainer, _, _ = roles
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    adapters = [p for n, p in trainer.model.named_parameters() if is_adapter(n)]
    assert len(held) == len(adapters) == 2 * 7 * 2 and all(any(p is a for a in adapters) for p in held)
    frozen = {n: p.clone() for n, p in trainer.model.named_parameters() if not is_adapter(n)}
    train_one_step(trainer)
    train_one_step(trainer)
    assert all(torch.equal(frozen[n], p) for n, p in trainer.model.named_parameters() if n in frozen)
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in trainer.model.named_parameters()
               if n.endswith("lora_B"))
    assert set(trainer.optimizer.state) == {p for p in held}  # AdamW moments of the adapters only


@pytest.mark.parametrize("in_process", [True, False])
def test_a_push_carries_the_adapters_and_the_engine_serves_the_trainers_function(roles, in_process):
    trainer, rollout, workers = roles
    full = sum(p.numel() * p.element_size() for p in rollout.engine.model.parameters())
    for version in (1, 2, 3):
        train_one_step(trainer)
        if in_process:  # the inline path: the trainer's adapter tensors copied straight in
            metrics = push(workers, step=version)
            assert metrics["weight_sync/version"] == float(version)
        else:  # as on Ray: checksummed buckets of the adapters
            stats = rollout.push_weights(trainer.export_for_push(), trainer.bump_version())
            metrics = {f"weight_sync/{k}": v for k, v in stats.items()}
            assert metrics["weight_sync/buckets"] == 1.0
        assert metrics["weight_sync/bytes"] == adapter_bytes(trainer) < full / 3
        assert metrics["weight_sync/full_model_bytes"] == full
        assert trainer.version == rollout.engine.version == version
        torch.testing.assert_close(eval_logits(rollout.engine.model, IDS), eval_logits(trainer.model, IDS),
                                   rtol=1e-4, atol=1e-5)
    request = GenerationRequest("r", [5, 6, 7], 4, SamplingParams(seed=1))
    assert all((r.versions == 3).all() for r in rollout.engine.generate([request]))


def test_an_engine_that_dropped_its_weights_for_training_serves_the_next_push(roles):
    """colocate_async frees the engine's weights while the trainer updates; an adapter push brings back only A and B,
    so only the merged weights may go (they are recomputed from the kept base)."""
    trainer, rollout, workers = roles
    engine = rollout.engine
    embed = engine.model.get_input_embeddings().weight
    engine.sleep(discard_weights=True)
    assert embed.numel() > 0 and engine.model.model.layers[0].self_attn.q_proj.weight.numel() == 0
    train_one_step(trainer)
    push(workers)
    torch.testing.assert_close(eval_logits(engine.model, IDS), eval_logits(trainer.model, IDS), rtol=1e-4, atol=1e-5)


def test_the_checkpoint_holds_adapters_and_the_bases_identity_and_resumes_bit_identical(tmp_path):
    trainer = TrainState(config(), 0, 1, None)
    train_one_step(trainer)
    state = trainer.state_dict()
    assert set(state["model"]) == {n for n, _ in trainer.model.named_parameters() if is_adapter(n)}
    assert state["lora_base"]["architecture"]["hidden_size"] == 32 and len(state["lora_base"]["checksum"]) == 32
    files = trainer.save_checkpoint(str(tmp_path / "actor"))
    assert sum((tmp_path / f).stat().st_size for f in files) < 4 * adapter_bytes(trainer) + 65536

    resumed = TrainState(config(), 0, 1, None)
    resumed.load_checkpoint(str(tmp_path / "actor"))
    train_one_step(trainer)
    train_one_step(resumed)
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name

    with pytest.raises(ConfigError, match=r"another base model \(checksum differ"):
        TrainState(config(seed=1), 0, 1, None).load_checkpoint(str(tmp_path / "actor"))
    with pytest.raises(ConfigError, match=r"down_proj.lora_A: checkpoint \(4, 64\), this run \(2, 64\)\); resume"):
        TrainState(config(lora={"rank": 2}), 0, 1, None).load_checkpoint(str(tmp_path / "actor"))
    full = TrainState(config().model_copy(update={"trainer": TrainerConfig()}), 0, 1, None)  # no trainer.lora
    with pytest.raises(ConfigError, match="holds LoRA adapters .* but this run trains the whole model"):
        full.load_checkpoint(str(tmp_path / "actor"))
    full.save_checkpoint(str(tmp_path / "whole"))
    with pytest.raises(ConfigError, match="holds a whole model .* but this run trains LoRA adapters"):
        TrainState(config(), 0, 1, None).load_checkpoint(str(tmp_path / "whole"))


def test_the_saved_model_is_merged_or_the_adapter_in_peft_layout(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer = TrainState(config(), 0, 1, None)
    train_one_step(trainer)
    trainer.save_hf(str(tmp_path / "merged"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(eval_logits(plain, IDS), eval_logits(trainer.model, IDS), rtol=1e-4, atol=1e-5)

    full_bytes = trainer.saved_model_bytes()  # what the disk check before a save expects
    assert 0 <= sum(f.stat().st_size for f in (tmp_path / "merged").glob("*.safetensors")) - full_bytes < 4096
    trainer.lora = trainer.lora.model_copy(update={"export": "adapter"})
    assert trainer.saved_model_bytes() == adapter_bytes(trainer)
    trainer.save_hf(str(tmp_path / "adapter"))
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    layer = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(tensors[f"{layer}.lora_B.weight"], trainer.model.model.layers[1].mlp.down_proj.lora_B.detach())
    assert len(tensors) == 2 * 7 * 2
    peft = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (peft["peft_type"], peft["r"], peft["lora_alpha"]) == ("LORA", 4, 8.0)
    base = json.loads((tmp_path / "adapter" / "rlpipe_base.json").read_text())
    assert base["checksum"] == trainer.state_dict()["lora_base"]["checksum"]


def test_a_critic_trains_its_whole_model_beside_a_lora_actor():
    from rlpipe.engine.state.roles import WORKER_ROLES

    critic = WORKER_ROLES.get("critic").build(config(), 0, 1, None)
    assert critic.lora is None and all(p.requires_grad for p in critic.model.parameters())
