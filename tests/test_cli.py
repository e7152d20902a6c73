"""The command line: `rlpipe stages` lists every registered part; `rlpipe validate` checks a pipeline."""

import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest

from rlpipe.cli import main
from rlpipe.registry import registry
from rlpipe.stage_kinds import BUILTIN_KINDS

ROOT = Path(__file__).resolve().parents[1]

ESTIMATORS = ["gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
              "remax", "opo", "gpg", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"]
POLICY_LOSSES = ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl",
                 "dro", "bypass_mode"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_PENALTIES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]


def run_cli(argv: list[str]) -> tuple[int, str]:
    out = StringIO()
    with redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def stages_output() -> str:
    code, out = run_cli(["stages"])
    assert code == 0
    return out


def kind_section(output: str, kind: str) -> dict[str, tuple[str, str]]:
    """The overview's lines of stage kind ``kind``: impl -> (runs on, description)."""
    match = re.search(rf"^{re.escape(kind)}: .*\n((?:  .*\n)+)", output, flags=re.MULTILINE)
    assert match, f"no section for stage kind {kind}"
    rows = {}
    for line in match.group(1).splitlines():
        impl, where, description = re.match(r"  (\S+)\s+(\S+)\s+(.*)$", line).groups()
        rows[impl] = (where, description)
    return rows


def listed(output: str, kind: str) -> list[str]:
    """Names on the `<kind>: a, b, c` line."""
    match = re.search(rf"^{re.escape(kind)}: (.*)$", output, flags=re.MULTILINE)
    assert match, f"no line for {kind}"
    return match.group(1).split(", ")


def test_every_stage_kind_lists_its_impls_with_where_they_run_and_a_description(stages_output):
    for kind in BUILTIN_KINDS:
        rows = kind_section(stages_output, kind)
        assert list(rows) == registry(f"stage.{kind}").names(), kind
        for impl, (where, description) in rows.items():
            spec = registry(f"stage.{kind}").get(impl)
            assert where == (spec.role if spec.placement == "worker" else spec.placement)
            if spec.fn.__module__.startswith("rlpipe."):  # a built-in (tests register impls of their own)
                assert len(description) >= 20 and "``" not in description, f"{kind}/{impl}: {description!r}"
    # the three engines share one function: each is told apart by its params model's docstring
    engines = kind_section(stages_output, "generate")
    assert "vLLM" in engines["vllm"][1] and "SGLang" in engines["sglang"][1]
    assert len(stages_output.splitlines()) < 100


def test_the_advantage_stage_lists_every_estimator(stages_output):
    assert set(ESTIMATORS) <= set(registry("stage.advantage").names())
    assert set(ESTIMATORS) <= set(kind_section(stages_output, "advantage"))
    assert set(ESTIMATORS) <= set(listed(stages_output, "advantage_estimator"))


@pytest.mark.parametrize(
    "kind, expected",
    [("advantage_estimator", ESTIMATORS), ("policy_loss", POLICY_LOSSES), ("loss_agg_mode", AGG_MODES),
     ("kl_penalty", KL_PENALTIES)],
)
def test_named_registries_are_listed(stages_output, kind, expected):
    names = registry(kind).names()
    assert set(expected) <= set(names)
    assert listed(stages_output, kind) == names


def test_one_impl_shows_its_columns_and_every_nested_default():
    code, out = run_cli(["stages", "update/ppo"])
    assert code == 0
    assert out.startswith("update/ppo  (runs on: actor)\n")
    reads = re.search(r"^  reads: (.*)$", out, flags=re.MULTILINE).group(1)
    assert "advantages (list<item: float>)" in reads and "old_logprobs (list<item: float>)" in reads
    assert re.search(r"^  writes: -$", out, flags=re.MULTILINE)
    for line in ('    policy_loss: "vanilla"  # Registered policy loss', "    clip_ratio: 0.2  # PPO clip",
                 "    use_kl_loss: false", "    bypass:  # bypass_mode",  # a nested model, spelled out below
                 '      loss_type: "ppo_clip"', "      rollout_is_threshold: 2.0"):
        assert f"\n{line}" in out, line
    # "Dr. GRPO" inside a field's first sentence does not end it
    assert "(Dr. GRPO: the max response length)" in out


def test_a_kind_shows_every_impl_and_a_registry_its_parts():
    code, out = run_cli(["stages", "advantage"])
    assert code == 0
    headers = re.findall(r"^advantage/(\S+)  \(runs on", out, flags=re.MULTILINE)
    assert headers == registry("stage.advantage").names()
    assert "writes: advantages (list<item: float>), returns (list<item: float>)" in out
    code, out = run_cli(["stages", "dataset/hf"])
    assert code == 0 and out.startswith("dataset: hf\n") and "  prompt_key: " in out


@pytest.mark.parametrize("query, hint", [("advantge", "did you mean 'advantage'?"),
                                         ("advantage/grpoo", "did you mean 'grpo'?")])
