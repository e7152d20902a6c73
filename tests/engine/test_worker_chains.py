"""Worker chains on Ray (resources.task_stages_in_workers): a role with one worker runs its nodes and the task nodes
next to them in one call, and one chain hands its last table straight to the next worker's chain (Ray moves it
worker to worker; the driver rebuilds it from the chain's results for the lineage).

Checked: separate workers compute exactly what the in-process run computes, through three handoffs a step; a
chain that failed hands nothing on, so the chain after it runs nothing; a handed table is the table the driver
would have sent; the next step's first chain (sync: generation; separate_async: the trainer's, on a batch sampled
when the push is done) runs while the driver ends the step."""

from __future__ import annotations

import time

import pytest

from rlpipe.engine.execution.executor import StepExecutor
from rlpipe.engine.execution.physical_plan import StaticPlacement, describe_calls
from rlpipe.engine.execution.ray_runtime import RayBackend
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import Runtime, run_pipeline
from rlpipe.engine.state.roles import ALWAYS_ROLES
from rlpipe.engine.stage_call import ChainedStage, apply_result
from rlpipe.engine.tracking.observer import NullObserver
from rlpipe.schemas.batch import ADVANTAGES, OLD_LOGPROBS
from rlpipe.stage import StageContext

from conftest import Recorder, quickstart_raw, with_staleness_guard

pytestmark = pytest.mark.e2e


def _raw(tmp_path, steps: int = 3) -> dict:
    """The quickstart with a reference model on its own worker: rollout, trainer and reference chains a step."""
    raw = quickstart_raw(data={"prompts_per_step": 4}, tracking={"enabled": False},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path)})
    stages = [s for s in raw["stages"] if s["kind"] != "update"]
    stages.append({"kind": "ref", "impl": "reference"})
    stages.append({"kind": "update", "impl": "ppo", "params": {"use_kl_loss": True, "kl_loss_coef": 0.01}})
    raw["stages"] = stages
    return raw


def test_separate_workers_handing_batches_on_compute_what_the_in_process_run_computes(ray_session, tmp_path):
    # one Ray run for two checks (starting its three workers is most of its cost): the values, and that each
    # step's first chain (generation: sync draws the next prompts early) starts while the driver ends the step
    steps = 4
    inline, on_ray = Recorder(), SlowStepEnd()
    run_pipeline(validate_config(_raw(tmp_path / "inline", steps)), "", observer=inline, inline=True)
    run_pipeline(validate_config(_raw(tmp_path / "ray", steps)), "", observer=on_ray)
    assert on_ray.status == "FINISHED"
    for step in range(steps):
        for key in ("reward/mean", "actor/grad_norm", "actor/kl_loss", "actor/pg_loss", "generate/response_length_mean"):
            assert on_ray.metrics[step][key] == inline.metrics[step][key], (step, key)
    records = {(r.step, r.node): r for r in on_ray.records}
    in_process = {(r.step, r.node): r for r in inline.records}
    assert records.keys() == in_process.keys()
    for key, record in records.items():  # the driver rebuilt every node's input and output: the same lineage
        assert (record.input_fingerprint, record.output_fingerprint) == (
            in_process[key].input_fingerprint, in_process[key].output_fingerprint), key
    update = records[(steps - 1, "update")]  # its clocks, read in the trainer's worker on the stage's thread
    assert 0 < update.cpu_s <= update.duration_s and update.run_queue_s is not None
    assert update.cpu_s + update.run_queue_s <= update.duration_s + 1e-3
    for step in range(steps):  # each role's nodes ran in its own worker's call, the task nodes with them
        assert records[(step, "generate")].worker.startswith("rollout×1@")
        assert records[(step, "reward")].worker.startswith("task in rollout×1@")
        assert records[(step, "ref")].worker.startswith("ref×1@")
        assert records[(step, "update")].worker.startswith("actor×1@")
    early = [records[(step + 1, "generate")].start_time < on_ray.ended[step] for step in range(steps - 1)]
    assert all(early), (early, on_ray.ended)


def _chain(plan, kinds: list[str], **params) -> list[ChainedStage]:
    nodes = [n for n in plan.nodes if n.kind in kinds]
    return [ChainedStage(n.kind, n.impl, {**n.params_dict, **params.get(n.kind, {})}, dict(n.writes), n.timeout_s,
                         n.spec.role if n.spec.placement == "worker" else None) for n in nodes]


