"""The reward pool called without waiting: the separate_async feeder keeps pulling and generating while the
pool scores, and a pool call past its deadline (or to a dead worker) stores infrastructure failures."""

import time

import pytest
from test_rollout_service import TOK, model, prompts, wait_for

from rlpipe.engine.state.pool_client import PoolClient
from rlpipe.engine.state.replay_buffer import ReplayBuffer, ReplayBufferParams
from rlpipe.engine.state.reward_pool import RewardPoolState
from rlpipe.engine.state.rollout_feeder import HeadStage, RolloutFeeder, SamplerClient
from rlpipe.engine.state.rollout_service import RolloutService
from rlpipe.engine.state.sampler import SharedSampler
from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.schemas.config import PipelineConfig
from rlpipe.stage import StageContext
from rlpipe.stages.generate import GenerateParams, generate, generation_seed
from rlpipe.stages.judge import Judge
from rlpipe.stages.reward_families import WeightedRewardParams, _writes
from tests.conftest import quickstart_raw
from tests.stages.test_reward_families import ARCH, constant_model

GEN = GenerateParams(n=2, max_tokens=4, temperature=1.0)
SLOW = ("import time\ndef score(data_source, solution_str, ground_truth, extra_info):\n"
        "    time.sleep({s})\n    return 0.25\n")


def weighted(tmp_path, judge_latency_s=0.0, rule_sleep_s=0.0, call_timeout_s=60.0, judge_timeout_s=30.0):
    """(pool config, head node) of a reward/weighted stage: a custom rule function scoring 0.25 (after
    ``rule_sleep_s``) + a judge that always answers 7 → 0.7 (after ``judge_latency_s``)."""
    (tmp_path / "rule.py").write_text(SLOW.replace("{s}", str(rule_sleep_s)))
    params = WeightedRewardParams.model_validate({
        "rule": {"function": {"path": str(tmp_path / "rule.py"), "name": "score"}},
        "judge": {"model": {"architecture": ARCH}, "max_tokens": 1, "score_pattern": r"(\d)", "max_score": 10,
                  "latency_s": judge_latency_s, "timeout_s": judge_timeout_s},
        "weights": {"rule": 1.0, "judge": 1.0}, "call_timeout_s": call_timeout_s})
    raw = quickstart_raw(tokenizer={"chars": "abcdefgh 0123456789+="})
    raw["stages"] = [s if s["kind"] != "reward" else {"kind": "reward", "impl": "weighted",
                                                      "params": params.model_dump()} for s in raw["stages"]]
    node = HeadStage("reward", "reward", "weighted", params.model_dump(), _writes(params), 600.0, "reward_model")
    return PipelineConfig.model_validate(raw), node


def pool_worker(config):
    state = RewardPoolState(config, 0, 1, None)
    state.judge = Judge(state.judge.cfg, state.tokenizer, model=constant_model(state.tokenizer, "7"))
    return state


@pytest.fixture
def rig():
    made = []

    def make(node, worker, max_groups=8, workers=1):
        service = RolloutService(EmbeddedEngine(model(), TOK), TOK)
        buffer = SharedSampler(ReplayBuffer(ReplayBufferParams(group_size=GEN.n, groups_per_step=3)))
        feeder = RolloutFeeder(service, SamplerClient(buffer), [node], GEN.model_dump(),
                               lambda step: generation_seed(StageContext(step=step, seed=5)), max_groups=max_groups,
                               store_groups=1, poll_s=0.01, run_seed=5,
                               pools={"reward_model": PoolClient([worker] * workers)})
        made.append((feeder, service, worker))
        return feeder, service, buffer

    yield make
    for feeder, service, worker in made:
        feeder.stop()
        service.shutdown()
        worker.close()


