"""Figures of a run, drawn with matplotlib (Agg) and logged as MLflow artifacts under ``figures/``.

* ``reward.png`` — reward/mean per step.
* ``stage_time.png`` — wall time per node, stacked per step. Step 0 carries the
  cold start (model load, first compilation, Ray workers warming up) and would
  dwarf the rest: it is drawn hatched and the y axis is scaled to the later steps
  (its total is written on its bar).
* ``staleness.png`` — histogram of consumed trajectories' staleness in steps
  (consuming step − prompt step; 0 everywhere in sync mode).
* ``token_versions.png`` — per consuming step, the range of policy versions
  that produced the consumed tokens (oldest to newest), and the share of
  trajectories whose tokens span more than one version (a weight push mid-generation).

The observer redraws them every ``tracking.figures_every`` steps and at the run's
end, on its writer thread.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import matplotlib

matplotlib.use("Agg")  # no display: figures are files

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from rlpipe.engine.tracking.observer import NodeRecord  # noqa: E402

FIGURES_DIR = "figures"
NAMES = ("reward.png", "stage_time.png", "staleness.png", "token_versions.png")


def reward_curve(rewards: Mapping[int, float]):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = sorted(rewards)
    ax.plot(steps, [rewards[s] for s in steps], marker="o" if len(steps) < 30 else None)
    ax.set(xlabel="step", ylabel="reward/mean", title="Reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return fig


def stage_times(records: Mapping[int, Iterable[NodeRecord]]):
    """Stacked per-node seconds per step; step 0 hatched and left out of the y scale."""
    per_step: dict[int, dict[str, float]] = {}
    order: list[str] = []
    for step in sorted(records):
        totals: dict[str, float] = defaultdict(float)
        for r in sorted(records[step], key=lambda r: r.start_time):
            totals[r.node] += r.duration_s
            if r.node not in order:
                order.append(r.node)
        per_step[step] = totals
    steps = sorted(per_step)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = np.zeros(len(steps))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x = np.asarray(steps, dtype=float)
    rest = x != 0
    # One stepped band per node, not one bar per (step, node): hundreds of bar patches took seconds to
    # draw on a busy 2-core machine, on the observer's thread, beside the training.
    for i, (node, color) in enumerate(zip(order, colors * (len(order) // len(colors) + 1))):
        heights = np.array([per_step[s].get(node, 0.0) for s in steps])
        if rest.any():
            ax.fill_between(x[rest], bottom[rest], (bottom + heights)[rest], step="mid", color=color, label=node,
                            linewidth=0)
        if not rest.all():  # the warm-up step: hatched bars, out of the legend when later steps label the node
            ax.bar(x[~rest], heights[~rest], bottom=bottom[~rest], color=color, hatch="//",
                   label=None if rest.any() else node)
        bottom += heights
    ax.legend(fontsize=7, ncol=2)
    later = [b for s, b in zip(steps, bottom) if s != 0]
    if 0 in steps and later and bottom[steps.index(0)] > max(later) * 1.25:
        top = max(later) * 1.25  # the cold start is cut off; its total is written on its bar
        ax.set_ylim(0, top)
        ax.annotate(f"warm-up {bottom[steps.index(0)]:.1f}s ↑", (0, top * 0.95), ha="center", va="top", fontsize=8,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    ax.set(xlabel="step", ylabel="seconds", title="Time per stage (step 0: warm-up, hatched)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def staleness(lineage: pa.Table):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    t = lineage.filter(pc.is_valid(lineage.column("prompt_step")))
    lag = t.column("consumed_step").to_numpy() - t.column("prompt_step").to_numpy()
    if len(lag):
        ax.hist(lag, bins=np.arange(lag.min(), lag.max() + 2) - 0.5, rwidth=0.8)
    ax.set(xlabel="staleness (consuming step − prompt step)", ylabel="trajectories", title="Staleness")
    return fig


def token_versions(lineage: pa.Table):
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    t = lineage.filter(pc.is_valid(lineage.column("min_version")))
    if t.num_rows:
        g = t.group_by("consumed_step").aggregate([("min_version", "min"), ("max_version", "max")]).sort_by(
            "consumed_step")
        steps = g.column("consumed_step").to_numpy()
        lo, hi = g.column("min_version_min").to_numpy(), g.column("max_version_max").to_numpy()
        ax.fill_between(steps, lo, hi, alpha=0.3, step="mid", label="versions of consumed tokens")
        ax.plot(steps, hi, drawstyle="steps-mid", label="newest")
        ax.plot(steps, lo, drawstyle="steps-mid", linestyle="--", label="oldest")
        spans = t.group_by("consumed_step").aggregate([("versions_spanned", "list")]).sort_by("consumed_step")
        share = [np.mean(np.array(v) > 1) for v in spans.column("versions_spanned_list").to_pylist()]
        ax2.plot(spans.column("consumed_step").to_numpy(), share, marker=".")
        ax.legend(fontsize=7)
    ax.set(ylabel="policy version", title="Token-version spread")
    ax2.set(xlabel="consuming step", ylabel="share spanning >1 version", ylim=(-0.05, 1.05))
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def log_figures(client: MlflowClient, run_id: str, rewards: Mapping[int, float],
                records: Mapping[int, Iterable[NodeRecord]], lineage: pa.Table | None) -> list[str]:
    """Draw and log every figure there is data for; returns the artifact paths written."""
    drawn = []
    if rewards:
        drawn.append(("reward.png", reward_curve(rewards)))
    if records:
        drawn.append(("stage_time.png", stage_times(records)))
    if lineage is not None and lineage.num_rows:
        drawn.append(("staleness.png", staleness(lineage)))
        drawn.append(("token_versions.png", token_versions(lineage)))
    written = []
    for name, fig in drawn:
        try:
            # fixed margins: tight_layout measured every text extent and cost most of a figure's time
            fig.subplots_adjust(left=0.12, right=0.97, bottom=0.13, top=0.91, hspace=0.3)
            client.log_figure(run_id, fig, f"{FIGURES_DIR}/{name}")
            written.append(f"{FIGURES_DIR}/{name}")
        finally:
            plt.close(fig)
    return written
