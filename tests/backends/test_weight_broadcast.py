"""The broadcast weight transport (rlpipe.backends.weight_broadcast) between two real processes.

The sender (trainer rank 0) runs in the test process, the receiver (a rollout replica) in a spawned
process that loads what it receives into its own model and returns that model's weights. On CPU the
group is gloo; with one CUDA device the same code moves CUDA buckets over gloo; with two CUDA devices
over NCCL (NCCL refuses two ranks on one device, so one GPU cannot test it).
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from rlpipe.backends.weight_broadcast import BroadcastReceiver, BroadcastSender
from rlpipe.backends.weights import WeightTransportError, export_buckets, load_buckets

TIMEOUT_S = 60.0


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8, dtype=torch.bfloat16))


def _replica(plans, results, device: str) -> None:
    """A replica process: receive each plan's buckets, load them, send back the weights (or the error)."""
    torch.set_num_threads(1)
    receiver, target = BroadcastReceiver(0, device), model(seed=99)
    results.put("ready")  # imported and built: the group's join below is all the sender's timeout then covers
    try:
        while (plan := plans.get(timeout=TIMEOUT_S)) is not None:
            push = receiver.receive(plan)
            load_buckets(target, push.buckets)
            results.put({n: p.detach().float().numpy() for n, p in target.state_dict().items()})
    except Exception as exc:  # noqa: BLE001 - reported to the test process
        results.put(f"{type(exc).__name__}: {exc}")


def cases():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    yield pytest.param("gloo", "cpu", "cpu", id="gloo-cpu")
    yield pytest.param("gloo", "cuda:0", "cuda:0", id="gloo-cuda",
                       marks=pytest.mark.skipif(n < 1, reason="needs a CUDA device (CPU torch here)"))
    yield pytest.param("nccl", "cuda:0", "cuda:1", id="nccl-2gpu",
                       marks=pytest.mark.skipif(n < 2, reason=f"NCCL needs two CUDA devices (one rank per GPU); {n} here"))


@pytest.mark.parametrize("backend,send_device,recv_device", list(cases()))
def test_broadcast_delivers_every_push_bit_for_bit(backend, send_device, recv_device):
    ctx = mp.get_context("spawn")
    plans, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_replica, args=(plans, results, recv_device), daemon=True)
    child.start()
    try:
        # a spawned process imports torch first; under a loaded suite that alone once took most of the group's
        # 60 s, so the group forms only once the replica is up (each wait keeps its own TIMEOUT_S bound)
        assert results.get(timeout=TIMEOUT_S) == "ready"
        sender, source = BroadcastSender(send_device, "127.0.0.1"), model(seed=0)
        for version in (1, 2):
            buckets = export_buckets(source, bucket_bytes=2048)  # several buckets per push
            assert len(buckets) > 1
            plan = sender.plan(buckets, version, 1, backend, None, TIMEOUT_S, export_s=0.0)
            assert plan.backend == backend and plan.nbytes == sum(b.nbytes for b in buckets)
            plans.put(plan)
            stats = sender.send()
            received = results.get(timeout=TIMEOUT_S)
            assert not isinstance(received, str), received
            for name, tensor in source.state_dict().items():
                assert np.array_equal(received[name], tensor.detach().float().numpy()), (version, name)
            assert stats["send_s"] > 0 and (stats["join_s"] > 0) == (version == 1)  # the group forms once
            with torch.no_grad():
                source[0].weight.mul_(1.5)
        plans.put(None)
    finally:
        child.join(timeout=TIMEOUT_S)
        if child.is_alive():
            child.kill()


def test_a_sender_without_replicas_times_out_naming_the_group():
    sender = BroadcastSender("cpu", "127.0.0.1")
    sender.plan(export_buckets(model(0)), 1, 1, "gloo", None, 2.0, export_s=0.0)
    with pytest.raises(WeightTransportError, match=r"weight group rank 0/2 \(gloo\) could not form within 2s"):
        sender.send()


def test_a_receiver_in_the_senders_process_refuses_at_once():
    sender = BroadcastSender("cpu", "127.0.0.1")
    plan = sender.plan(export_buckets(model(0)), 1, 1, "gloo", None, 30.0, export_s=0.0)
    with pytest.raises(WeightTransportError, match="separate processes"):
        BroadcastReceiver(0, "cpu").receive(plan)


def test_a_corrupted_bucket_is_refused_before_loading():
    """A plan whose checksum does not match the bytes that arrive (what a corruption in transit looks like)."""
    from dataclasses import replace

    ctx = mp.get_context("spawn")
    plans, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_replica, args=(plans, results, "cpu"), daemon=True)
    child.start()
    try:
        assert results.get(timeout=TIMEOUT_S) == "ready"  # as above: the group forms once the replica is up
        sender = BroadcastSender("cpu", "127.0.0.1")
        plan = sender.plan(export_buckets(model(0)), 1, 1, "gloo", None, TIMEOUT_S, export_s=0.0)
        header = replace(plan.headers[0], checksum="0" * 32)
        plans.put(replace(plan, headers=(header, *plan.headers[1:])))
        sender.send()
        error = results.get(timeout=TIMEOUT_S)
        assert isinstance(error, str) and "bucket 0 of the push of version 1" in error and "checksum" in error, error
    finally:
        child.join(timeout=TIMEOUT_S)
        if child.is_alive():
            child.kill()
