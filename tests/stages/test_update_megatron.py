"""trainer.backend megatron (rlpipe.backends.megatron_trainer, rlpipe.engine.state.megatron_state).

On CPU: the left-packing that feeds megatron's GPTModel (its RoPE ignores position_ids) gives the
same logits as rlpipe's left-padded layout, checked with a transformers model; the plan check
refuses the backend without CUDA, with checkpoints or with a critic.

With CUDA and megatron-core (benchmarks/gpu_check.sh runs this file): the megatron trainer and the
torch trainer (replicated), built from the same HF weights, give the same π_old logprobs (forward-only
schedule), the same PPO loss and grad norm on the same batch over several micro-batches (the loss
injected into megatron's schedule with the global denominator), and the same weights after the
distributed optimizer's step, exported under HF names. float32, to 1e-4.
On a CPU torch megatron-core 0.16.1 cannot run these: model_parallel_cuda_manual_seed, RoPE
(rotary_pos_embedding.py: inv_freq.to(torch.cuda.current_device())), the no-pipelining schedule
(schedules.py: torch.zeros(..., device="cuda")) and DDP's grad buffers all need CUDA.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from test_update import batch, config, run_update

from rlpipe.backends.megatron_trainer import packed_logits
from rlpipe.engine.state.trainer_backends import TRAINER_BACKENDS
from rlpipe.errors import ConfigError
from rlpipe.jagged import SequenceInputs
from rlpipe.schemas.config import StageConfig
from rlpipe.stages.logprobs import score_batch

PROMPTS = [[5, 6], [7, 8, 9, 10, 11], [12], [4, 4, 5, 6]]
RESPONSES = [[6, 7, 8, 9], [4], [10, 14, 5], []]


def test_left_packed_rows_give_the_logits_of_the_left_padded_layout():
    from rlpipe.engine.state.train_state import TrainState

    model = TrainState(config(), 0, 1, None).model.eval()
    seq = SequenceInputs(pa.array(PROMPTS, pa.list_(pa.int32())), pa.array(RESPONSES, pa.list_(pa.int32())), 0)
    with torch.no_grad():
        reference = model(input_ids=seq.input_ids, attention_mask=seq.attention_mask,
                          position_ids=seq.position_ids).logits  # the left-padded layout, every position
        # positions 0..S-1 and a causal mask only, as megatron's GPTModel sees the rows
        packed = packed_logits(lambda ids, pos, mask: model(input_ids=ids, position_ids=pos).logits, seq)
    real = seq.attention_mask.bool()
    torch.testing.assert_close(packed[real], reference[real], rtol=0, atol=1e-5)
    assert not torch.equal(packed[:, :2], torch.zeros_like(packed[:, :2]))  # the rows were really moved


def test_the_plan_check_refuses_megatron_without_cuda_checkpoints_or_with_a_critic():
    backend = TRAINER_BACKENDS.get("megatron")
    with pytest.raises(ConfigError, match="needs CUDA"):
        backend.check(config())
    cuda = config(device="cuda")
    cuda.trainer.checkpoint_every = 2
    with pytest.raises(ConfigError, match="checkpoint_every: 0"):
        backend.check(cuda)
    cuda.trainer.checkpoint_every = 0
    backend.check(cuda)  # CUDA, no checkpoints, no critic: accepted
    cuda.stages = [StageConfig(kind="critic_values", impl="critic")]
    with pytest.raises(ConfigError, match="critic_values stages"):
        backend.check(cuda)


@pytest.fixture(scope="module")
def pair():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from rlpipe.engine.state.megatron_state import MegatronTrainState
    from rlpipe.engine.state.train_state import TrainState

    torch_state = TrainState(config(micro=3, clip=1.0, device="cuda"), 0, 1, None)
    cfg = config(micro=3, clip=1.0, device="cuda")
    cfg.trainer.backend = "megatron"
    return torch_state, MegatronTrainState(cfg, 0, 1, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (megatron-core's forward, schedule "
                    "and DDP allocate on cuda; CPU torch here)")
def test_megatron_equals_the_torch_trainer_on_the_same_batch(pair):
    from rlpipe.engine.state.train_state import TrainState

    torch_state, mg_state = pair
    converted = dict(mg_state.model.named_hf_parameters())
    for name, p in torch_state.model.named_parameters():  # the HF weights survive the round trip through megatron
        assert torch.equal(converted[name], p.detach()), name
    table = batch(TrainState(config(micro=3, clip=1.0), 0, 1, None).model)  # same seed: the same weights, on CPU
    old_torch = score_batch(torch_state.model, table, 0, 1.0, 3)
    old_mg = score_batch(mg_state.model, table, 0, 1.0, 3, forward_passes=mg_state.forward_passes)
    for a, b in zip(old_torch.to_pylist(), old_mg.to_pylist()):
        assert a == pytest.approx(b, abs=1e-4)
    m_torch, m_mg = run_update(torch_state, table), run_update(mg_state, table)  # 3 micro-batches of <= 3 rows
    assert m_mg["actor/pg_loss"] == pytest.approx(m_torch["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert m_mg["actor/grad_norm"] == pytest.approx(m_torch["actor/grad_norm"], rel=1e-4)
    after = dict(mg_state.model.named_hf_parameters())
    for name, p in torch_state.model.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), rtol=0, atol=1e-4)
    buckets = mg_state.export_weights()
    assert {m.name for b in buckets for m in b.tensors} == {n for n, _ in torch_state.model.named_parameters()}
