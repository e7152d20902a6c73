"""trainer.backend fsdp2: 2 gloo ranks with FSDP2-sharded parameters, grads and AdamW state = 1 unsharded rank.

Same harness as test_dp_invariant (forkserver, gloo on a free port, the update/ppo stage function
on each rank's rows). Checked on the ranks: the parameters after the update equal the single-process
replicated trainer's on the whole batch (1e-5), also when the ranks hold different numbers of rows
(and so of micro-batches: the short rank runs idle passes); each rank holds about half of the
parameters and of AdamW's moments; the weight-sync export (one all-gather per tensor, rank 0 packs)
equals the single-process export layout; a per-rank checkpoint resumes to the same next update. With trainer.lora
(case ``lora``) the adapters shard with the frozen base: the update equals the unsharded LoRA trainer's, AdamW holds
the adapters' moments only, a push carries the adapters only and the merged save is a plain model.
"""

import time

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.multiprocessing as mp
from test_dp_invariant import CASES, config, free_address, full_batch, single_process_order

from rlpipe.engine.state.train_state import TrainState
from rlpipe.errors import ConfigError
from rlpipe.schemas.lora import LoRAConfig
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages import update  # noqa: F401  (registers update/ppo before the ranks fork)

# the dp-invariant cases (equal rows per rank) plus one with 5 / 3 rows (3 / 2 micro-batches of 2)
ROWS = {case: ([0, 3, 5, 6], [1, 2, 4, 7]) for case in CASES}
ROWS["uneven-rows"] = ([0, 3, 5, 6, 1], [2, 4, 7])
ROWS["lora"] = ROWS["token-mean"]  # trainer.lora: FSDP2 shards the adapters with the frozen base
SHAPES = {**CASES, "uneven-rows": ("token-mean", None, 1, 2), "lora": CASES["token-mean"]}


def fsdp_config(case: str, dp_size: int, backend: str = "fsdp2"):
    base = case if case in CASES else "token-mean"
    cfg = config(base, dp_size)
    cfg.trainer.backend = backend
    if case == "lora":
        cfg.trainer.lora = LoRAConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    if dp_size > 1:
        cfg.trainer.micro_batch_size = SHAPES[case][3]
    return cfg


def run(state: TrainState, case: str, rows: list[int]) -> dict[str, float]:
    spec = stage_registry("update").get("ppo")
    params = spec.params_model(loss_agg_mode=SHAPES[case][0], clip_ratio=0.1)
    ctx = StageContext(step=0, seed=0, dp_rank=state.rank, dp_size=state.world_size)
    return spec.fn(state, full_batch().take(pa.array(rows)), params, ctx).metrics


