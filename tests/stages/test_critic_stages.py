"""critic_values / critic_update on a tiny Qwen2 backbone with an inline (non-Ray) trainer state."""

from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.critic import CriticLossConfig, CriticModel, CriticValuesParams, critic_update, critic_values

CTX = StageContext(step=0, seed=0)
F32 = pa.list_(pa.float32())


class InlineState:
    """The slice of TrainState the critic stages use; records the summed gradient of every update."""

    def __init__(self, micro_batch_size: int, lr: float = 0.0):
        torch.manual_seed(0)
        lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=2, intermediate_size=32))  # fmt: skip
        self.model = CriticModel(lm)
        torch.nn.init.normal_(self.model.value_head.weight, std=0.1)
        self.pad_token_id, self.world_size = 0, 1
        trainer = SimpleNamespace(ppo_epochs=1, ppo_mini_batch_size=None, micro_batch_size=micro_batch_size)
        self.config = SimpleNamespace(trainer=trainer, data=SimpleNamespace(prompts_per_step=4))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.grads = []

    def all_reduce_sum(self, t):
        return t

    def all_reduce_mean_metrics(self, m):
        return m

    def optimizer_step(self):
        grads = [p.grad.reshape(-1).clone() for p in self.model.parameters() if p.grad is not None]
        self.grads.append(torch.cat(grads))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(self.grads[-1].norm()), "lr": 0.0}


def batch():
    return pa.table({
        "prompt_ids": pa.array([[1, 2], [3], [4, 5, 6], [7]], pa.list_(pa.int32())),
        "response_ids": pa.array([[8, 9, 10], [11], [12, 13], [14, 15, 1, 2]], pa.list_(pa.int32())),
        "response_mask": pa.array([[1, 1, 1], [1], [1, 0], [1, 1, 1, 1]], pa.list_(pa.int8())),
        "values": pa.array([[0.0] * 3, [0.0], [0.0] * 2, [0.0] * 4], F32),
        "returns": pa.array([[1.0] * 3, [1.0], [1.0] * 2, [1.0] * 4], F32),
    })  # fmt: skip


def test_zero_initialized_head_gives_zero_values_aligned_with_responses():
    state = InlineState(2)
    torch.nn.init.zeros_(state.model.value_head.weight)
    result = critic_values(state, batch(), CriticValuesParams(), CTX)
    assert result.columns["values"].to_pylist() == [[0.0] * 3, [0.0], [0.0] * 2, [0.0] * 4]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_critic_gradient_does_not_depend_on_micro_batching(mode):
    grads = []
    for micro in (1, 4):
        state = InlineState(micro)
        critic_update(state, batch(), CriticLossConfig(loss_agg_mode=mode), CTX)
        grads.append(state.grads[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_critic_update_moves_values_toward_returns():
    state = InlineState(2, lr=0.05)
    first = critic_update(state, batch(), CriticLossConfig(cliprange_value=10.0), CTX).metrics["critic/vf_loss"]
    for _ in range(5):
        last = critic_update(state, batch(), CriticLossConfig(cliprange_value=10.0), CTX).metrics["critic/vf_loss"]
    assert last < first


def test_critic_stage_contracts():
    values = stage_registry("critic_values").get("critic")
    update = stage_registry("critic_update").get("ppo")
    assert values.role == update.role == "critic"
    assert set(values.write_columns(CriticValuesParams())) == {"values"}
    assert {"values", "returns"} <= set(update.read_columns(CriticLossConfig()))
