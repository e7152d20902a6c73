"""``rlpipe simulate RUN --log``: the prediction as a figure and JSON next to the recorded run in MLflow.

One PNG (matplotlib, Agg) per simulated configuration, ``simulate/<overrides>.png``: samples/s and mean
staleness predicted beside what RUN measured, the predicted staleness histogram, and each worker's predicted
busy share; and ``simulate/<overrides>.json``, the figures ``--json`` prints. The MLflow UI's artifact view
shows both on the recorded run's page.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

ARTIFACT_DIR = "simulate"


def artifact_stem(overrides: list[str]) -> str:
    """The file name of a configuration's figure and JSON (its overrides; ``own-config`` for none)."""
    text = ",".join(overrides) if overrides else "own-config"
    return re.sub(r"[^A-Za-z0-9._=,-]+", "_", text)[:150]


def draw(result, overrides: list[str]):
    """The figure of one prediction (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    from rlpipe.cli_simulate import title

    p, measured = result.prediction, result.calibration.measured
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    recorded = f"recorded run\n({result.calibration.recorded_mode}, as run)"
    rates = [(f"predicted\n({p.mode})", p.samples_per_s), (recorded, measured.samples_per_s if measured else None)]
    axes[0].bar([name for name, _ in rates], [v or 0.0 for _, v in rates], color=["tab:blue", "tab:gray"])
    for i, (_, value) in enumerate(rates):
        axes[0].annotate("-" if value is None else f"{value:.3g}", (i, value or 0.0), ha="center", va="bottom")
    axes[0].set_title("samples/s")
    hist = p.staleness_hist
    axes[1].bar(list(hist), list(hist.values()), color="tab:blue", label="predicted")
    if measured is not None and measured.mean_staleness is not None:
        axes[1].axvline(measured.mean_staleness, color="tab:gray", linestyle="--",
                        label=f"recorded mean {measured.mean_staleness:.2f}")
    mean = "-" if p.mean_staleness is None else f"{p.mean_staleness:.2f}"
    axes[1].set_title(f"staleness (predicted mean {mean})")
    axes[1].set_xlabel("consuming step − prompt step")
    axes[1].legend(fontsize="small")
    workers = list(p.busy_share)
    axes[2].barh(workers, [p.busy_share[w] for w in workers], color="tab:blue")
    axes[2].set_xlim(0, 1)
    axes[2].set_title("busy share (predicted)")
    fig.suptitle(f"{title(result, overrides)} — verdict: {p.verdict}", fontsize="medium")
    fig.tight_layout()
    return fig


def log(result, overrides: list[str], figures: dict, tracking_uri: str | None = None) -> list[str]:
    """Log the figure and ``figures`` (the ``--json`` object) to the recorded run; the artifact paths."""
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    from rlpipe.engine.tracking.runs import resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    stem = artifact_stem(overrides)
    with tempfile.TemporaryDirectory() as tmp:
        fig = draw(result, overrides)
        try:
            fig.savefig(Path(tmp) / f"{stem}.png", dpi=100)
        finally:
            plt.close(fig)
        (Path(tmp) / f"{stem}.json").write_text(json.dumps(figures, indent=2, sort_keys=True), encoding="utf-8")
        client.log_artifacts(result.calibration.run_id, tmp, ARTIFACT_DIR)
    return [f"{ARTIFACT_DIR}/{stem}.png", f"{ARTIFACT_DIR}/{stem}.json"]
