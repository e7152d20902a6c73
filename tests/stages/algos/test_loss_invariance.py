"""INVARIANT: the gradient of one mini-batch equals the gradient of the same mini-batch
split into micro-batches, and split across 2 data-parallel ranks (gloo, gradients
summed by all-reduce), for every aggregation mode — because every share is
normalized by the global token / sequence counts agreed before the backward pass.
"""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlpipe.stages.algos.aggregation import LossDenominators, local_counts
from rlpipe.stages.algos.policy_loss import ActorLossConfig, actor_loss

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# deterministic, micro-batch-separable losses (clip_cov/kl_cov select tokens per micro-batch, as in verl)
LOSSES = ["vanilla", "gspo", "sapo", "geo_mean", "cispo", "gpg", "dppo_kl"]
N, R, D = 10, 7, 4
LENGTHS = [7, 1, 3, 0, 5, 2, 7, 4, 6, 1]  # unequal lengths and one fully masked row


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    mask[2, 1] = 0.0  # a masked-out token inside a row (a tool observation)
    return {
        "features": torch.randn(N, R, D, generator=g, dtype=torch.float64),
        "old_log_prob": -torch.rand(N, R, generator=g, dtype=torch.float64) * 2,
        "ref_log_prob": -torch.rand(N, R, generator=g, dtype=torch.float64) * 2,
        "advantages": torch.randn(N, R, generator=g, dtype=torch.float64),
        "is_weights": torch.rand(N, R, generator=g, dtype=torch.float64) + 0.5,
        "mask": mask,
    }


def _configs():
    for loss in LOSSES:
        for mode in AGG_MODES:
            yield ActorLossConfig(
                policy_loss=loss, loss_agg_mode=mode, use_kl_loss=True, kl_loss_type="k3+",
                kl_loss_coef=0.1, entropy_coeff=0.01, loss_scale_factor=4.0 if mode.endswith("norm") else None,
            )  # fmt: skip


def _grad(cfg, batch, micro_batches, den):
    """Σ over micro-batches of backward(share); returns the accumulated gradient of the weights."""
    w = torch.linspace(-0.5, 0.5, D, dtype=torch.float64).requires_grad_(True)
    for rows in micro_batches:
        b = {k: v[rows] for k, v in batch.items()}
        logits = b["features"] @ w
        log_prob = torch.nn.functional.logsigmoid(logits)
        loss, _ = actor_loss(
            cfg, log_prob=log_prob, old_log_prob=b["old_log_prob"], advantages=b["advantages"],
            response_mask=b["mask"], denominators=den, ref_log_prob=b["ref_log_prob"],
            entropy=torch.sigmoid(logits), rollout_is_weights=b["is_weights"],
        )  # fmt: skip
        loss.backward()
    return w.grad.clone()


def _den(batch, rows_per_rank):
    counts = [local_counts(batch["mask"][rows]) for rows in rows_per_rank]
    return LossDenominators(sum(c[0] for c in counts), sum(c[1] for c in counts), len(rows_per_rank))


def _reference(cfg, batch):
    return _grad(cfg, batch, [torch.arange(N)], _den(batch, [torch.arange(N)]))


MICRO = [torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6, 7, 8, 9])]
RANK_ROWS = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7, 8, 9])]
RANK_MICRO = [[torch.tensor([0, 1]), torch.tensor([2, 3])], [torch.tensor([4]), torch.tensor([5, 6, 7, 8, 9])]]


def test_micro_batch_split_gives_the_same_gradient():
    batch = _batch()
    for cfg in _configs():
        split = _grad(cfg, batch, MICRO, _den(batch, [torch.arange(N)]))
        torch.testing.assert_close(split, _reference(cfg, batch), msg=f"{cfg.policy_loss}/{cfg.loss_agg_mode}")


def test_local_denominator_would_break_the_invariant():
    """The guard has teeth: normalizing each micro-batch by its own tokens changes the gradient."""
    batch = _batch()
    cfg = ActorLossConfig(policy_loss="gpg")
    wrong = sum(_grad(cfg, batch, [rows], _den(batch, [rows])) for rows in MICRO)
    assert not torch.allclose(wrong, _reference(cfg, batch))


def _dp_worker(rank, port, world):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        batch = _batch()
        local = torch.tensor(local_counts(batch["mask"][RANK_ROWS[rank]]), dtype=torch.float64)
        dist.all_reduce(local)  # the denominators are agreed before any backward pass
        den = LossDenominators(float(local[0]), float(local[1]), world)
        for cfg in _configs():
            grad = _grad(cfg, batch, RANK_MICRO[rank], den)
            dist.all_reduce(grad)  # gradients are SUMMED across ranks
            torch.testing.assert_close(grad, _reference(cfg, batch), msg=f"{cfg.policy_loss}/{cfg.loss_agg_mode}")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_data_parallel_ranks_give_the_same_gradient():
    mp.spawn(_dp_worker, args=(_free_port(), 2), nprocs=2, join=True)
