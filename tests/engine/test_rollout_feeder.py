"""The rollout feeder (separate_async's replica-side loop) and the thread-shared sampler it talks to."""

import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from rlpipe.schemas.batch import REWARD, STATUS, TOKEN_REWARDS, column_type
from rlpipe.stages.generate import GenerateParams, generate, generation_seed
from test_rollout_service import TOK, model, prompts, wait_for

from rlpipe.inference.embedded import EmbeddedEngine
from rlpipe.engine.tracking.lineage import fingerprint
from rlpipe.engine.state.replay_buffer import ReplayBuffer, ReplayBufferParams
from rlpipe.engine.state.rollout_feeder import HeadStage, RolloutFeeder, SamplerClient
from rlpipe.engine.state.rollout_service import RolloutService
from rlpipe.engine.state.sampler import SharedSampler
from rlpipe.errors import StageError
from rlpipe.stage import StageContext

GEN = GenerateParams(n=2, max_tokens=6, temperature=1.0)
REWARD_NODE = HeadStage("reward", "reward", "rule", {"default_scorer": "exact_match"},
                        {REWARD: column_type(REWARD), TOKEN_REWARDS: column_type(TOKEN_REWARDS),
                         STATUS: column_type(STATUS)})


def seed_of(step):
    return generation_seed(StageContext(step=step, seed=5))


@pytest.fixture
def rig():
    """A real engine + service, a real replay buffer shared by threads, and a feeder between them."""
    made = []

    def make(head=(REWARD_NODE,), store_groups=1, threshold=8, max_groups=8):
        service = RolloutService(EmbeddedEngine(model(), TOK), TOK)
        buffer = SharedSampler(ReplayBuffer(ReplayBufferParams(group_size=GEN.n, groups_per_step=5,
                                                               max_off_policy_threshold=threshold)))
        feeder = RolloutFeeder(service, SamplerClient(buffer), list(head), GEN.model_dump(), seed_of,
                               max_groups=max_groups, store_groups=store_groups, poll_s=0.01, run_seed=5)
        made.append((feeder, service))
        return feeder, service, buffer

    yield make
    for feeder, service in made:
        feeder.stop()
        service.shutdown()


def test_feeder_generates_scores_and_stores_what_the_generate_stage_would(rig):
    _, _, buffer = rig()
    buffer.add_prompts(prompts(), 3)
    batch = buffer.sample_wait(5, 3, timeout=30)
    assert batch is not None and batch.num_rows == 10
    # the same tokens as the synchronous generate stage at the prompts' submission step
    sync = generate(type("W", (), {"engine": EmbeddedEngine(model(), TOK), "tokenizer": TOK})(),
                    prompts(), GEN, StageContext(step=3, seed=5)).table
    key = lambda t: t.sort_by([("uid", "ascending"), ("sample_index", "ascending")])
    for column in ("uid", "sample_index", "response_ids", "rollout_logprobs", "token_versions"):
        assert key(batch).column(column).equals(key(sync).column(column)), column
    # ...scored in the replica: exact_match of the response text against ground_truth
    texts, truths = batch.column("response_text").to_pylist(), batch.column("ground_truth").to_pylist()
    assert batch.column(REWARD).to_pylist() == [float(a.strip() == b.strip()) for a, b in zip(texts, truths)]
    assert batch.column("prompt_step").to_pylist() == [3] * 10


def test_lineage_records_chain_generate_to_reward(rig):
    feeder, _, buffer = rig(store_groups=5)
    buffer.add_prompts(prompts(), 0)
    assert buffer.sample_wait(5, 0, timeout=30) is not None
    report = feeder.drain()
    records = report["records"]
    assert [r["node"] for r in records][:2] == ["generate", "reward"]
    assert sum(r["rows_out"] for r in records if r["node"] == "generate") == 10
    for generated, scored in zip(records[::2], records[1::2]):
        assert scored["input_fingerprint"] == generated["output_fingerprint"]
        assert scored["rows_in"] == scored["rows_out"] == generated["rows_out"]
        assert scored["policy_versions"] == [0] and "reward/mean" in scored["metrics"]
    assert report["counts"]["stored_groups"] == 5 and report["counts"]["pulled"] == 5
    # the prompts this replica generated, for the driver's trajectory lineage (which replica made a trajectory)
    assert sorted(report["uids"]) == sorted(prompts().column("uid").to_pylist())
    again = feeder.drain()
    assert again["records"] == [] and again["uids"] == []  # drained once


