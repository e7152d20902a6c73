"""Shared fixtures: a tiny pipeline config, a session-wide local Ray."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: one intra-op thread per process avoids oversubscription (seconds → milliseconds).
torch.set_num_threads(1)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for all end-to-end tests (starting Ray costs ~5 s)."""
    import ray

    from rlpipe.engine.ray_runtime import init_ray

    init_ray(None, 2)
    yield ray
    ray.shutdown()
