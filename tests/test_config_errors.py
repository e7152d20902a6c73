"""Broken pipeline YAMLs: each fails before anything starts, with a message naming the field and the fix."""

from __future__ import annotations

import re
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
    "unknown_impl.yaml": (PlanError, r"stages\[4:advantage\]: unknown stage\.advantage 'grpoo'; "
                                     r"did you mean 'grpo'\?; known: .*grpo"),
    "bad_params.yaml": (ConfigError, r"stages\[0:generate\]\.params\.temprature: unknown param; did you mean "
                                    r"'temperature'\? allowed: .*temperature"),
    "missing_writer.yaml": (PlanError, r"update \(update/ppo\) reads column 'ref_logprobs' but no stage writes it; add a stage that writes it: ref/reference"),
    "missing_kind.yaml": (PlanError, r"no stage of kind balance"),
    "two_writers.yaml": (PlanError, r"two writers of column 'old_logprobs': old_log_prob \(old_log_prob/trainer\) and old_log_prob_again "
                                   r"\(old_log_prob/bypass\); remove one, or give old_log_prob_again `after: \[old_log_prob\]`"),
    "bad_mode.yaml": (RlpipeError, r"unknown mode 'synchronous'; known: .*sync"),
    "bad_batch_arithmetic.yaml": (ConfigError, r"prompts_per_step=16 is not a multiple of trainer\.ppo_mini_batch_size=5"),
    # issue 14 part 4: what validate checks without starting Ray
    "readonly_output_dir.yaml": (ConfigError, r"trainer\.output_dir '/proc/self/rlpipe-outputs' is not writable .*"
                                              r"point trainer\.output_dir at a writable folder"),
    "long_name.yaml": (ConfigError, r"name: String should have at most 100 characters \(got 'xxx.*\.\.\. \(300 long\)\)"),
    "negative_seed.yaml": (ConfigError, r"seed: Input should be greater than or equal to 0 \(got -1\)"),
    "bool_total_steps.yaml": (ConfigError, r"trainer\.total_steps: expected a number, got the boolean true; write a number"),
    "quoted_total_steps.yaml": (ConfigError, r"trainer\.total_steps: expected an integer, got the string '5'; write "
                                             r"the number without quotes"),
    "missing_dataset_file.yaml": (ConfigError, r"dataset file 'tests/fixtures/data/does_not_exist\.jsonl' does not exist"
                                               r".*fix data\.params\.path"),
    "dataset_rows_without_field.yaml": (ConfigError, r"no_prompt_field\.jsonl:1: no field 'prompt'; fields: "
                                                     r"\['question', 'ground_truth', 'data_source'\]"),
    "bad_scorer_params.yaml": (ConfigError, r"scorer_params\.code\.timeout_s: Input should be a valid number "
                                            r"\(got 'ten seconds'\)"),
    "non_utf8_yaml.yaml": (ConfigError, r"non_utf8_yaml\.yaml: not UTF-8 text \(byte 0xe9 on line 1\); save the "
                                        r"pipeline YAML as UTF-8"),
    "non_utf8_dataset.yaml": (ConfigError, r"latin1\.jsonl:1: not UTF-8 text \(byte 0xe9 at column 16\); convert the "
                                           r"file to UTF-8"),
    "too_long_for_positions.yaml": (ConfigError, r"data\.max_prompt_length \(64\) \+ stages\[generate\]\.params\.max_tokens "
                                                 r"\(8\) = 72 exceeds the model's 32 positions"),
    "urls_not_one_per_replica.yaml": (ConfigError, r"stages\[generate\]\.params\.server\.urls names 1 server\(s\) "
                                                  r"for resources\.rollout_replicas=2; give one address per rollout replica"),
    "lora_too_few_adapter_slots.yaml": (ConfigError, r"stages\[generate\]\.params\.server\.max_loras=2: a LoRA run on "
                                                    r"vLLM needs an adapter slot per policy version .* set max_loras to 3"),
    # issue 23 item 4: what a verl/TRL user's job gets wrong, caught by validate
    "prompt_longer_than_max.yaml": (ConfigError, r"data: the prompt of tests/fixtures/data/long_prompts\.jsonl:2 of dataset 'jsonl' has 16 tokens > "
                                                 r"data\.max_prompt_length=8 \(2 of the 3 rows checked are too long\)"),
    "unrouted_data_source.yaml": (ConfigError, r"stages\[reward\]: no scorer for data_source\(s\) \['mystery_math'\]"),
    "chat_prompts_without_template.yaml": (ConfigError, r"prompts of dataset 'jsonl' are lists of chat messages; set "
                                                        r"data\.apply_chat_template: true"),
    "missing_model_folder.yaml": (ConfigError, r"^model\.path '/nonexistent/Qwen2\.5-0\.5B-Instruct' is not a folder on "
                                               r"this machine"),
    "grpo_with_one_sample.yaml": (ConfigError, r"advantage 'grpo' compares each sample with the other samples of its "
                                               r"prompt, but stages\[generate\]\.params\.n is 1: set it to 2 or more"),
    # issue 25 item 3: configs that would cost minutes and gigabytes are refused before anything reads them
    "alias_bomb.yaml": (ConfigError, r"stages\[1:reward\]\.params\.scorer_params\.code\.f expands to 1,111,111 values "
                                     r"with its YAML aliases \(at most 100,000\); aliases repeated inside aliases\?"),
    "recursive_alias.yaml": (ConfigError, r"a YAML alias refers to a value that contains it; write the value out"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_broken_fixture_fails_with_its_message(name, monkeypatch):
    monkeypatch.chdir(FIXTURES.parents[1])  # dataset paths in fixtures are relative to the repository root
    error, pattern = CASES[name]
    with pytest.raises(error, match=pattern):
        config, _ = load_pipeline(FIXTURES / name)
        build_plan(config)


def test_every_fixture_is_covered():
    assert sorted(p.name for p in FIXTURES.glob("*.yaml")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_cli_exits_nonzero_with_the_error(name, capsys):
    assert main(["validate", str(FIXTURES / name)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err
    if "[" in CASES[name][1]:  # a bracketed field name (stages[reward]) is printed, not taken for markup
        assert re.search(CASES[name][1].lstrip("^"), " ".join(err.split())), err


def test_a_pipeline_file_of_data_size_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text((FIXTURES / "negative_seed.yaml").read_text() + "#" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"big\.yaml: 1\.0 MiB; a pipeline YAML holds settings, not data \(at most 1 "
                                          r"MiB\): name data files by path"):
        load_pipeline(big)


def test_a_config_error_lists_at_most_20_problems_each_cut_to_a_bounded_line():
    from rlpipe.engine.planning.config_io import validate_config

    raw = {"model": {"architecture": {}}, "tokenizer": {"chars": "01"}, "stages": [],
           **{f"field_{i}_" + "x" * 5000: 1 for i in range(30)}}
    with pytest.raises(ConfigError) as caught:
        validate_config(raw)
    lines = str(caught.value).splitlines()[1:]
    assert len(lines) == 21 and lines[-1].strip() == "... and 10 more"
    assert all(len(line) < 460 for line in lines) and lines[0].endswith("characters, cut)")


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


@pytest.mark.slow
def test_validate_never_starts_ray():
    """issue 14 part 4: every check above runs without Ray (it is not even imported)."""
    import subprocess
    import sys

    script = ("import sys\nfrom pathlib import Path\nfrom rlpipe.cli import main\n"
              f"codes = [main(['validate', str(p)]) for p in sorted(Path({str(FIXTURES)!r}).glob('*.yaml'))]\n"
              "print(sorted(set(codes)), 'ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=FIXTURES.parents[1])
    assert out.stdout.strip().splitlines()[-1] == "[2] False", out.stdout[-2000:] + out.stderr[-2000:]
