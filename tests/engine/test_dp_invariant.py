"""The data-parallel invariant of the trainer: 2 gloo ranks on halves of a batch = 1 rank on the whole batch.

Two processes (torch.multiprocessing from a fork server, gloo on a free port) each build
``TrainState(config, rank, 2, address)`` and run the update/ppo stage function on
their rows — equal row counts, as the balance stage assigns them. A single
process runs the same stage on the whole batch. The parameters after the update
must agree to float rounding, for token-mean and seq-mean-token-mean, and with
mini-batches and several epochs (where the global mini-batch k is the union of
every rank's k-th chunk). Every rank ends with the same parameters.

AdamW's eps is 1 so an update is nearly proportional to the gradient: with a
tiny eps the first Adam step is ≈ lr·sign(g), which would hide a gradient
averaged instead of summed. Clipping is off for the same reason.
"""

import socket
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.multiprocessing as mp

from rlpipe.engine.state.train_state import TrainState
from rlpipe.schemas.config import (
    ArchitectureConfig, DataConfig, ModelConfig, OptimizerConfig, PipelineConfig, TokenizerConfig, TrainerConfig,
)
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages import update  # noqa: F401  (registers update/ppo before the ranks fork)

I32, I8, F32 = pa.list_(pa.int32()), pa.list_(pa.int8()), pa.list_(pa.float32())
PROMPTS = [[5, 6], [7, 8, 9, 10, 11], [12, 13, 4], [9], [4, 4, 5, 6], [13, 12], [6, 7, 8], [10, 11, 12, 13]]
RESPONSES = [[6, 7, 8, 9], [4], [10, 14, 5], [5, 5, 6, 7, 8], [9, 10], [11, 12, 13], [14], [4, 5, 6]]
MASKS = [[1, 1, 1, 0], [1], [1, 0, 1], [1, 1, 1, 1, 1], [0, 1], [1, 1, 1], [1], [1, 1, 0]]
ADVANTAGES = [[0.5, -1.0, 2.0, 0.3], [-0.7], [1.5, 0.2, -0.4], [0.9, 0.1, -1.2, 0.6, 0.4], [0.0, -2.0],
              [1.1, 1.3, -0.6], [0.8], [-1.5, 0.7, 0.25]]
# Rows of each rank (equal counts; rank 0 holds long and short rows, as token balancing mixes them).
RANK_ROWS = ([0, 3, 5, 6], [1, 2, 4, 7])
# name → (loss_agg_mode, ppo_mini_batch_size in prompts of 8, ppo_epochs, micro_batch_size on the DP ranks)
CASES = {
    "token-mean": ("token-mean", None, 1, 1),
    "seq-mean-token-mean": ("seq-mean-token-mean", None, 1, 3),
    "token-mean-2-minis-2-epochs": ("token-mean", 4, 2, 2),
}


def config(case: str, dp_size: int) -> PipelineConfig:
    mode, mini, epochs, micro = CASES[case]
    arch = ArchitectureConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
    trainer = TrainerConfig(dp_size=dp_size, ppo_mini_batch_size=mini, ppo_epochs=epochs,
                            micro_batch_size=micro if dp_size > 1 else 64, grad_clip=None,
                            optimizer=OptimizerConfig(lr=0.01, eps=1.0, weight_decay=0.1))
    return PipelineConfig(model=ModelConfig(architecture=arch), tokenizer=TokenizerConfig(chars="0123456789="),
                          data=DataConfig(prompts_per_step=8), trainer=trainer, stages=[])


def full_batch() -> pa.Table:
    # old_logprobs away from the current policy (ratios ≠ 1, some clipped): a fixed pseudo-random offset
    rng = np.random.default_rng(0)
    old = [(-2.5 + 0.3 * rng.standard_normal(len(r))).tolist() for r in RESPONSES]
    return pa.table({
        "prompt_ids": pa.array(PROMPTS, I32), "response_ids": pa.array(RESPONSES, I32),
        "response_mask": pa.array(MASKS, I8), "old_logprobs": pa.array(old, F32),
        "advantages": pa.array(ADVANTAGES, F32),
    })  # fmt: skip


def single_process_order(case: str) -> list[int]:
    """Row order for one rank whose contiguous mini-batches equal the DP ranks' global mini-batches."""
    minis = 8 // (CASES[case][1] or 8)
    chunks = [np.array_split(rows, minis) for rows in RANK_ROWS]
    return [int(r) for k in range(minis) for rank_chunks in chunks for r in rank_chunks[k]]


def run(state: TrainState, case: str, rows: list[int]) -> dict[str, float]:
    spec = stage_registry("update").get("ppo")
    params = spec.params_model(loss_agg_mode=CASES[case][0], clip_ratio=0.1)
    ctx = StageContext(step=0, seed=0, dp_rank=state.rank, dp_size=state.world_size)
    return spec.fn(state, full_batch().take(pa.array(rows)), params, ctx).metrics


def _rank_main(rank: int, address: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    for case in CASES:
        state = TrainState(config(case, 2), rank, 2, address)  # the gloo group is joined once per process
        metrics = run(state, case, RANK_ROWS[rank])
        torch.save({"params": [p.detach() for p in state.model.parameters()], "metrics": metrics},
                   f"{out_dir}/{case}-rank{rank}.pt")


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dp")
    # forkserver: a fresh server process imports torch/transformers/rlpipe once and forks both ranks from it
    # (spawning would import them once per rank; forking pytest would copy whatever threads it runs, e.g. Ray's)
    mp.get_context("forkserver").set_forkserver_preload(["rlpipe.engine.state.train_state", "rlpipe.stages.update"])
    procs = mp.start_processes(_rank_main, args=(free_address(), str(out_dir)), nprocs=2, join=False,
                               start_method="forkserver")
    # the single-process references are computed while the ranks start up
    singles = {}
    for case in CASES:
        state = TrainState(config(case, 1), 0, 1, None)
        initial = [p.detach().clone() for p in state.model.parameters()]
        metrics = run(state, case, single_process_order(case))
        singles[case] = {"params": [p.detach() for p in state.model.parameters()], "metrics": metrics,
                         "initial": initial}
    deadline = time.time() + 120
    while not procs.join(timeout=5):
        if time.time() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("data-parallel ranks did not finish within 120 s")
    ranks = {case: [torch.load(out_dir / f"{case}-rank{r}.pt") for r in (0, 1)] for case in CASES}
    return singles, ranks


def test_rank_rows_partition_the_batch():
    assert sorted(RANK_ROWS[0] + RANK_ROWS[1]) == list(range(8)) and len(RANK_ROWS[0]) == len(RANK_ROWS[1])
    assert single_process_order("token-mean-2-minis-2-epochs") == [0, 3, 1, 2, 5, 6, 4, 7]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_rank_on_the_whole_batch(dp_results, case):
    singles, ranks = dp_results
    single = singles[case]
    moved = max(float((a - b).abs().max()) for a, b in zip(single["params"], single["initial"]))
    assert moved > 1e-4  # the update is large enough for a wrong gradient to show
    for p_dp, p_single in zip(ranks[case][0]["params"], single["params"]):
        torch.testing.assert_close(p_dp, p_single, rtol=0, atol=1e-6)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/local_updates", "actor/lr"):
        assert ranks[case][0]["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("case", list(CASES))
def test_all_ranks_end_with_identical_parameters(dp_results, case):
    _, ranks = dp_results
    for p0, p1 in zip(ranks[case][0]["params"], ranks[case][1]["params"]):
        assert torch.equal(p0, p1)
    assert ranks[case][0]["metrics"] == ranks[case][1]["metrics"]
