"""The run report: one self-contained HTML file per run (``report.html`` in MLflow, ``rlpipe report RUN``).

The worker timeline across steps, reward / response length / staleness per step, a sample of trajectories
with tokens coloured by policy version and masked spans marked, the per-token log-prob mismatch between the
rollout engine and the trainer, and ``rlpipe simulate``'s prediction beside what was measured (when it was
computed: ``rlpipe report`` does, the end of a run does not — it would load the planner and torch into the
tracking process). Three parts: :mod:`.read` gets a run's data through the lineage readers, :mod:`.data`
turns tables into what is shown (pure, tested on hand-built tables), :mod:`.page` and :mod:`.svg` draw it.
Left out: interactivity (no script: the file opens offline, in MLflow's artifact view too), trajectories
beyond a bounded sample, per-token text where the run saved no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.engine.tracking.report.data import ReportData

REPORT_ARTIFACT = "report.html"
"""The report's name among a run's artifacts (top level: MLflow's artifact view shows it)."""


def write(report: ReportData, path: str | Path) -> Path:
    """Render ``report`` to ``path`` (UTF-8); returns the path."""
    from rlpipe.engine.tracking.report.page import render

    path = Path(path)
    path.write_text(render(report), encoding="utf-8")
    return path
