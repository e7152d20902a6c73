"""Shared fixtures: a tiny pipeline config, a session-wide local Ray, a session-wide vLLM server."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import work_order

# Two cores: one intra-op thread per process avoids oversubscription (seconds → milliseconds).
torch.set_num_threads(1)


@torch.no_grad()
def eval_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``model`` in eval mode (its train/eval mode is restored)."""
    was = model.training
    model.eval()
    out = model(input_ids=input_ids).logits
    model.train(was)
    return out

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test-fast` (RLPIPE_TEST_TIER=fast) runs what needs no Ray, no vLLM server and no `rlpipe run` subprocess:
# it deselects the markers below, and a test that starts Ray or vLLM anyway fails saying which marker it needs.
FAST_TIER = os.environ.get("RLPIPE_TEST_TIER") == "fast"
_MARKED_BY_FIXTURE = {"ray_session": "e2e", "sync_run": "e2e", "vllm_server": "vllm"}


def pytest_collection_modifyitems(config, items):
    """A test that uses a shared Ray or vLLM fixture carries that fixture's marker (so -m selects it); the worker
    groups are ordered longest first (tests/work_order.py)."""
    for item in items:
        for fixture, marker in _MARKED_BY_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
    items[:] = work_order.longest_first(items, xdist_group)


# Session fixtures too costly to build once per xdist worker (`make test` runs three), by the group whose files run on
# one worker. Ray is not among them: each worker's own local Ray costs seconds, and one worker for every Ray test
# would serialize a third of the suite.
_SHARED_ACROSS_FILES = {"vllm_server": "vllm", "sync_run": "sync_run", "inline_run": "inline_run",
                        "scripted_model": "agents", "chat_model": "agents"}


@functools.cache
def xdist_group(path: str) -> str:
    """The worker group of a test file: the shared fixture it names (in its text), else the file itself (so its
    module fixtures are built once)."""
    text = (ROOT / path).read_text(encoding="utf-8")
    return next((group for name, group in _SHARED_ACROSS_FILES.items() if re.search(rf"\b{re.escape(name)}\b", text)),
                path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole groups (see xdist_group) to a worker. xdist's own --dist loadgroup does not group under pytest 9 (its
    worker sets ``item._nodeid``, which pytest 9's ``nodeid`` no longer reads), so the grouping is done here, on
    the controller, which sees only node ids."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection order is already longest first (not most tests first)

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::", 1)[0])

    return SharedFixtureScheduling(config, log)


_DURATIONS = None if os.environ.get("PYTEST_XDIST_WORKER") else work_order.recorder(xdist_group)


def pytest_runtest_logreport(report):
    if _DURATIONS is not None:
        _DURATIONS.add(report)


def pytest_sessionfinish(session):
    if _DURATIONS is not None:
        _DURATIONS.write()


def _not_in_the_fast_tier(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"this test {what}, which the fast tier (make test-fast) does not: mark it "
                           "@pytest.mark.e2e (Ray), @pytest.mark.vllm (a vLLM server) or @pytest.mark.slow")
    return refuse


@pytest.fixture(autouse=FAST_TIER)
def fast_tier_guard(monkeypatch):
    """In the fast tier, starting Ray or a vLLM server fails the test (it belongs to `make test`)."""
    import ray

    from rlpipe.inference.vllm_server import VLLMServer

    monkeypatch.setattr(ray, "init", _not_in_the_fast_tier("starts Ray"))
    monkeypatch.setattr(VLLMServer, "_start", _not_in_the_fast_tier("starts a vLLM server"))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for all end-to-end tests (starting Ray costs ~5 s); a finished run's workers are kept for the
    next run (rlpipe.engine.execution.worker_pool: each new model-holding worker imports torch and transformers)."""
    import ray

    from rlpipe.engine.execution import worker_pool
    from rlpipe.engine.execution.ray_runtime import init_ray

    init_ray(None, 2)
    worker_pool.keep_idle_workers()
    yield ray
    worker_pool.keep_idle_workers(False)
    ray.shutdown()


# The model every test that attaches to the shared vLLM server uses (its shapes are the server's). head_dim 64
# (vLLM's CPU attention rejects smaller heads), grouped-query attention (2 heads share one KV head, as real models
# do), and a context long enough for the abort tests' long responses.
VLLM_CHARS = "abcdefgh 0123456789+="
VLLM_ARCH = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128,
             "max_position_embeddings": 32768}


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One real vLLM server for the whole test run, serving a model of VLLM_ARCH and VLLM_CHARS.

    Tests attach to it (``VLLMParams(urls=[server.url])``); every attach pushes the attaching model's
    weights as version 0 and resets the prefix cache, so a test sees only its own weights. It serves LoRA
    adapters too (2 slots, rank ≤ 8: tests/e2e/test_vllm_lora_server.py attaches with ``trainer.lora``); requests
    without an adapter run on the pushed weights as on any server. A test that kills its server, or checks rlpipe's
    own start of one, builds its own. Skips where vLLM's venv is missing (``make setup`` makes it)."""
    from rlpipe.backends.model import build_model, save_hf_model
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.inference.contract import EngineError
    from rlpipe.inference.vllm_lora import ServerLoRA
    from rlpipe.inference.vllm_server import VLLMParams, VLLMServer, vllm_python
    from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig

    params = VLLMParams(kv_cache_gb=0.25, max_model_len=VLLM_ARCH["max_position_embeddings"], startup_timeout_s=600)
    try:
        vllm_python(params)
    except EngineError as exc:
        pytest.skip(str(exc))
    tokenizer = build_tokenizer(TokenizerConfig(chars=VLLM_CHARS))
    model = build_model(ModelConfig(architecture=ArchitectureConfig(**VLLM_ARCH)), tokenizer, 0)
    root = tmp_path_factory.mktemp("shared-vllm")
    server = VLLMServer(save_hf_model(model, tokenizer, root / "model"), root, params, name="shared-vllm",
                        lora=ServerLoRA(slots=2, max_rank=8))
    _SHARED_VLLM["server"] = server
    yield server
    _SHARED_VLLM.pop("server", None)
    server.close()


_SHARED_VLLM = {}  # "server": the shared vLLM server while it runs, whose log a failing test's report carries


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used the shared vLLM server reports the server's log tail: tests attach to it
    by URL, so their own errors cannot name its log, and CI keeps only the test output."""
    outcome = yield
    report = outcome.get_result()
    server = _SHARED_VLLM.get("server")
    if report.failed and server is not None and "vllm_server" in getattr(item, "fixturenames", ()):
        alive = "running" if server._proc is not None and server._proc.poll() is None else "exited"
        report.sections.append((f"shared vLLM server log ({alive}; {server.log_path})", server.log_tail(80)))


_HANG = {"release": None}  # the Event the hanging scorer waits on; a fresh one per test


def _hangs(responses, ground_truths):
    """A reward function that does not return until its test ends (or 120 s pass)."""
    _HANG["release"].wait(120)
    import numpy as np

    return np.ones(len(responses), np.float32)


@pytest.fixture
def hanging_scorer():
    """Name of a registered scorer that never returns while the test runs (a reward sandbox that hangs).

    At teardown it is released, so the calls the run abandoned on daemon threads end with the test
    instead of holding a thread (and its rows) for 120 s into the next tests."""
    from rlpipe.stages.scorers import SCORERS

    if "test_hangs" not in SCORERS:
        SCORERS.add("test_hangs", _hangs)
    _HANG["release"] = release = __import__("threading").Event()
    yield "test_hangs"
    release.set()


class Recorder:
    """An observer that keeps every node record and every step's full final batch (for tests)."""

    def __init__(self):
        self.records, self.batches, self.metrics, self.trajectory_lineage = [], {}, {}, {}

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        return "recorded-run"

    def on_node_end(self, record):
        self.records.append(record)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        self.batches[step] = trajectories
        # merged: an evaluation's metrics (on_metrics) may come before the end of the step they belong to
        self.metrics[step] = {**self.metrics.get(step, {}), **metrics}
        self.trajectory_lineage[step] = trajectory_lineage

    def on_metrics(self, step, metrics):
        self.metrics.setdefault(step, {}).update(metrics)

    def on_artifact(self, local_path, artifact_path=None):
        pass

    def on_run_end(self, status, error=None):
        self.status = status


ROOT = Path(__file__).resolve().parents[1]


def prompt_table(tokenizer, texts, step: int, prefix: str = "p"):
    """Prompt rows as the loader makes them: uid ``{prefix}{i}``, data_source digits, ground truth ``i``."""
    import numpy as np
    import pyarrow as pa

    from rlpipe.jagged import from_flat

    ids = [tokenizer.encode(t) for t in texts]
    return pa.table({
        "uid": pa.array([f"{prefix}{i}" for i in range(len(texts))], pa.string()),
        "data_source": pa.array(["digits"] * len(texts), pa.string()),
        "ground_truth": pa.array([str(i) for i in range(len(texts))], pa.string()),
        "prompt_ids": from_flat(np.array(sum(ids, []), np.int32), np.array([len(x) for x in ids]), pa.int32()),
        "prompt_step": pa.array([step] * len(texts), pa.int32()),
    })


def quickstart_raw(**changes) -> dict:
    """The quickstart pipeline as a raw dict, with top-level sections updated from ``changes``."""
    raw = yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


def with_staleness_guard(raw: dict) -> dict:
    """``raw`` with the staleness guard the async modes need, right before ``balance`` (in place; returned)."""
    at = next(i for i, s in enumerate(raw["stages"]) if s["kind"] == "balance")
    raw["stages"].insert(at, {"kind": "staleness_guard", "impl": "max_staleness"})
    return raw


def with_reference(raw: dict) -> dict:
    """``raw`` with a reference model listed right after ``old_log_prob`` and a KL loss in ``update`` that reads it
    (in place; returned)."""
    stages = []
    for s in raw["stages"]:
        if s["kind"] == "update":
            s = {**s, "params": {**s["params"], "use_kl_loss": True, "kl_loss_coef": 0.01}}
        stages.append(s)
        if s["kind"] == "old_log_prob":
            stages.append({"kind": "ref", "impl": "reference"})
    raw["stages"] = stages
    return raw


def lora_quickstart_raw(tmp_path: Path, full_fine_tuning: bool = False, **trainer) -> dict:
    """pipelines/quickstart_lora.yaml as a raw dict writing into ``tmp_path``, tracking off, no checkpoints;
    ``full_fine_tuning``: without ``trainer.lora`` and at the quickstart's lr (at LoRA's 5e-3 the full model learns
    less), the comparison the LoRA learning tests make on the same seeds."""
    raw = yaml.safe_load((ROOT / "pipelines" / "quickstart_lora.yaml").read_text())
    raw["trainer"].update({"output_dir": str(tmp_path), "checkpoint_every": 0, **trainer})
    if full_fine_tuning:
        raw["trainer"].pop("lora")
        raw["trainer"]["optimizer"] = {"lr": 3e-3}
    raw["tracking"] = {"enabled": False}
    return raw


@dataclass
class TrackedRun:
    """A real run (Ray + MLflow) shared by the end-to-end and notebook tests."""

    tracking_uri: str
    run_id: str
    result: object
    config: object
    workdir: Path


@pytest.fixture(scope="session")
def sync_run(ray_session, tmp_path_factory) -> TrackedRun:
    """3 steps of the quickstart on Ray: 2 data-parallel trainer ranks, a reference model with a KL loss."""
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    workdir = tmp_path_factory.mktemp("sync_run")
    uri = f"sqlite:///{workdir}/mlflow.db"
    raw = quickstart_raw(
        name="e2e-sync",
        data={"prompts_per_step": 8},
        trainer={"total_steps": 3, "dp_size": 2, "output_dir": str(workdir / "outputs"), "save_every": 2},
        tracking={"uri": uri, "experiment": "rlpipe-e2e", "sample_trajectories": 4},
    )
    stages = []  # the reference model's node listed after old_log_prob: the plan runs nodes in YAML order
    for s in raw["stages"]:
        if s["kind"] == "update":
            s = {"kind": "update", "impl": "ppo", "params": {"use_kl_loss": True, "kl_loss_coef": 0.01}}
        stages.append(s)
        if s["kind"] == "old_log_prob":
            stages.append({"kind": "ref", "impl": "reference"})
    raw["stages"] = stages
    config = validate_config(raw)
    yaml_text = yaml.safe_dump(raw)
    result = run_pipeline(config, yaml_text)
    return TrackedRun(uri, result.run_id, result, config, workdir)


@pytest.fixture(scope="session")
def inline_run(tmp_path_factory) -> TrackedRun:
    """4 quickstart steps in this process (no Ray), tracked to a fresh sqlite MLflow store; figures and
    recorded input batches every 2 steps (steps 0 and 2)."""
    from rlpipe.engine.planning.config_io import validate_config
    from rlpipe.engine.runtime import run_pipeline

    workdir = tmp_path_factory.mktemp("inline_run")
    uri = f"sqlite:///{workdir}/mlflow.db"
    raw = quickstart_raw(
        name="inline-lineage", data={"prompts_per_step": 4},
        trainer={"total_steps": 4, "output_dir": str(workdir / "outputs")},
        tracking={"uri": uri, "experiment": "rlpipe-lineage", "sample_trajectories": 4, "figures_every": 2,
                  "record_batches_every": 2},
    )
    config = validate_config(raw)
    result = run_pipeline(config, yaml.safe_dump(raw), inline=True)
    return TrackedRun(uri, result.run_id, result, config, workdir)
