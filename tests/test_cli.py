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
from rlpipe.stage import STEP_KINDS

ROOT = Path(__file__).resolve().parents[1]

ESTIMATORS = ["gae", "grpo", "dr_grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
              "remax", "opo", "gpg", "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"]
POLICY_LOSSES = ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl",
                 "dro", "bypass_mode"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_PENALTIES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]


@pytest.fixture(scope="module")
def stages_output() -> str:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "400")  # wide enough that rich neither wraps nor folds a name
        out = StringIO()
        with redirect_stdout(out):
            assert main(["stages"]) == 0
    return out.getvalue()


def table_section(output: str, kind: str) -> str:
    """The printed table of stage kind ``kind`` (up to the next table)."""
    match = re.search(rf"stage kind: {re.escape(kind)} *\n", output)
    assert match, f"no table for stage kind {kind}"
    end = output.find("stage kind:", match.end())
    return output[match.end() : end if end >= 0 else len(output)]


def impl_cells(section: str) -> list[str]:
    """First-column cells of a rich table's body rows."""
    return re.findall(r"^│ (\S+)\s+│", section, flags=re.MULTILINE)


def listed(output: str, kind: str) -> list[str]:
    """Names on the `<kind>: a, b, c` line."""
    match = re.search(rf"^{re.escape(kind)}: (.*)$", output, flags=re.MULTILINE)
    assert match, f"no line for {kind}"
    return match.group(1).split(", ")


def test_every_stage_kind_has_a_table_listing_its_registered_impls(stages_output):
    for kind in STEP_KINDS:
        assert impl_cells(table_section(stages_output, kind)) == registry(f"stage.{kind}").names(), kind


def test_the_advantage_stage_lists_every_estimator(stages_output):
    assert set(ESTIMATORS) <= set(registry("stage.advantage").names())
    assert set(ESTIMATORS) <= set(impl_cells(table_section(stages_output, "advantage")))
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


def test_the_update_stage_shows_its_param_defaults(stages_output):
    section = table_section(stages_output, "update")
    for text in ("policy_loss='vanilla'", "loss_agg_mode='token-mean'", "clip_ratio=0.2", "use_kl_loss=False"):
        assert text in section


@pytest.mark.slow
def test_builtins_register_every_shipped_stage_module():
    """A fresh process (what `rlpipe stages` and `rlpipe validate` see) knows every impl the stage modules define."""
    script = (
        "import importlib, json, pkgutil\n"
        "from rlpipe.registry import load_plugins, registry\n"
        "from rlpipe.stage import STEP_KINDS\n"
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
    missing = {kind: sorted(set(shipped[kind]) - set(fresh[kind])) for kind in STEP_KINDS}
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
