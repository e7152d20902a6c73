"""pipelines/reward_families.yaml (rule + discriminative RM + judge, weighted) runs 3 steps on Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.engine.planning.config_io import load_pipeline
from rlpipe.engine.runtime import run_pipeline

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_reward_families_pipeline_runs_on_ray(ray_session, tmp_path):
    config, text = load_pipeline(ROOT / "pipelines/reward_families.yaml", [
        "trainer.total_steps=3", f"trainer.output_dir={tmp_path}", "tracking.enabled=false",
    ])
    from tests.conftest import Recorder

    seen, recorder = [], Recorder()
    run_pipeline(config, text, on_step=lambda step, m: seen.append(m), observer=recorder)
    assert len(seen) == 3
    for m in seen:  # every family reported its own metric; the weighted sum is the headline
        assert {"reward/rule/mean", "reward/reward_model/mean", "reward/judge/mean"} <= set(m)
        assert 0.0 <= m["reward/rule/mean"] <= 1.0 and 0.0 <= m["reward/judge/mean"] <= 1.0
        assert m["reward/infra_failures"] < 32  # not every trajectory failed
    for batch in recorder.batches.values():  # ...and its own column; reward = 1.0·rule + 0.1·RM + 0.2·judge
        ok = [s != "failed" for s in batch.column("status").to_pylist()]
        parts = zip(*(batch.column(c).to_pylist() for c in ("reward", "reward_rule", "reward_rm", "judge_score")))
        for valid, (reward, rule, rm, judge) in zip(ok, parts):
            assert reward == pytest.approx(1.0 * rule + 0.1 * rm + 0.2 * judge if valid else 0.0, rel=1e-4, abs=1e-5)


def test_reward_pool_serves_separate_async(ray_session, tmp_path, monkeypatch):
    """In separate_async the replicas keep generating into the buffer while the pool (its own actor)
    scores; a slow judge (latency_s) delays scoring, not generation. The rule family is a custom
    function given by a path relative to the driver's directory: the pool actor gets its source."""
    import yaml

    from rlpipe.engine.planning.config_io import validate_config

    raw = yaml.safe_load((ROOT / "pipelines/reward_families.yaml").read_text())
    raw.update(mode="separate_async", mode_params={"max_off_policy_threshold": 4, "strategy": "drop"},
               tracking={"enabled": False})
    raw["trainer"].update(total_steps=2, ppo_mini_batch_size=4, parameter_sync_step=2, output_dir=str(tmp_path))
    reward = next(s for s in raw["stages"] if s["kind"] == "reward")
    reward["params"]["judge"]["latency_s"] = 0.2
    (tmp_path / "my_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(solution_str == ground_truth), 'is_digits': float(solution_str.isdigit())}\n")
    monkeypatch.chdir(tmp_path)
    reward["params"]["rule"] = {"function": {"path": "my_reward.py", "name": "score"}}
    raw["stages"].insert(2, {"kind": "staleness_guard", "impl": "max_staleness"})
    from tests.conftest import Recorder

    seen, recorder = [], Recorder()
    run_pipeline(validate_config(raw), yaml.safe_dump(raw), on_step=lambda step, m: seen.append(m), observer=recorder)
    assert len(seen) == 2 and all("reward/mean" in m for m in seen)
    rewards = [r for r in recorder.records if getattr(r, "node", None) == "reward"]
    assert rewards and all("reward/judge/mean" in r.metrics for r in rewards), recorder.records[:3]
    # scored through the rollout replica's feeder (it called the pool without waiting), not by the driver
    assert all(r.worker.startswith("rollout[") for r in rewards), {r.worker for r in rewards}
    assert all("reward/is_digits/mean" in r.metrics for r in rewards)