@pytest.fixture(scope="module")
def runtime(ray_session, tmp_path_factory):
    """Workers shared by the tests below (starting them is most of their cost); no test compares values with
    another run from fresh weights."""
    config = validate_config(_raw(tmp_path_factory.mktemp("chains"), steps=1))
    plan = build_plan(config)
    # and a critic, for the plan with three branches (the plans of the tests use subsets of these roles)
    backend = RayBackend.start(config, set(ALWAYS_ROLES) | plan.roles() | {"critic"})
    try:
        yield Runtime(config, plan, NullObserver(), "chains", backend)
    finally:
        backend.shutdown()


def test_the_reference_and_critic_chains_run_beside_old_log_prob_and_record_what_running_in_order_records(runtime):
    """PPO with a critic: listed after old_log_prob, the reference model (ref) and the critic's chain
    (critic_values, advantage) read nothing old_log_prob writes, nor each other's columns: both start with it, each
    on its own worker, and are recorded on old_log_prob's output. The lineage is that of the same plan run one call
    after the other (resources.concurrent_branches false), node for node. Up to the advantage: no weight changes
    between the two runs."""
    stages = [s for s in _raw(runtime.config.trainer.output_dir)["stages"] if s["kind"] not in ("ref", "advantage")]
    at = next(i for i, s in enumerate(stages) if s["kind"] == "old_log_prob") + 1
    branches = [{"kind": "ref", "impl": "reference"}, {"kind": "critic_values", "impl": "critic"},
                {"kind": "advantage", "impl": "gae"}]
    beside = {**_raw(runtime.config.trainer.output_dir),
              "stages": stages[:at] + branches + stages[at:] + [{"kind": "critic_update", "impl": "ppo"}]}
    records, prompts, plan = {}, runtime.loader.next_batch(0), build_plan(validate_config(beside))
    nodes = [n for n in plan.nodes if n.kind not in ("update", "weight_sync", "critic_update")]
    for name, concurrent in (("in order", False), ("beside", True)):  # resources.concurrent_branches
        recorder = Recorder()
        StepExecutor(plan, runtime.backend, recorder, name, 0, concurrent_branches=concurrent).run(0, prompts, nodes)
        records[name] = {r.node: r for r in recorder.records}
    assert records["beside"].keys() == records["in order"].keys()
    for node, record in records["beside"].items():
        other = records["in order"][node]
        assert (record.input_fingerprint, record.output_fingerprint) == (other.input_fingerprint,
                                                                         other.output_fingerprint), node
    span = {node: (r.start_time, r.start_time + r.duration_s) for node, r in records["beside"].items()}
    for a, b in (("ref", "old_log_prob"), ("critic_values", "old_log_prob"), ("ref", "critic_values")):
        assert span[a][0] < span[b][1] and span[b][0] < span[a][1], (a, b, span)  # at the same time
    order = {node: (r.start_time, r.start_time + r.duration_s) for node, r in records["in order"].items()}
    assert order["old_log_prob"][1] <= order["ref"][0] and order["ref"][1] <= order["critic_values"][0]  # waited
    # what rlpipe validate prints (the physical plan, from the config alone) is where each node ran
    static = StepExecutor(plan, StaticPlacement(runtime.config, set(ALWAYS_ROLES) | plan.roles()), NullObserver(),
                          "plan", 0)
    calls = describe_calls(static, nodes)
    assert [(c["nodes"], c["beside"]) for c in calls] == [
        (["generate", "reward", "balance"], False), (["old_log_prob"], False), (["ref"], True),
        (["critic_values", "advantage"], True)]
    by_name = {n.name: n for n in nodes}
    for call in calls:
        for name in call["nodes"]:
            placement = by_name[name].spec.placement
            ran = records["beside"][name].worker.split("@")[0]
            assert ran == (call["where"] if placement == "worker" or len(call["nodes"]) == 1
                           else f"{placement} in {call['where']}"), (name, ran, call)


