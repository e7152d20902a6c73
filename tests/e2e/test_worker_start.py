"""Starting the workers on Ray: what they ask for is checked against the cluster before any starts (a worker
asking for a GPU or a node resource the cluster lacks would stay pending forever), and the start is bounded by
resources.worker_start_timeout_s."""

from __future__ import annotations

import time

import pytest
import ray

from rlpipe.engine.execution import worker_pool
from rlpipe.engine.execution.ray_runtime import RayBackend
from rlpipe.engine.execution.worker_start import WorkerStartTimeout
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.errors import ConfigError

from conftest import quickstart_raw

pytestmark = pytest.mark.e2e


def our_actors() -> list[str]:
    """rlpipe's live worker actors (named rlpipe:<role>:<rank>:<tag>) other than the idle ones kept from finished
    runs (tests/conftest.py's ray_session keeps them: rlpipe.engine.execution.worker_pool)."""
    kept = set(worker_pool.kept())
    return [name for name in ray.util.list_named_actors() if name.startswith("rlpipe:") and name not in kept]


@pytest.mark.parametrize("resources, message", [
    ({"device": "cuda", "gpus_per_worker": 0.5},
     r"^resources.gpus_per_worker=0.5: the model-holding workers \(actor×1, ref×1\) ask Ray for 1 GPU in all and "
     r"this Ray cluster has 0; lower resources.gpus_per_worker"),
    ({"placement": {"ref": "node_b"}},
     r"^resources.placement.ref: no node of this Ray cluster has the resource 'node_b' \(start that node with "
     r"`ray start --resources '\{\"node_b\": 1\}'`\); its custom resources: none"),
])
def test_workers_ray_could_never_place_are_refused_before_any_starts(ray_session, resources, message):
    config = validate_config(quickstart_raw(resources=resources, tracking={"enabled": False}))
    with pytest.raises(ConfigError, match=message):
        RayBackend.start(config, {"actor", "ref"})
    assert our_actors() == []  # refused before any worker was created


def test_a_start_past_its_bound_names_the_workers_and_the_field(ray_session):
    raw = quickstart_raw(resources={"worker_start_timeout_s": 0.001}, tracking={"enabled": False})
    with pytest.raises(WorkerStartTimeout, match=r"worker\(s\) actor\[0\] did not start within "
                                                 r"resources.worker_start_timeout_s=0.001 s .* -o resources."
                                                 r"worker_start_timeout_s=SECONDS"):
        RayBackend.start(validate_config(raw), {"actor"})
    deadline = time.monotonic() + 30  # the failed start shut its workers down
    while our_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert our_actors() == []
