"""old_log_prob/trainer, old_log_prob/bypass and ref/reference against a direct per-row forward.

The reference value of every token is computed here without padding: each row's
prompt + response runs alone through the model, and the log-softmax of the
logits that predict response token j (position P - 1 + j) is gathered at that
token. The stages pad, micro-batch and slice; their results must not move.
"""

import pyarrow as pa
import pytest
import torch

from rlpipe.engine.stage_call import run_stage
from rlpipe.engine.state.train_state import TrainState
from rlpipe.engine.state.roles import ReferenceState
from rlpipe.errors import BatchError, StageError
from rlpipe.schemas.config import (
    ArchitectureConfig, ModelConfig, PipelineConfig, ResourcesConfig, TokenizerConfig, TrainerConfig,
)
from rlpipe.stage import StageContext, stage_registry

I32, I8, F32 = pa.list_(pa.int32()), pa.list_(pa.int8()), pa.list_(pa.float32())
PROMPTS = [[5, 6], [7, 8, 9, 10, 11], [12, 13, 4]]
RESPONSES = [[6, 7, 8, 9], [4], [10, 14, 5]]
MASKS = [[1, 1, 1, 0], [1], [1, 0, 1]]


def config(micro_batch_size: int = 64, device: str = "cpu") -> PipelineConfig:
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
    return PipelineConfig(model=ModelConfig(architecture=arch), tokenizer=TokenizerConfig(chars="0123456789="),
                          trainer=TrainerConfig(micro_batch_size=micro_batch_size),
                          resources=ResourcesConfig(device=device), stages=[])


def batch(**extra) -> pa.Table:
    return pa.table({"prompt_ids": pa.array(PROMPTS, I32), "response_ids": pa.array(RESPONSES, I32),
                     "response_mask": pa.array(MASKS, I8), **extra})


def ctx(temperature: float | None = None) -> StageContext:
    return StageContext(step=3, seed=0, extras={} if temperature is None else {"temperature": temperature})


@torch.no_grad()
def per_row_logprobs(model: torch.nn.Module, temperature: float = 1.0) -> list[list[float]]:
    """log_softmax(logits / T)[token] of every response token, one unpadded row at a time."""
    was_training = model.training
    model.eval()
    out = []
    device = next(model.parameters()).device
    for prompt, response in zip(PROMPTS, RESPONSES):
        ids = torch.tensor([prompt + response], device=device)
        logits = model(input_ids=ids).logits[0].double().cpu()
        p = len(prompt)
        logp = torch.log_softmax(logits[p - 1 : p - 1 + len(response)] / temperature, dim=-1)
        out.append(logp[torch.arange(len(response)), torch.tensor(response)].tolist())
    model.train(was_training)
    return out


def assert_rows_close(actual: pa.Array, expected: list[list[float]], atol: float = 1e-5) -> None:
    rows = actual.to_pylist()
    assert [len(r) for r in rows] == [len(r) for r in RESPONSES]
    for got, want in zip(rows, expected):
        got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def state() -> TrainState:
    return TrainState(config(), 0, 1, None)


def trainer_stage(state, table, micro=None, temperature=None):
    spec = stage_registry("old_log_prob").get("trainer")
    return spec.fn(state, table, spec.params_model(micro_batch_size=micro), ctx(temperature))


def test_trainer_logprobs_equal_a_per_row_forward(state):
    table = batch()
    result = trainer_stage(state, table)
    assert set(result.columns) == {"old_logprobs"}
    assert result.columns["old_logprobs"].type == F32
    assert_rows_close(result.columns["old_logprobs"], per_row_logprobs(state.model))
    assert table.column_names == ["prompt_ids", "response_ids", "response_mask"]  # input untouched
    assert state.model.training  # scoring switched to eval and back


def test_temperature_from_the_context_divides_the_logits(state):
    hot = trainer_stage(state, batch(), temperature=0.5).columns["old_logprobs"]
    assert_rows_close(hot, per_row_logprobs(state.model, temperature=0.5))
    plain = per_row_logprobs(state.model)
    diff = max(abs(a - b) for row_a, row_b in zip(hot.to_pylist(), plain) for a, b in zip(row_a, row_b))
    assert diff > 1e-3  # the temperature really changed the values


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_micro_batch_size_does_not_change_the_values(state, micro):
    whole = trainer_stage(state, batch(), micro=3).columns["old_logprobs"].to_pylist()
    split = trainer_stage(state, batch(), micro=micro).columns["old_logprobs"].to_pylist()
    for a, b in zip(whole, split):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


def test_mixed_precision_scores_in_bfloat16_into_a_float32_column():
    mixed_config = config()
    mixed_config.trainer.mixed_precision = "bf16"
    mixed = TrainState(mixed_config, 0, 1, None)
    result = trainer_stage(mixed, batch()).columns["old_logprobs"]
    assert result.type == F32
    exact = per_row_logprobs(mixed.model)
    assert_rows_close(result, exact, atol=5e-2)  # bf16 rounding of the activations
    worst = max(abs(a - b) for row_a, row_b in zip(result.to_pylist(), exact) for a, b in zip(row_a, row_b))
    assert worst > 1e-5  # not the float32 forward