def test_a_mode_hook_fires_between_the_calls_right_before_its_node(runtime):
    """colocate_async releases the rollout engine before the update: the trainer's fused call ends before the
    update, so the hook fires after old_log_prob .. advantage are done, not before the whole trainer call."""
    fired = []
    raw = _raw(runtime.config.trainer.output_dir, steps=1)
    raw["stages"] = quickstart_raw()["stages"]  # no reference model: the trainer's nodes in one call: old_log_prob,
    # advantage, update, weight_sync (the same workers: the plan's roles are a subset of the backend's)
    plan = build_plan(validate_config(raw))
    executor = StepExecutor(plan, runtime.backend, recorder := Recorder(), "hooks", 0)
    executor.before_role["updates_policy"] = [lambda node, step: fired.append((node.name, time.time()))]
    executor.run(0, runtime.loader.next_batch(0))
    (name, at), = fired
    ends = {r.node: (r.start_time, r.start_time + r.duration_s) for r in recorder.records}
    assert name == "update"
    assert max(end for node, (_, end) in ends.items() if node not in ("update", "weight_sync")) <= at
    assert at <= ends["update"][0]
    assert recorder.records[-1].worker.startswith("driver in actor×1")  # the push still rides the update's call


def test_a_handed_table_is_the_one_the_driver_would_send_and_a_failed_chain_hands_nothing_on(runtime):
    backend, plan = runtime.backend, runtime.plan
    prompts = runtime.loader.next_batch(0)
    rollout = _chain(plan, ["generate", "reward", "balance"])
    trainer = _chain(plan, ["old_log_prob", "advantage"])

    def ctxs(chain):  # the engine stays awake between the chains of this test (sync puts it to sleep)
        return [StageContext(step=0, seed=0, extras={"temperature": 1.0}) for _ in chain]

    first = backend.start_worker_chain("rollout", rollout, prompts, ctxs(rollout), hand_on=True)
    handed = backend.start_worker_chain("actor", trainer, first, ctxs(trainer))
    made = backend.finish_worker_chain(first)
    assert [s.error for s in made] == [None] * 3
    table = prompts
    for stage, step in zip(rollout, made):  # what the driver sends without the handoff
        table = apply_result(stage, table, step.result)
    sent = backend.run_worker_chain("actor", trainer, table, ctxs(trainer))
    got = backend.finish_worker_chain(handed)
    assert [s.error for s in got] == [None, None]
    for i, column in enumerate((OLD_LOGPROBS, ADVANTAGES)):  # the same batch in, the same values out
        assert got[i].result.columns[column].equals(sent[i].result.columns[column]), column
        assert len(got[i].result.columns[column]) == table.num_rows

    broken = _chain(plan, ["generate", "reward"], reward={"no_such_param": 1})
    first = backend.start_worker_chain("rollout", broken, prompts, ctxs(broken), hand_on=True)
    handed = backend.start_worker_chain("actor", trainer, first, ctxs(trainer))
    made = backend.finish_worker_chain(first)
    assert made[0].error is None and "no_such_param" in str(made[1].error)  # the reward stage's params refused
    assert backend.finish_worker_chain(handed) == []  # the trainer's call got nothing and ran nothing


class SlowStepEnd(Recorder):
    """An observer that takes half a second to end a step (a slow tracking store); when each step's end returned."""

    def __init__(self):
        super().__init__()
        self.ended: dict[int, float] = {}

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None):
        super().on_step_end(step, metrics, trajectories, trajectory_lineage)
        time.sleep(0.5)
        self.ended[step] = time.time()


def test_separate_async_starts_the_next_steps_training_while_the_driver_ends_the_step(ray_session, tmp_path):
    # (sync: the first test) the next batch is sampled when the push is done, if the buffer holds one by then
    raw = _raw(tmp_path, steps=4)
    raw["mode"] = "separate_async"
    raw["mode_params"] = {"max_off_policy_threshold": 2, "capacity_steps": 2}
    with_staleness_guard(raw)
    observer = SlowStepEnd()
    run_pipeline(validate_config(raw), "", observer=observer)
    assert observer.status == "FINISHED"
    starts = {r.step: r.start_time for r in observer.records if r.node == "staleness_guard"}
    early = [starts[step + 1] < observer.ended[step] for step in range(3)]
    assert any(early), (early, starts, observer.ended)
    # the driver's calls to the buffer each step, their median round trip recorded (rlpipe simulate charges it)
    assert all(observer.metrics[step]["timing/driver_call_s"] > 0 for step in range(4))