def test_an_unknown_kind_or_impl_exits_two_with_a_did_you_mean(query, hint, capsys):
    assert main(["stages", query]) == 2
    err = capsys.readouterr().err
    assert hint in err and "known:" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_builtins_register_every_shipped_stage_module():
    """A fresh process (what `rlpipe stages` and `rlpipe validate` see) knows every impl the stage modules define."""
    script = (
        "import importlib, json, pkgutil\n"
        "from rlpipe.registry import load_plugins, registry\n"
        "from rlpipe.stage_kinds import BUILTIN_KINDS as STEP_KINDS\n"
        "import rlpipe.stages\n"
        "load_plugins()\n"
        "fresh = {k: registry('stage.' + k).names() for k in STEP_KINDS}\n"
        "for m in pkgutil.iter_modules(rlpipe.stages.__path__):\n"
        "    importlib.import_module('rlpipe.stages.' + m.name)\n"
        "shipped = {k: registry('stage.' + k).names() for k in STEP_KINDS}\n"
        "print(json.dumps([fresh, shipped]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    fresh, shipped = json.loads(out.stdout.strip().splitlines()[-1])
    missing = {kind: sorted(set(shipped[kind]) - set(fresh[kind])) for kind in fresh}
    assert {k: v for k, v in missing.items() if v} == {}, "registered only when their module is imported by hand"


def test_validate_quickstart_exits_zero_and_prints_the_nodes(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["validate", str(ROOT / "pipelines" / "quickstart.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid (sync mode)" in out
    cells = re.findall(r"^│ (\S+)\s+│ (\S+)\s+│ (\S+)\s+│", out, flags=re.MULTILINE)
    rows = {node: [kind_impl, runs_on] for node, kind_impl, runs_on in cells}
    assert rows == {
        "generate": ["generate/embedded", "rollout"],
        "reward": ["reward/rule", "task"],
        "balance": ["balance/tokens", "task"],
        "old_log_prob": ["old_log_prob/trainer", "actor"],
        "advantage": ["advantage/grpo", "task"],
        "update": ["update/ppo", "actor"],
        "weight_sync": ["weight_sync/object_store", "driver"],
    }
    # the calls on Ray: the rollout's chain hands its table to the trainer's
    assert "  1. rollout×1: generate, reward, balance  (hands its table to the next call)\n" \
           "  2. actor×1: old_log_prob, advantage, update, weight_sync\n" in out


def test_validate_shows_a_reference_model_running_beside_old_log_prob(capsys):
    assert main(["validate", str(ROOT / "pipelines" / "qwen05b_gsm8k_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "  2. actor×1: old_log_prob\n  3. ref×1: ref, advantage  (runs beside call 2)\n" in out


def test_validate_of_a_broken_pipeline_exits_two_with_the_reason(capsys):
    assert main(["validate", str(ROOT / "tests" / "fixtures" / "unknown_impl.yaml")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "known:" in err


def test_a_run_that_fails_prints_one_line_and_keeps_the_details_in_a_log_file(tmp_path, capsys):
    """issue 14 part 4: a runtime failure is one line naming where it failed, exit 2, the traceback in a file."""
    code = main(["run", str(ROOT / "pipelines" / "quickstart.yaml"), "--inline", "-o", "tracking.enabled=false",
                 "-o", "trainer.total_steps=4", "-o", "data.prompts_per_step=4", "-o", "trainer.optimizer.lr=1e30",
                 "-o", "trainer.grad_clip=null", "-o", f"trainer.output_dir={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    line = errors[0]
    assert re.search(r"error: stage 'update' \(impl 'ppo'\) failed at step \d+: NumericalError: ", line), line
    log = Path(re.search(r"\(details: (\S+\.log)\)$", line).group(1))
    assert log.parent == tmp_path
    details = log.read_text()
    assert "Traceback (most recent call last)" in details and "NumericalError" in details
    assert "where the stage failed:" in details and "train_state.py" in details  # the trainer's own frames
    assert "trainer.optimizer.lr=1e30" in details  # the command line


def test_validate_checks_every_row_of_a_file_up_to_the_bound(tmp_path, capsys):
    """issue 25 item 6: a too-long prompt on line 2500 of a small file is found before anything starts, named by
    file and line; past data.check_whole_files_mb the first 2000 rows are read and validate says so."""
    rows = [{"prompt": f"{i % 97}+1=", "ground_truth": str(i % 97 + 1), "data_source": "digits"} for i in range(2600)]
    rows[2499]["prompt"] = "1234567+1234567="
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["validate", str(ROOT / "tests" / "fixtures" / "prompt_longer_than_max.yaml"),
              "-o", f"data.params.path={data}", "-o", f"trainer.output_dir={tmp_path}"]
    assert main(common) == 2
    err = capsys.readouterr().err
    assert f"the prompt of {data}:2500 of dataset 'jsonl' has 16 tokens > data.max_prompt_length=8" in err
    assert main([*common, "-o", "data.check_whole_files_mb=0"]) == 0
    out = capsys.readouterr().out
    assert f"data: 2000 rows checked; only the first 2000 of {data} (0.2 MB) (over data.check_whole_files_mb=0" in out


def test_stages_lists_the_kinds_a_plugin_file_registers(capsys):
    plugin = str(ROOT / "pipelines" / "plugins" / "length_penalty.py")
    assert main(["stages", "--plugin", plugin]) == 0
    assert re.search(r"^length_penalty: ", capsys.readouterr().out, flags=re.MULTILINE)
    assert main(["stages", "length_penalty/linear", "--plugin", plugin]) == 0
    detail = capsys.readouterr().out
    assert "writes: token_rewards (list<item: float>)" in detail and "coef: 0.01" in detail
    assert main(["stages", "--plugin", "no/such/file.py"]) == 2
    assert "--plugin: plugin file 'no/such/file.py' not found" in capsys.readouterr().err
