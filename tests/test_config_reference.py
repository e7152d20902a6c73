"""The generated YAML reference is current and real; the README stays short; local doc links resolve."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from rlpipe.engine.planning.config_reference import render_reference
from rlpipe.schemas.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "pipeline-yaml-reference.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.fixture(scope="module")
def reference() -> str:
    return render_reference()


def test_committed_reference_is_current(reference):
    committed = REFERENCE.read_text(encoding="utf-8") if REFERENCE.is_file() else ""
    if committed != reference:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), reference.splitlines(True),
                                                 "docs/pipeline-yaml-reference.md (committed)",
                                                 "render_reference()"))[:40])
        pytest.fail(f"docs/pipeline-yaml-reference.md is stale: run `make docs` and commit it\n{diff}")


def test_reference_holds_real_fields_defaults_and_docstrings(reference):
    # a known field of trainer: its type with bounds, its default and its attribute docstring
    assert "#### `trainer` — TrainerConfig" in reference
    assert "| `total_steps` | `int`, ≥ 1 | `10` | Global steps to run. |" in reference
    assert ("| `on_nonfinite` | `\"fail\" \\| \"skip\"` | `\"fail\"` | What a local update with a non-finite"
            in reference)
    # a nested model (default_factory called), a model inside `X | None`, a list item, a stage impl, a mode
    assert "| `lr` | `float`, > 0 | `0.0001` | Peak learning rate. |" in reference
    assert "##### `model.architecture` — ArchitectureConfig" in reference
    assert "#### `stages[]` — StageConfig" in reference
    assert "#### `advantage` / `grpo`" in reference
    assert "##### `params.judge` — JudgeConfig" in reference
    assert "| `max_off_policy_threshold` | `int`, ≥ 1 | `8` |" in reference
    assert "| `path` | `str` | required |" in reference  # reward.params.function.path has no default
    trainer = reference.split("#### `trainer` — TrainerConfig", 1)[1].split("\n#", 1)[0]
    for name in TrainerConfig.model_fields:
        assert f"| `{name}` |" in trainer, f"trainer.{name} missing from the reference"


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/ (at most 300)"


def _local_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(doc):
    links = _local_links(doc)
    missing = [t for t in links if not (doc.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"
    if doc.name == "README.md":
        assert links, "README.md should link to the docs/ pages"


def test_parts_a_test_or_plugin_registers_stay_out_of_the_reference(reference):
    """A metric logger registered by a test in the same process (a spec object of rlpipe's own class, holding the
    test's callable) is not rlpipe's: the reference rendered afterwards equals the one before."""
    from rlpipe.engine.tracking.metric_loggers import METRIC_LOGGERS, MetricLoggerSpec

    METRIC_LOGGERS.add("test_reference_only", MetricLoggerSpec(lambda *args: None, "json", "-"))
    try:
        assert render_reference() == reference
    finally:
        METRIC_LOGGERS._items.pop("test_reference_only")  # other tests of this process see the registry as it was
