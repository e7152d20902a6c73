"""resources.colocate (verl's hybrid engine): roles sharing one Ray actor per rank.

The plan check refuses what cannot run, naming the field and the fix; on Ray a colocated sync run computes
exactly what the in-process run computes, its step is one call of the shared worker, and its weight push
stays in that process's memory."""

from __future__ import annotations

import pytest

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError, RlpipeError

from conftest import Recorder, quickstart_raw


def _raw(tmp_path, colocate, steps: int = 3, **changes) -> dict:
    raw = quickstart_raw(data={"prompts_per_step": 4}, tracking={"enabled": False},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path)},
                         resources={"colocate": colocate}, **changes)
    stages = [s for s in raw["stages"] if s["kind"] != "update"]
    stages.append({"kind": "ref", "impl": "reference"})
    stages.append({"kind": "update", "impl": "ppo", "params": {"use_kl_loss": True, "kl_loss_coef": 0.01}})
    raw["stages"] = stages
    return raw


@pytest.mark.parametrize("colocate, changes, message", [
    ([["actor"]], {}, r"resources\.colocate\[0\] = \['actor'\]: a group shares one process between two or more roles"),
    ([["actor", "rollout"], ["rollout", "ref"]], {},
     r"resources\.colocate\[1\] = \['rollout', 'ref'\]: role 'rollout' is in more than one group"),
    ([["actor", "rollout"]], {"trainer": {"dp_size": 2}},
     r"resources\.colocate\[0\] = \['actor', 'rollout'\]: the roles need as many workers each, got actor: 2, "
     r"rollout: 1 .*make them equal or colocate fewer roles"),
    ([["actor", "critic"]], {}, r"actor and critic are both data-parallel groups"),
    ([["actor", "rollout"]], {"mode": "separate_async"}, r"resources\.colocate: colocated roles take turns in one "
                                                          r"process, which only mode sync does \(mode separate_async"),
    ([["actor", "rollout"]], {"resources": {"placement": {"actor": "node_a", "rollout": "node_b"}}},
     r"resources\.placement puts these roles on different nodes"),
])
def test_a_colocation_that_cannot_run_is_refused_naming_the_group_and_the_fix(tmp_path, colocate, changes, message):
    raw = _raw(tmp_path, colocate)
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    raw["resources"]["colocate"] = colocate
    with pytest.raises(ConfigError, match=message):
        build_plan(validate_config(raw))


def test_an_unknown_role_lists_the_known_ones(tmp_path):
    with pytest.raises(RlpipeError, match=r"actr.*known:.*actor"):
        build_plan(validate_config(_raw(tmp_path, [["actr", "rollout"]])))


def test_a_broadcast_push_between_colocated_trainer_and_engine_is_refused(tmp_path):
    raw = _raw(tmp_path, [["actor", "rollout"]])
    for stage in raw["stages"]:
        if stage["kind"] == "weight_sync":
            stage["impl"] = "broadcast"
    with pytest.raises(ConfigError, match=r"it would wait for itself\); use weight_sync object_store"):
        build_plan(validate_config(raw))


@pytest.mark.e2e
def test_a_colocated_run_on_ray_computes_what_the_in_process_run_computes(ray_session, tmp_path):
    inline, colocated = Recorder(), Recorder()
    run_pipeline(validate_config(_raw(tmp_path / "inline", [])), "", observer=inline, inline=True)
    run_pipeline(validate_config(_raw(tmp_path / "ray", [["actor", "rollout", "ref"]])), "", observer=colocated)
    assert colocated.status == "FINISHED"
    for step in range(3):
        for key in ("reward/mean", "actor/grad_norm", "actor/kl_loss", "actor/pg_loss", "generate/response_length_mean"):
            assert colocated.metrics[step][key] == inline.metrics[step][key], (step, key)
        # the push went from the trainer to the engine inside their shared process (no transport through Ray)
        assert colocated.metrics[step]["weight_sync/version"] == step + 1
    records = {(r.step, r.node): r for r in colocated.records}
    for step in range(3):
        # the whole step up to the push was one call of the shared worker, which the lineage names with every
        # role it hosts; the task nodes between the roles' nodes ran in that call
        shared = records[(step, "generate")].worker
        assert shared.startswith("actor+rollout+ref×1@")
        for node in ("old_log_prob", "ref", "update"):
            assert records[(step, node)].worker == shared, node
        for node in ("reward", "balance", "advantage"):
            assert records[(step, node)].worker == f"task in {shared}", node
        # the push was the shared worker's last act of that call: export, bump and load in its memory
        assert records[(step, "weight_sync")].worker == f"driver in {shared}"
