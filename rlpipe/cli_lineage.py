"""``rlpipe lineage``, ``rlpipe replay`` and ``rlpipe runs``: what a recorded run did, from the command line.

Reads what the MLflow observer wrote (see :mod:`rlpipe.engine.tracking.explain`);
``--tracking-uri`` picks the store (default: ``MLFLOW_TRACKING_URI``, else
``./mlflow.db``), as ``rlpipe run`` does.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table


def add_commands(sub) -> None:
    """Register the ``lineage`` and ``runs`` sub-commands."""
    lineage = sub.add_parser("lineage", help="what produced what in a recorded run (a step's nodes, a trajectory's life)")
    lineage.add_argument("run", help="run id, a unique prefix of one, a run name, or 'latest'")
    lineage.add_argument("--step", type=int, default=None, help="show this step's node executions")
    lineage.add_argument("--trajectory", metavar="UID", default=None,
                         help="show where the trajectories of this prompt uid came from and what they fed")
    replay = sub.add_parser("replay", help="re-run one stage on the batch a run recorded, as recorded or changed")
    replay.add_argument("run", help="run id, a unique prefix of one, a run name, or 'latest'")
    replay.add_argument("--step", type=int, required=True, help="a step whose batches were recorded "
                        "(tracking.record_batches_every)")
    replay.add_argument("--node", required=True, help="the node to re-run (a task stage: reward, advantage, ...)")
    replay.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="change the node, e.g. -o impl=rloo or -o params.norm_adv_by_std_in_grpo=false")
    runs = sub.add_parser("runs", help="recent pipeline runs with status, steps and reward")
    runs.add_argument("--limit", type=int, default=20, help="how many runs (newest first)")
    for cmd in (lineage, replay, runs):
        cmd.add_argument("--tracking-uri", default=None, help="MLflow store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
        cmd.add_argument("--experiment", default=None, help="only runs of this MLflow experiment")


def run_command(args: argparse.Namespace) -> int:
    if args.command == "runs":
        return _runs(args)
    if args.command == "replay":
        return _replay(args)
    return _lineage(args)


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _runs(args) -> int:
    from rlpipe.engine.tracking.explain import recent_runs

    found = recent_runs(args.tracking_uri, args.experiment, args.limit)
    out = Console()
    if not found:
        out.print("no rlpipe runs yet: `rlpipe run PIPELINE.yaml` records one")
        return 0
    table = Table(title="rlpipe runs (newest first)")
    for column in ("run id", "name", "experiment", "status", "mode", "steps", "reward/mean", "started", "duration"):
        table.add_column(column, no_wrap=column == "run id")
    for r in found:
        steps = f"{r.steps}/{r.total_steps}" if r.total_steps else str(r.steps)
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started_ms / 1000))
        duration = "-" if r.duration_s is None else f"{r.duration_s:.0f}s"
        table.add_row(r.run_id, r.name, r.experiment, r.status, r.mode, steps, _fmt(r.reward), started, duration)
    out.print(table)
    return 0


def _lineage(args) -> int:
    from rlpipe.engine.tracking import explain

    run = explain.find_run(args.run, args.tracking_uri, args.experiment)
    run_id = run.info.run_id
    out = Console()
    out.print(f"run [bold]{run_id}[/] ({run.info.run_name}, {run.info.status})")
    if args.trajectory is not None:
        _trajectory(out, explain.trajectory_story(run_id, args.trajectory, args.tracking_uri))
    if args.step is not None:
        _step(out, args.step, explain.step_nodes(run_id, args.step, args.tracking_uri))
    if args.trajectory is None and args.step is None:
        steps, uids = explain.overview(run_id, args.tracking_uri)
        out.print(f"steps recorded: {steps[0]}..{steps[-1]}" if steps else "no step recorded yet")
        if uids:
            out.print(f"trajectories of the last step, e.g.: {', '.join(uids)}")
        out.print(f"ask: `rlpipe lineage {run_id[:8]} --step S` (a step's nodes), "
                  f"`rlpipe lineage {run_id[:8]} --trajectory UID` (a trajectory's lineage)")
    return 0


def clocks_cell(cpu_s: float | None, run_queue_s: float | None) -> str:
    """A node execution's CPU seconds and seconds waiting for a core (NodeRecord.cpu_s, run_queue_s): ``-`` where
    not measured, ``?`` for a wait the kernel did not report."""
    if cpu_s is None:
        return "-"
    return f"{cpu_s:.3f}+{run_queue_s:.3f}s" if run_queue_s is not None else f"{cpu_s:.3f}+?s"


def _step(out: Console, step: int, records) -> None:
    t0 = records[0].start_time
    table = Table(title=f"step {step}: {len(records)} node executions")
    for column in ("node", "kind/impl", "worker", "start", "duration", "cpu+core wait", "rows", "input", "output",
                   "versions", "trainer v", "error"):
        table.add_column(column, no_wrap=column in ("input", "output"))
    for r in records:
        versions = ",".join(map(str, r.policy_versions)) or "-"
        table.add_row(r.node, f"{r.kind}/{r.impl}", r.worker or "-", f"+{r.start_time - t0:.3f}s", f"{r.duration_s:.3f}s",
                      clocks_cell(r.cpu_s, r.run_queue_s), f"{r.rows_in}→{r.rows_out}", r.input_fingerprint[:12] or "-",
                      r.output_fingerprint[:12] or "-", versions, str(r.trainer_version), r.error or "")
    out.print(table)
    wall = max(r.start_time + r.duration_s for r in records) - t0
    out.print(f"step {step} wall time {wall:.3f}s, node time {sum(r.duration_s for r in records):.3f}s")


def _trajectory(out: Console, stories) -> None:
    """One block per consuming step: the shared story once, then a row per sample."""
    from rlpipe.engine.tracking.lineage import BORROWED_REPLICA

    by_step: dict[int, list] = {}
    for s in stories:
        by_step.setdefault(s.consumed_step, []).append(s)
    for step, group in by_step.items():
        first = group[0]
        replicas = sorted({s.replica for s in group if s.replica is not None})
        # the trainer itself (separate_async's borrow) generated the groups of replica BORROWED_REPLICA
        where = "the trainer (borrowed as a rollout engine)" if replicas == [BORROWED_REPLICA] else \
            f"rollout replica {', '.join(map(str, replicas))}" if replicas else "a rollout replica (not recorded)"
        out.print(f"[bold]trajectory {first.uid}[/]: {len(group)} sample(s); prompt drawn at step "
                  f"{_fmt(first.prompt_step, 'd')}, generated by {where}, consumed by step {step}")
        versions = sorted({v for s in group for v in (s.min_version, s.max_version) if v is not None})
        if versions:
            out.print(f"  its tokens came from weights v{versions[0]}..v{versions[-1]}")
        if first.update is not None:
            u = first.update
            out.print(f"  it fed update {u.node!r} ({u.impl}) of step {u.step}, which trained weights "
                      f"v{u.trainer_version} (output {u.output_fingerprint[:12]})")
        else:
            out.print(f"  no update recorded at step {step} (the run stopped before it)")
        if first.weight_push is not None:
            out.print(f"  → weight version v{first.weight_push.trainer_version} pushed by {first.weight_push.node!r}")
        table = Table()
        for column in ("sample", "replica", "tokens", "token versions", "reward", "advantage", "status", "prompt → response"):
            table.add_column(column)
        for s in group:
            row = s.sampled
            versions = "-" if s.min_version is None else (
                f"v{s.min_version}" if s.min_version == s.max_version else f"v{s.min_version}..v{s.max_version}")
            text = f"{row['prompt']!r} → {row['response']!r}" if row else "(not sampled to MLflow)"
            table.add_row(_fmt(s.sample_index, "d"), _fmt(s.replica, "d"), str(s.num_tokens), versions,
                          _fmt(row.get("reward")), _fmt(row.get("advantage")), str(row.get("status") or "-"), text)
        out.print(table)


def _replay(args) -> int:
    from rlpipe.engine.replay import replay

    r = replay(args.run, args.step, args.node, args.override, args.tracking_uri, args.experiment)
    out = Console()
    out.print(f"run [bold]{r.run_id}[/], step {r.step}, node {r.node!r}: {r.before}"
              + (f" → {r.after}" if args.override else "") + f" on the recorded batch ({r.columns[0].rows if r.columns else 0} rows)")
    if r.reproduced is not None:
        out.print("recorded impl reproduces the recorded output: " + ("yes (same fingerprint)" if r.reproduced
                  else "[bold red]no[/] (output fingerprint differs: nondeterminism or changed code)"))
    table = Table(title="outputs" + (" (recorded impl vs changed)" if args.override else ""))
    for column in ("column", "rows changed", "mean before", "mean after", "max |diff|"):
        table.add_column(column)
    for c in r.columns:
        table.add_row(c.name, f"{c.rows_changed}/{c.rows}", _fmt(c.mean_before, ".4f"), _fmt(c.mean_after, ".4f"),
                      _fmt(c.max_abs_diff, ".4g"))
    out.print(table)
    metrics = Table(title="metrics")
    for column in ("metric", "recorded", "replayed" if not args.override else "before", *(("after",) if args.override else ())):
        metrics.add_column(column)
    for k in sorted(set(r.metrics_before) | set(r.metrics_after) | set(r.recorded_metrics)):
        row = [k, _fmt(r.recorded_metrics.get(k), ".4g"), _fmt(r.metrics_before.get(k), ".4g")]
        if args.override:
            row.append(_fmt(r.metrics_after.get(k), ".4g"))
        metrics.add_row(*row)
    out.print(metrics)
    return 0