def test_micro_batch_size_defaults_to_the_trainers():
    state = TrainState(config(micro_batch_size=1), 0, 1, None)
    result = trainer_stage(state, batch())  # params.micro_batch_size=None → trainer.micro_batch_size=1
    assert_rows_close(result.columns["old_logprobs"], per_row_logprobs(state.model))


def test_bypass_copies_the_rollout_logprobs():
    rollout = pa.array([[-0.5, -1.25, -2.0, -0.125], [-3.5], [-0.75, -1.5, -0.25]], F32)
    spec = stage_registry("old_log_prob").get("bypass")
    result = spec.fn(batch(rollout_logprobs=rollout), spec.params_model(), ctx())
    assert set(result.columns) == {"old_logprobs"}
    assert result.columns["old_logprobs"].type == F32
    assert result.columns["old_logprobs"].to_pylist() == rollout.to_pylist()


def test_bypass_without_the_column_says_how_to_get_it():
    spec = stage_registry("old_log_prob").get("bypass")
    expected = (r"bypass mode and rollout correction need `rollout_logprobs` for every row, but the batch has no "
                r"such column; make the generate stage return sampled-token logprobs, or use old_log_prob/trainer")
    with pytest.raises(BatchError, match=expected):
        spec.fn(batch(), spec.params_model(), ctx())


def test_bypass_with_null_rows_names_their_count_and_the_stage():
    with_null = pa.array([[-0.5, -1.0, -2.0, -0.1], None, [-0.7, -1.5, -0.2]], F32)
    with pytest.raises(StageError, match=r"but 1 rows have none; make the generate stage") as err:
        run_stage("old_log_prob", "bypass", {}, batch(rollout_logprobs=with_null), ctx())
    assert (err.value.kind, err.value.impl, err.value.step) == ("old_log_prob", "bypass", 3)
    assert isinstance(err.value.cause, BatchError)


def test_reference_logprobs_use_the_reference_model():
    ref = ReferenceState(config(), 0, 1, None)
    assert not ref.model.training
    spec = stage_registry("ref").get("reference")
    result = spec.fn(ref, batch(), spec.params_model(micro_batch_size=2), ctx(temperature=0.8))
    assert set(result.columns) == {"ref_logprobs"}
    assert result.columns["ref_logprobs"].type == F32
    assert_rows_close(result.columns["ref_logprobs"], per_row_logprobs(ref.model, temperature=0.8))


def test_reference_follows_loaded_weights_not_the_seed():
    cfg = config()
    ref = ReferenceState(cfg, 0, 1, None)
    trainer = TrainState(cfg, 0, 1, None)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    spec = stage_registry("ref").get("reference")
    before = spec.fn(ref, batch(), spec.params_model(), ctx()).columns["ref_logprobs"]
    ref.load_weights(trainer.export_weights())
    after = spec.fn(ref, batch(), spec.params_model(), ctx()).columns["ref_logprobs"]
    expected = per_row_logprobs(trainer.model)
    assert_rows_close(after, expected)
    with pytest.raises(AssertionError):
        assert_rows_close(before, expected)


def test_bypass_rejects_logprobs_not_aligned_with_the_response():
    short = pa.array([[-0.5, -1.0, -2.0], [-3.5], [-0.7, -1.5, -0.2]], F32)  # row 0 has 3 values for 4 tokens
    spec = stage_registry("old_log_prob").get("bypass")
    with pytest.raises(BatchError, match="column 'rollout_logprobs' is not aligned with response_mask"):
        spec.fn(batch(rollout_logprobs=short), spec.params_model(), ctx())