def test_a_failing_reward_stage_reaches_the_driver_with_kind_impl_and_step(rig):
    unroutable = HeadStage("reward", "reward", "rule", {}, REWARD_NODE.writes)  # data_source 'digits' has no scorer
    feeder, _, buffer = rig(head=[unroutable])
    table = prompts().set_column(1, "data_source", pa.array(["nowhere"] * 5))
    buffer.add_prompts(table, 4)
    wait_for(lambda: feeder._error is not None, timeout=30)
    with pytest.raises(StageError) as err:
        feeder.drain()
    assert "reward" in str(err.value) and "rule" in str(err.value) and "step 4" in str(err.value)
    assert "routes" in str(err.value)  # the stage's own advice survives
    assert buffer.counts()["finished"] == 0  # nothing half-scored was stored


def test_the_feeder_respects_its_group_limit(rig):
    # the limit is the feeder's from the start: an idle feeder's ask for prompts waits in the buffer with the room
    # it had when it asked
    feeder, service, buffer = rig(max_groups=2)
    many = pa.concat_tables([prompts(prefix=p) for p in "abc"])  # 15 prompts
    buffer.add_prompts(many, 0)
    seen = []
    deadline = time.monotonic() + 30
    while buffer.counts()["finished"] < 15 and time.monotonic() < deadline:
        seen.append(service.in_service())
        time.sleep(0.001)
    assert buffer.counts()["finished"] == 15
    assert max(seen) <= 2


def test_sample_wait_blocks_until_another_thread_stores_and_times_out_otherwise():
    buffer = SharedSampler(ReplayBuffer(ReplayBufferParams(group_size=1, groups_per_step=1)))
    buffer.add_prompts(prompts(("1",)), 0)
    start = time.monotonic()
    assert buffer.sample_wait(1, 0, timeout=0.05) is None
    assert time.monotonic() - start >= 0.05
    taken = buffer.next_pending(1)
    rows = taken.append_column("sample_index", pa.array([0], pa.int32())).append_column(
        "status", pa.array(["ok"])).append_column(REWARD, pa.array([1.0], pa.float32()))
    threading.Timer(0.1, lambda: buffer.exchange(rows, 0)).start()
    start = time.monotonic()
    batch = buffer.sample_wait(1, 0, timeout=10)
    assert batch is not None and batch.column("uid").to_pylist() == ["p0"]
    assert 0.05 < time.monotonic() - start < 5


def test_exchange_stores_then_hands_out_pending_prompts_in_one_call():
    buffer = SharedSampler(ReplayBuffer(ReplayBufferParams(group_size=1, groups_per_step=2)))
    buffer.add_prompts(prompts(("1", "2", "3")), 0)
    completed, first = buffer.exchange(None, 1)
    assert completed == 0 and first.column("uid").to_pylist() == ["p0"]
    rows = first.append_column("sample_index", pa.array([0], pa.int32())).append_column("status", pa.array(["ok"]))
    completed, rest = buffer.exchange(rows, 5)
    assert completed == 1 and rest.column("uid").to_pylist() == ["p1", "p2"]
    assert buffer.counts() == {"pending": 0, "running": 2, "finished": 1}
    assert fingerprint(rest) == fingerprint(rest.combine_chunks())
    assert all(c.num_chunks == 1 for c in rest.columns)  # handed out contiguous (cheap to send)
    np.testing.assert_array_equal(rest.column("prompt_step").to_numpy(), [0, 0])


def test_an_idle_exchange_waits_in_the_buffer_until_prompts_arrive_or_its_wait_ends():
    buffer = SharedSampler(ReplayBuffer(ReplayBufferParams(group_size=1, groups_per_step=2)))
    start = time.monotonic()
    completed, none = buffer.exchange(None, 2, 0.05)  # nothing comes: empty after the wait
    assert completed == 0 and none.num_rows == 0 and time.monotonic() - start >= 0.05
    threading.Timer(0.1, lambda: buffer.add_prompts(prompts(("1", "2", "3")), 0)).start()
    start = time.monotonic()
    _, got = buffer.exchange(None, 2, 10.0)  # woken by the driver's add, not by its own deadline
    assert got.column("uid").to_pylist() == ["p0", "p1"] and 0.05 < time.monotonic() - start < 5
    start = time.monotonic()
    _, none = buffer.exchange(None, 0, 10.0)  # no room: never waits
    assert none.num_rows == 0 and time.monotonic() - start < 1
