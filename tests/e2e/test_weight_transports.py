"""Weight transports end to end: runs pushing deltas (inline) or broadcasting over a gloo weight group
(Ray) train exactly as one pushing whole buckets through the object store.

In sync mode the rollout replica generates step k's data with the weights pushed at step k-1, so a
delta that rebuilt a single word wrongly changes the samples and, from there, every later update:
equal final weights (bit for bit) mean every push arrived whole. bfloat16 weights under a small
learning rate leave most words unchanged from one step to the next, so most pushes do go as deltas
(checked through the per-step metrics).
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import Recorder, quickstart_raw

pytestmark = pytest.mark.e2e


def run(tmp_path, impl: str, params: dict, inline: bool = True, replicas: int = 1, dtype: str = "bfloat16",
        steps: int = 4):
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    raw = quickstart_raw(
        name=f"transport-{impl}", data={"prompts_per_step": 4},
        model={**quickstart_raw()["model"], "dtype": dtype}, resources={"rollout_replicas": replicas},
        trainer={"total_steps": steps, "output_dir": str(tmp_path / f"{impl}-{inline}"), "optimizer": {"lr": 1.0e-5}},
        tracking={"enabled": False},
    )
    raw["stages"] = [s for s in raw["stages"] if s["kind"] != "weight_sync"]
    raw["stages"].append({"kind": "weight_sync", "impl": impl, "params": params})
    recorder = Recorder()
    result = run_pipeline(validate_config(raw), yaml.safe_dump(raw), inline=inline, observer=recorder)
    if not inline:  # one trainer worker: the push ran as the last act of its chain call, calling the replicas
        where = {r.worker for r in recorder.records if r.node == "weight_sync"}
        assert len(where) == 1 and where.pop().startswith("driver in actor×1@"), where
    return load_file(f"{result.model_dir}/model.safetensors"), recorder.metrics


def test_a_delta_run_ends_with_the_same_weights_as_a_full_push_run(tmp_path):
    full, _ = run(tmp_path, "object_store", {})
    delta, metrics = run(tmp_path, "delta", {"full_every": 3})
    assert full.keys() == delta.keys()
    for name in full:
        assert torch.equal(full[name], delta[name]), name
    pushes = [metrics[step] for step in sorted(metrics)]
    assert [m["weight_sync/full_push"] for m in pushes] == [1.0, 0.0, 0.0, 1.0]  # versions 1-4
    sparse = [m for m in pushes if m["weight_sync/delta_buckets"] > 0]  # measured: 39% and 30% of a full push
    assert len(sparse) == 2 and all(m["weight_sync/bytes"] < pushes[0]["weight_sync/bytes"] / 2 for m in sparse), \
        [m["weight_sync/bytes"] for m in pushes]
    for m in pushes:
        assert m["weight_sync/bytes"] > 0 and m["weight_sync/mb_per_s"] > 0


def test_a_broadcast_run_on_ray_ends_with_the_same_weights_as_an_object_store_run(ray_session, tmp_path):
    """Two rollout replicas (a weight group of 3 processes: trainer rank 0 + 2 replicas, gloo)."""
    full, _ = run(tmp_path, "object_store", {}, replicas=2, dtype="float32", steps=3)
    broadcast, metrics = run(tmp_path, "broadcast", {"timeout_s": 60}, inline=False, replicas=2, dtype="float32",
                             steps=3)
    for name in full:
        assert torch.equal(full[name], broadcast[name]), name
    pushes = [metrics[step] for step in sorted(metrics)]
    assert [m["weight_sync/version"] for m in pushes] == [1.0, 2.0, 3.0]
    assert pushes[0]["weight_sync/join_s"] > 0 and all(m["weight_sync/join_s"] == 0 for m in pushes[1:])
    n_bytes = sum(t.numel() * t.element_size() for t in full.values())
    for m in pushes:
        assert n_bytes <= m["weight_sync/bytes"] < n_bytes + 64 * 64
        assert m["weight_sync/send_s"] > 0 and m["weight_sync/mb_per_s"] > 0 and m["weight_sync/buckets"] == 1