def test_a_row_with_an_empty_response_scores_as_empty_and_leaves_the_others_alone(state):
    table = pa.table({"prompt_ids": pa.array(PROMPTS + [[9, 8]], I32),
                      "response_ids": pa.array(RESPONSES + [[]], I32),
                      "response_mask": pa.array(MASKS + [[]], I8)})
    for micro in (1, 4):
        rows = trainer_stage(state, table, micro=micro).columns["old_logprobs"]
        assert rows.to_pylist()[3] == []
        assert_rows_close(rows.slice(0, 3), per_row_logprobs(state.model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trainer_on_cuda_scores_like_the_per_row_forward():
    # resources.device: cuda puts the trainer's model on the GPU; the stage must feed it GPU inputs
    state = TrainState(config(device="cuda"), 0, 1, None)
    assert next(state.model.parameters()).is_cuda
    result = trainer_stage(state, batch(), micro=2)
    assert_rows_close(result.columns["old_logprobs"], per_row_logprobs(state.model), atol=1e-4)


@torch.no_grad()
def test_trainer_writes_sum_pi_squared_per_response_token_on_request(state):
    spec = stage_registry("old_log_prob").get("trainer")
    params = spec.params_model(micro_batch_size=2, sum_pi_squared=True)
    assert set(spec.write_columns(params)) == {"old_logprobs", "sum_pi_squared"}
    result = spec.fn(state, batch(), params, ctx(temperature=0.7))
    state.model.eval()
    expected = []
    for prompt, response in zip(PROMPTS, RESPONSES):  # Σ_v softmax(logits/T)² at each response position
        logits = state.model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        probs = torch.softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / 0.7, -1)
        expected.append(probs.square().sum(-1).tolist())
    assert_rows_close(result.columns["sum_pi_squared"], expected)
    assert_rows_close(result.columns["old_logprobs"], per_row_logprobs(state.model, 0.7))


# --- rows sharing a prompt (GRPO's n samples) run it once ---------------------------------------------------------
# prompts [0, 5] and [5] left-pad to the same ids with pad id 0: only their masks tell them apart
SHARED_PROMPTS = [[5, 6], [5, 6], [5, 6], [7, 8, 9], [7, 8, 9], [0, 5], [5], [0, 5]]
SHARED_RESPONSES = [[6, 7, 8, 9], [4], [10, 14], [4, 4, 4], [], [3, 2], [1, 2, 3], [9]]


def test_rows_sharing_a_prompt_give_the_per_row_logits_and_gradients_with_each_prompt_run_once():
    from rlpipe.jagged import SequenceInputs
    from rlpipe.stages.logprobs import eager_logits

    model = TrainState(config(), 0, 1, None).model
    seq = SequenceInputs(pa.array(SHARED_PROMPTS, I32), pa.array(SHARED_RESPONSES, I32), pad_token_id=0)
    prompt_ids, prompt_mask, _, row_to_prompt = seq.prompt_groups()
    assert len(prompt_ids) == 4  # [5, 6], [7, 8, 9], [0, 5], [5]: the pad collision did not merge two
    assert row_to_prompt.tolist() == [row_to_prompt[0]] * 3 + [row_to_prompt[3]] * 2 + [row_to_prompt[5],
                                                                                         row_to_prompt[6], row_to_prompt[5]]
    assert len(set(row_to_prompt.tolist())) == 4
    tokens_in = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: tokens_in.append(i[0].numel()))
    logits = eager_logits(model, seq)
    hook.remove()
    assert tokens_in == [4 * seq.prompt_width, 8 * seq.response_width]  # the prompts once, then the responses
    assert logits.shape[:2] == (8, seq.response_width)
    for row, (prompt, response) in enumerate(zip(SHARED_PROMPTS, SHARED_RESPONSES)):  # each row alone, unpadded
        alone = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(logits[row, : len(response)], alone, rtol=0, atol=1e-5)

    def grads(logits_of):  # a loss over every real response token; its gradient on every parameter
        model.zero_grad()
        (seq.response_logprobs(logits_of()) * seq.response_padding).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads(lambda: model(input_ids=seq.input_ids, attention_mask=seq.attention_mask,
                                position_ids=seq.position_ids).logits)
    shared = grads(lambda: eager_logits(model, seq))
    for a, b in zip(plain, shared):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_rows_take_the_plain_forward_when_sharing_saves_little():
    from rlpipe.jagged import SequenceInputs

    seq = SequenceInputs(pa.array(PROMPTS, I32), pa.array(RESPONSES, I32), pad_token_id=0)
    assert seq.prompt_groups() is None  # nothing repeats: one forward over the whole rows
    # 4 samples of a 2-token prompt with 40-token responses: 6 of 168 tokens saved (< 10%)
    long = SequenceInputs(pa.array([[5, 6]] * 4, I32), pa.array([[7] * 40] * 4, I32), pad_token_id=0)
    assert long.prompt_groups() is None
    # the same prompts with 4-token responses: 6 of 24 tokens saved
    short = SequenceInputs(pa.array([[5, 6]] * 4, I32), pa.array([[7] * 4] * 4, I32), pad_token_id=0)
    assert short.prompt_groups()[3].tolist() == [0, 0, 0, 0]


def test_a_model_that_keeps_no_cache_takes_the_plain_forward():
    from rlpipe.jagged import SequenceInputs
    from rlpipe.stages.logprobs import eager_logits

    model = TrainState(config(), 0, 1, None).model
    seq = SequenceInputs(pa.array(SHARED_PROMPTS, I32), pa.array(SHARED_RESPONSES, I32), pad_token_id=0)
    shared = eager_logits(model, seq)
    model.activation_checkpointing_enable()  # HF drops the KV cache of a training forward under checkpointing
    try:
        without_cache = eager_logits(model, seq)
    finally:
        model.activation_checkpointing_disable()
    real = seq.response_padding  # logits read at padding positions differ by path (never read)
    torch.testing.assert_close(without_cache[real], shared[real], rtol=0, atol=1e-5)  # not the responses alone
