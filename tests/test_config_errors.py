"""Broken pipeline YAMLs: each fails before anything starts, with a message naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.cli import main
from rlpipe.engine.planning.config_io import apply_override, load_pipeline
from rlpipe.engine.planning.plan import build_plan
from rlpipe.errors import ConfigError, PlanError, RlpipeError

FIXTURES = Path(__file__).parent / "fixtures"

CASES = {
    "bad_yaml_syntax.yaml": (ConfigError, r"not valid YAML at line \d+"),
    "unknown_field.yaml": (ConfigError, r"trainer\.total_step: unknown field; did you mean 'total_steps'\?"),
    "two_model_sources.yaml": (ConfigError, r"model.*exactly one of `path`.*or `architecture`"),
    "unknown_impl.yaml": (PlanError, r"stages\[4:advantage\]: unknown stage\.advantage 'grpoo'; known: .*grpo"),
    "bad_params.yaml": (ConfigError, r"stages\[0:generate\]\.params\.temprature: unknown param; allowed: .*temperature"),
    "missing_writer.yaml": (PlanError, r"update \(update/ppo\) reads column 'ref_logprobs' but no stage before it writes it; add a stage that writes it: ref/reference"),
    "missing_kind.yaml": (PlanError, r"no stage of kind balance"),
    "two_writers.yaml": (PlanError, r"two writers of column 'old_logprobs'.*old_log_prob and old_log_prob_again"),
    "bad_mode.yaml": (RlpipeError, r"unknown mode 'synchronous'; known: .*sync"),
    "bad_batch_arithmetic.yaml": (ConfigError, r"prompts_per_step=16 is not a multiple of trainer\.ppo_mini_batch_size=5"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_broken_fixture_fails_with_its_message(name):
    error, pattern = CASES[name]
    with pytest.raises(error, match=pattern):
        config, _ = load_pipeline(FIXTURES / name)
        build_plan(config)


def test_every_fixture_is_covered():
    assert sorted(p.name for p in FIXTURES.glob("*.yaml")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_cli_exits_nonzero_with_the_error(name, capsys):
    assert main(["validate", str(FIXTURES / name)]) == 2
    assert "error:" in capsys.readouterr().err


def test_missing_file_says_so():
    with pytest.raises(ConfigError, match="does not exist"):
        load_pipeline(FIXTURES / "nope.yaml")


def test_overrides_address_nested_fields_and_stages_by_name():
    raw = {"trainer": {"optimizer": {"lr": 1.0}}, "stages": [{"kind": "update", "impl": "ppo"}]}
    apply_override(raw, "trainer.optimizer.lr=0.5")
    apply_override(raw, "stages.update.params.clip_ratio=0.1")
    apply_override(raw, "data.prompts_per_step=4")
    assert raw["trainer"]["optimizer"]["lr"] == 0.5
    assert raw["stages"][0]["params"] == {"clip_ratio": 0.1}
    assert raw["data"] == {"prompts_per_step": 4}
    with pytest.raises(ConfigError, match="no stage named 'critic'; stages are: update"):
        apply_override(raw, "stages.critic.params.x=1")
    with pytest.raises(ConfigError, match="must look like dotted.key=value"):
        apply_override(raw, "trainer.total_steps")