def test_the_feeder_keeps_pulling_and_generating_while_the_pool_scores(rig, tmp_path):
    config, node = weighted(tmp_path, judge_latency_s=2.0)
    feeder, service, buffer = rig(node, pool_worker(config))
    buffer.add_prompts(prompts(("1+2=",)), 0)
    records = []

    def counts():
        report = feeder.drain()
        records.extend(report["records"])
        return report["counts"]

    wait_for(lambda: counts()["pulled"] == 1 and service.in_service() == 0, timeout=30)  # group 1 is at the pool
    generated = service.stats()["tokens_generated"]
    buffer.add_prompts(prompts(("abc", "88"), prefix="q"), 0)
    # a feeder blocked on the judge could neither pull these nor hand them to the engine for 2 s; this one
    # pulls them and the engine generates them (they wait in the service for the busy pool worker)
    wait_for(lambda: counts()["pulled"] == 3 and service.stats()["groups_ready"] == 2, timeout=1.5)
    assert buffer.counts()["finished"] == 0  # ...and the first group is still being judged
    assert service.stats()["tokens_generated"] > generated
    batch = buffer.sample_wait(3, 0, timeout=30)
    assert batch is not None and batch.num_rows == 6
    counts()
    # the two groups that finished while the pool was busy went to it together, in one call
    assert [r["rows_in"] for r in records if r["node"] == "reward"] == [2, 4]
    # by hand: rule 0.25 + judge "7" / 10 = 0.95 on every row, each family in its own column
    assert batch.column("reward").to_pylist() == pytest.approx([0.95] * 6)
    assert batch.column("reward_rule").to_pylist() == pytest.approx([0.25] * 6)
    assert batch.column("judge_score").to_pylist() == pytest.approx([0.7] * 6)
    assert "failed" not in batch.column("status").to_pylist()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_pool_call_past_its_deadline_stores_failed_rows_instead_of_hanging(rig, tmp_path, workers):
    # the custom rule function hangs for 3 s: no in-worker deadline covers it, the pool call's does
    config, node = weighted(tmp_path, rule_sleep_s=3.0, call_timeout_s=0.5, judge_timeout_s=0.2)
    feeder, service, buffer = rig(node, pool_worker(config), workers=workers)  # rows split over the workers
    start = time.monotonic()
    buffer.add_prompts(prompts(("1+2=",)), 0)
    records = []
    wait_for(lambda: records.extend(r for r in feeder.drain()["records"] if r["node"] == "reward") or records,
             timeout=2.5)  # the worker itself would answer only after 3 s
    assert time.monotonic() - start < 2.5
    assert records[0]["metrics"]["reward/pool_unanswered"] == 2.0  # counts are summed over the workers
    assert records[0]["metrics"]["reward/infra_failures"] == 2.0
    # stored as an all-failed group: the buffer evicts it (DAPO and advantages never see it) and counts it
    wait_for(lambda: buffer.metrics(0)["sampler/evicted_failed_total"] == 1.0, timeout=5)
    assert buffer.counts()["finished"] == 0


def test_call_timeout_must_exceed_the_inner_deadlines(tmp_path):
    with pytest.raises(ValueError, match=r"call_timeout_s=10 must exceed judge.timeout_s \+ reward_model.timeout_s"):
        weighted(tmp_path, call_timeout_s=10.0)


def test_a_dead_pool_worker_is_an_infrastructure_failure(ray_session, tmp_path):
    from rlpipe.engine.execution.ray_worker import WorkerActor

    config, node = weighted(tmp_path, rule_sleep_s=30.0)
    actor = WorkerActor.remote("reward_model", 0, 1, config.model_dump(mode="json"), None)
    ray_session.get(actor.ready.remote())
    client = PoolClient([actor])
    worker = type("W", (), {"engine": EmbeddedEngine(model(), TOK), "tokenizer": TOK})()
    rows = generate(worker, prompts(("1+2=",)), GEN, StageContext(step=0, seed=5)).table
    call = client.submit(node, rows, StageContext(step=0, seed=5))
    ray_session.kill(actor)
    wait_for(call.ready, timeout=30)
    result = call.result()
    assert result.columns["status"].to_pylist() == ["failed", "failed"]
    assert result.metrics["reward/pool_unanswered"] == 2.0


def test_merged_worker_results_sum_counts_and_average_the_rest():
    from rlpipe.engine.stage_call import merge_results
    from rlpipe.stage import StageResult

    a = StageResult(metrics={"reward/mean": 0.5, "reward/infra_failures": 1.0}, counts=frozenset({"reward/infra_failures"}))
    b = StageResult(metrics={"reward/mean": 1.0, "reward/infra_failures": 2.0}, counts=frozenset({"reward/infra_failures"}))
    merged = merge_results([a, b], [], creates_rows=False)
    assert merged.metrics == {"reward/mean": 0.75, "reward/infra_failures": 3.0}
    assert merge_results([StageResult(metrics={"x": 1.0}), StageResult(metrics={"x": 3.0})], [], False).metrics == {"x": 2.0}
