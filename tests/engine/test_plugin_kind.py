"""A stage kind rlpipe does not ship, added by one plugin file named in the YAML (plugins:), with no engine change.

pipelines/quickstart_length_penalty.yaml puts `length_penalty/linear` (pipelines/plugins/length_penalty.py) between
reward and advantage. Checked: the planner wires it there; its values are the hand formula (reward minus 0.05 per
valid response token, on the last valid token); it runs inline and on Ray with the same results and its own lineage
records; a Ray task process that never saw the file imports the source its context carries; a missing or broken
plugin file is a config error naming the file (and line) before anything starts.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import ROOT, Recorder
from rlpipe.engine.planning.config_io import load_pipeline, validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.runtime import run_pipeline
from rlpipe.errors import ConfigError

PIPELINE = ROOT / "pipelines" / "quickstart_length_penalty.yaml"
COEF = 0.05


EVAL = {"data": {"source": "digits", "params": {"task": "reverse", "num_digits": 2, "size": 8}, "prompts_per_step": 4},
        "every": 1, "params": {"generate": {"n": 2}}, "nodes": ["length_penalty"]}
"""An evaluation after each step, through the plugin's node too: the Ray run checks the eval DAG on Ray as well
(one Ray run for both: starting one is most of a test's cost)."""


def _config(tmp_path, steps: int = 2):
    config = load_pipeline(PIPELINE, [f"trainer.total_steps={steps}", "data.prompts_per_step=4",
                                      "tracking.enabled=false", f"trainer.output_dir={tmp_path}"])[0]
    return validate_config({**config.model_dump(mode="json", exclude_none=True), "eval": EVAL})


def _run(tmp_path, inline: bool) -> Recorder:
    recorder = Recorder()
    run_pipeline(_config(tmp_path), "", observer=recorder, inline=inline)
    assert recorder.status == "FINISHED"
    return recorder


def _check_penalty_and_lineage(recorder: Recorder, steps: int = 2) -> None:
    for step in range(steps):
        batch = recorder.batches[step].to_pylist()
        valid = np.array([sum(row["response_mask"]) for row in batch])
        assert len(batch) > 0
        for row, tokens in zip(batch, valid):
            last = max(i for i, m in enumerate(row["response_mask"]) if m)
            assert row["token_rewards"][last] == pytest.approx(row["reward"] - COEF * tokens, abs=1e-6)
        # the recorded rows are a sample of the step's; every response token is valid in single-turn generation
        lengths = recorder.metrics[step]["generate/response_length_mean"]
        assert recorder.metrics[step]["length_penalty/mean"] == pytest.approx(COEF * lengths)
        ran = [r.node for r in sorted(recorder.records, key=lambda r: r.start_time) if r.step == step
               and not r.node.startswith("eval.")]
        assert ran.index("reward") < ran.index("length_penalty") < ran.index("advantage")
        record = next(r for r in recorder.records if r.step == step and r.node == "length_penalty")
        assert (record.kind, record.impl, record.error) == ("length_penalty", "linear", "")


@pytest.fixture(scope="module")
def inline(tmp_path_factory) -> Recorder:
    return _run(tmp_path_factory.mktemp("inline"), inline=True)


def test_the_plugin_kind_sits_between_reward_and_advantage_and_computes_the_hand_formula_inline(inline, tmp_path):
    plan = build_plan(_config(tmp_path))
    node = {n.name: n for n in plan.nodes}
    assert node["length_penalty"].providers["token_rewards"] == "reward"
    assert node["advantage"].providers["token_rewards"] == "length_penalty"
    _check_penalty_and_lineage(inline)


@pytest.mark.e2e
def test_the_plugin_kind_and_the_eval_dag_run_on_ray_as_they_run_inline(ray_session, inline, tmp_path):
    on_ray = _run(tmp_path, inline=False)
    _check_penalty_and_lineage(on_ray)
    for step in range(2):
        for key in ("length_penalty/mean", "reward/mean", "actor/pg_loss", "eval/reward/mean", "eval/digits/pass@2"):
            assert on_ray.metrics[step][key] == inline.metrics[step][key], (step, key)
        assert on_ray.metrics[step]["eval/policy_version"] == step + 1 and on_ray.metrics[step]["eval/prompts"] == 8
        by_node = {r.node: r for r in on_ray.records if r.step == step}
        assert by_node["update"].rows_in == 4 * 8  # no eval row reaches an update
        assert by_node["update"].input_fingerprint == by_node["advantage"].output_fingerprint
    where = {r.node: r.worker.split("@")[0] for r in on_ray.records}
    assert where["length_penalty"] == where["eval.length_penalty"] == where["eval.reward"] == "task in rollout×1"
    assert where["eval.generate"] == "rollout×1"


def test_a_process_that_never_saw_the_file_runs_the_stage_from_the_source_its_context_carries(tmp_path):
    """What a Ray task worker does: the plugin is imported from StageContext.plugins, not from disk."""
    plan = build_plan(_config(tmp_path))
    plugins = [p.model_dump() for p in plan.plugins]
    script = f"""
import json, sys, os
import numpy as np, pyarrow as pa
os.chdir({str(tmp_path)!r})  # the file's relative path means nothing here
from rlpipe.plugin_files import PluginFile
from rlpipe.engine.stage_call import run_stage
from rlpipe.jagged import from_flat
from rlpipe.stage import StageContext
plugins = tuple(PluginFile.model_validate(p) for p in json.loads(sys.stdin.read()))
batch = pa.table({{"token_rewards": from_flat(np.array([0, 1, 0, 0, 0.5], np.float32), np.array([2, 3]), pa.float32()),
                   "response_mask": from_flat(np.array([1, 1, 1, 1, 0], np.int8), np.array([2, 3]), pa.int8())}})
result = run_stage("length_penalty", "linear", {{"coef": 0.1}}, batch, StageContext(step=0, seed=0, plugins=plugins))
print(json.dumps(result.columns["token_rewards"].to_pylist()))
"""
    out = subprocess.run([sys.executable, "-c", script], input=__import__("json").dumps(plugins), text=True,
                         capture_output=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = yaml.safe_load(out.stdout.strip().splitlines()[-1])
    # row 0: 2 valid tokens, penalty 0.2 on token 1; row 1: 2 valid of 3, penalty 0.2 on token 1 (the last valid)
    assert rows == [pytest.approx([0.0, 0.8]), pytest.approx([0.0, -0.2, 0.5])]


def test_a_missing_or_broken_plugin_file_is_a_config_error_naming_it(tmp_path):
    raw = yaml.safe_load(PIPELINE.read_text())
    with pytest.raises(ConfigError, match=r"plugin file 'nowhere/kinds\.py' not found .*relative to the directory "
                                          r"you launch rlpipe from"):
        validate_config({**raw, "plugins": ["nowhere/kinds.py"]})
    broken = tmp_path / "broken_kinds.py"
    broken.write_text("from rlpipe.stage_kinds import stage_kind\n\nstage_kind('x_broken', doc='x')\nraise "
                      "ValueError('no such weights')\n")
    with pytest.raises(ConfigError, match=rf"plugin file {broken}:4: ValueError: no such weights"):
        build_plan(validate_config({**raw, "plugins": [str(broken)]}))
