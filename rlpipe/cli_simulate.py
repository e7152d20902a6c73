"""``rlpipe simulate``: predict a configuration of a recorded run's workload (:mod:`rlpipe.simulate`).

``rlpipe simulate RUN [-o key=value ...] [--steps N] [--json] [--write-config PATH] [--log]`` calibrates
the event model on RUN's lineage, applies the overrides to RUN's config (validated as ``rlpipe run``
validates them), simulates it and prints the predicted figures next to what RUN measured (for
RUN's own config: a check of the model). ``--json`` prints the same figures as one JSON object; ``--log``
also logs them, with a figure, to RUN in MLflow (:mod:`rlpipe.simulate.figure`).
The exit status is 0 whatever the verdict (it is a prediction); a config the overrides make
invalid is an error (2), as in ``rlpipe validate``.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def add_commands(sub) -> None:
    """Register the ``simulate`` sub-command."""
    cmd = sub.add_parser("simulate", help="predict steps/s, staleness and busy shares of a configuration, "
                                          "calibrated on a recorded run")
    cmd.add_argument("run", help="the recorded run: run id, a unique prefix of one, a run name, or 'latest'")
    cmd.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                     help="change the recorded config, as `rlpipe run -o` does: -o mode=separate_async "
                          "-o mode_params.max_off_policy_threshold=2 -o resources.rollout_replicas=2 "
                          "-o data.prompts_per_step=32 -o stages.generate.params.max_tokens=64")
    cmd.add_argument("--steps", type=int, default=100, metavar="N", help="steps to simulate (default 100)")
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    cmd.add_argument("--write-config", metavar="PATH", default=None,
                     help="write the simulated config as YAML (`rlpipe run PATH` runs it as simulated)")
    cmd.add_argument("--log", action="store_true",
                     help="also log the prediction as a figure and JSON to the recorded run in MLflow "
                          "(artifacts simulate/<overrides>.png and .json)")
    cmd.add_argument("--tracking-uri", default=None,
                     help="MLflow store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    cmd.add_argument("--experiment", default=None, help="only runs of this MLflow experiment")


def run_command(args: argparse.Namespace) -> int:
    from rlpipe.errors import ConfigError
    from rlpipe.simulate import simulate_recording

    if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: simulate at least 2 steps (throughput is measured after the first)")
    result = simulate_recording(args.run, args.override, args.steps, args.tracking_uri, args.experiment)
    if args.write_config:
        _write_config(args.write_config, result.raw_config)
    figures = as_json(result, args.override)
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    else:
        print_table(result, args.override)
    if args.log:
        from rlpipe.simulate.figure import log

        paths = log(result, args.override, figures, args.tracking_uri)
        if not args.json:  # --json keeps stdout one JSON object
            Console().print(f"logged to run {result.calibration.run_id[:12]}: {', '.join(paths)}", highlight=False)
    return 0


def as_json(result, overrides: list[str]) -> dict:
    """The prediction's figures, the run they were calibrated on and what it measured."""
    out = result.prediction.model_dump(mode="json")
    out["run_id"] = result.calibration.run_id
    out["overrides"] = list(overrides)
    measured = result.calibration.measured
    out["recorded"] = measured.model_dump(mode="json") if measured is not None else None
    out["recorded_mode"] = result.calibration.recorded_mode
    return out


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if spec == ".3g" and abs(value) >= 1000:  # 1620, not 1.62e+03
        return f"{value:,.0f}"
    return format(value, spec)


def title(result, overrides: list[str]) -> str:
    """What was simulated, on which run (the table's title; the run report's too)."""
    p, cal = result.prediction, result.calibration
    changed = ", ".join(overrides) if overrides else "no change"
    return f"rlpipe simulate: run {cal.run_id[:12]} ({cal.recorded_mode}) → {p.mode} ({changed}), {p.steps} steps"


def comparison_rows(result) -> list[tuple[str, str, str]]:
    """(figure, predicted, recorded run) per figure: the table's rows (the run report shows them too)."""
    p, m = result.prediction, result.calibration.measured
    rows = [
        ("steps/s", _fmt(p.steps_per_s), _fmt(m and m.steps_per_s)),
        ("samples/s", _fmt(p.samples_per_s), _fmt(m and m.samples_per_s)),
        ("seconds per step", _fmt(p.step_s), _fmt(m and m.steps_per_s and 1 / m.steps_per_s)),
        ("staleness mean / max", f"{_fmt(p.mean_staleness)} / {_fmt(p.max_staleness, 'd')}",
         f"{_fmt(m and m.mean_staleness)} / {_fmt(m and m.max_staleness, 'd')}"),
        ("version lag mean / max", f"{_fmt(p.mean_version_lag)} / {_fmt(p.max_version_lag, 'd')}",
         f"{_fmt(m and m.mean_version_lag)} / {_fmt(m and m.max_version_lag, 'd')}"),
        ("trainer waiting for batches", _fmt(p.trainer_wait_share, ".0%"), "-"),
        ("groups dropped / prompts submitted per step", f"{p.dropped_per_step:.2f} / {p.submitted_per_step:.2f}", "-"),
        ("long rollouts dropped", _fmt(p.long_dropped_share, ".0%"), "-"),
    ]
    return rows + [(f"busy: {worker}", f"{share:.0%}", "-") for worker, share in p.busy_share.items()]


def print_table(result, overrides: list[str]) -> None:
    p = result.prediction
    out = Console()
    table = Table(title=title(result, overrides))
    table.add_column("figure")
    table.add_column("predicted", justify="right")
    table.add_column("recorded run", justify="right")
    for row in comparison_rows(result):
        table.add_row(*row)
    out.print(table)
    colour = {"ok": "green", "starves": "yellow", "no_progress": "bold red"}[p.verdict]
    verdict = f"[{colour}]{p.verdict}[/]" + (f": {escape(p.verdict_reason)}" if p.verdict_reason else "")
    out.print(f"verdict: {verdict}", soft_wrap=True)
    for note in p.notes:
        out.print(f"note: {escape(note)}", soft_wrap=True, highlight=False)
    out.print(f"[dim]simulated {p.simulated_s:.1f} s in {p.wall_s:.2f} s ({p.events} events)[/]")


def _write_config(path: str, raw: dict) -> None:
    import yaml

    with open(path, "w", encoding="utf-8") as f:
        f.write("# written by rlpipe simulate: the simulated config; run it with `rlpipe run " + path + "`\n")
        yaml.safe_dump(raw, f, sort_keys=False)