def _rank_main(rank: int, address: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    for case in ROWS:
        state = TrainState(fsdp_config(case, 2), rank, 2, address)
        local_params = sum(state.backend.local(p).numel() for p in state.model.parameters())
        metrics = run(state, case, ROWS[case][rank])
        full = [t.clone() for _, t in state.backend.full_parameters(state.model)]
        moments = sum(state.backend.local(v).numel() for st in state.optimizer.state.values()
                      for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
        buckets = state.export_weights()
        result = {"params": full, "metrics": metrics, "local_params": local_params, "moments": moments,
                  "buckets": buckets}
        if case in ("token-mean", "lora"):  # lora: the merged save; every rank takes part in the gathers
            state.save_hf(f"{out_dir}/hf" if case == "token-mean" else f"{out_dir}/lora-hf")
            prefix = f"{out_dir}/ckpt-{case}-actor"
            state.save_checkpoint(prefix)
            run(state, case, ROWS[case][rank])
            result["continued"] = [t.clone() for _, t in state.backend.full_parameters(state.model)]
            resumed = TrainState(fsdp_config(case, 2), rank, 2, address)
            resumed.load_checkpoint(prefix)
            run(resumed, case, ROWS[case][rank])
            result["resumed"] = [t.clone() for _, t in resumed.backend.full_parameters(resumed.model)]
        torch.save(result, f"{out_dir}/{case}-rank{rank}.pt")


def _single_order(case: str) -> list[int]:
    return single_process_order(case) if case in CASES else sorted(ROWS[case][0] + ROWS[case][1])


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    mp.get_context("forkserver").set_forkserver_preload(["rlpipe.engine.state.train_state", "rlpipe.stages.update"])
    procs = mp.start_processes(_rank_main, args=(free_address(), str(out_dir)), nprocs=2, join=False,
                               start_method="forkserver")
    singles = {}
    for case in ROWS:
        state = TrainState(fsdp_config(case, 1, "replicated"), 0, 1, None)
        total = sum(p.numel() for p in state.model.parameters())
        metrics = run(state, case, _single_order(case))
        singles[case] = {"params": [p.detach().clone() for p in state.model.parameters()], "metrics": metrics,
                         "total": total, "buckets": state.export_weights()}
    deadline = time.time() + 240
    while not procs.join(timeout=5):
        if time.time() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("FSDP2 ranks did not finish within 240 s")
    ranks = {case: [torch.load(out_dir / f"{case}-rank{r}.pt", weights_only=False) for r in (0, 1)] for case in ROWS}
    return singles, ranks, out_dir


@pytest.mark.parametrize("case", list(ROWS))
def test_fsdp2_update_equals_the_unsharded_trainer(fsdp_results, case):
    singles, ranks, _ = fsdp_results
    for rank in (0, 1):
        for p_fsdp, p_single in zip(ranks[case][rank]["params"], singles[case]["params"], strict=True):
            torch.testing.assert_close(p_fsdp, p_single, rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/local_updates", "actor/lr"):
        assert ranks[case][0]["metrics"][key] == pytest.approx(singles[case]["metrics"][key], rel=1e-5, abs=1e-6), key


def test_each_rank_holds_about_half_of_parameters_and_optimizer_state(fsdp_results):
    singles, ranks, _ = fsdp_results
    total = singles["token-mean"]["total"]
    local = [ranks["token-mean"][r]["local_params"] for r in (0, 1)]
    moments = [ranks["token-mean"][r]["moments"] for r in (0, 1)]
    assert sum(local) == total  # a partition, no replica
    for n, m in zip(local, moments):
        assert abs(n / total - 0.5) < 0.05 and m == 2 * n


def test_export_gathers_the_full_hf_named_weights_on_rank_0(fsdp_results):
    singles, ranks, _ = fsdp_results
    assert ranks["token-mean"][1]["buckets"] is None
    sharded, single = ranks["token-mean"][0]["buckets"], singles["token-mean"]["buckets"]
    assert [m.name for b in sharded for m in b.tensors] == [m.name for b in single for m in b.tensors]
    assert [m.shape for b in sharded for m in b.tensors] == [m.shape for b in single for m in b.tensors]
    a = np.concatenate([b.data for b in sharded]).view(np.float32)
    b = np.concatenate([b.data for b in single]).view(np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_save_hf_gathers_the_sharded_model_on_rank_0(fsdp_results):
    from transformers import AutoModelForCausalLM

    _, ranks, out_dir = fsdp_results
    saved = AutoModelForCausalLM.from_pretrained(out_dir / "hf")
    for p_saved, p_rank in zip(saved.parameters(), ranks["token-mean"][0]["params"], strict=True):
        assert torch.equal(p_saved.detach(), p_rank)


@pytest.mark.parametrize("case", ["token-mean", "lora"])
def test_sharded_checkpoint_resumes_to_the_same_next_update(fsdp_results, case):
    _, ranks, _ = fsdp_results
    for rank in (0, 1):
        r = ranks[case][rank]
        for cont, res in zip(r["continued"], r["resumed"], strict=True):
            assert torch.equal(cont, res)


def test_lora_on_fsdp2_shards_only_the_adapters_state_and_pushes_only_them(fsdp_results):
    from transformers import AutoModelForCausalLM

    singles, ranks, out_dir = fsdp_results
    rank0, rank1 = ranks["lora"]
    # 2 layers of q and v (rank 4 x (32 in + 32 out)) and down_proj (4 x (64 + 32))
    adapters = 2 * (2 * 4 * (32 + 32) + 4 * (64 + 32))
    assert rank0["moments"] + rank1["moments"] == 2 * adapters  # AdamW moments of the adapters only, sharded
    assert rank1["buckets"] is None
    pushed = [m.name for b in rank0["buckets"] for m in b.tensors]
    assert pushed == [m.name for b in singles["lora"]["buckets"] for m in b.tensors]
    assert len(pushed) == 2 * 3 * 2 and all(n.endswith(("lora_A", "lora_B")) for n in pushed)
    merged = AutoModelForCausalLM.from_pretrained(out_dir / "lora-hf")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert singles["lora"]["total"] - adapters == sum(p.numel() for p in merged.parameters())


def test_a_sharded_checkpoint_is_refused_by_another_layout(tmp_path):
    from rlpipe.engine.state.safe_io import save_state

    state = TrainState(fsdp_config("token-mean", 1, "replicated"), 0, 1, None)
    sd = state.state_dict()
    sd["layout"] = {"backend": "fsdp2", "world_size": 2}
    save_state(sd, tmp_path, "actor_rank0")
    with pytest.raises(ConfigError, match="fsdp2 shards of 2 rank"):
        state.load_checkpoint(str(tmp_path / "actor"))


def test_megatron_backend_is_refused_on_cpu():
    from rlpipe.engine.state.trainer_backends import TRAINER_BACKENDS

    with pytest.raises(ConfigError, match="needs CUDA"):
        TRAINER_BACKENDS.get("megatron").check(fsdp_config("token-mean", 1, "megatron"))
