"""``rlpipe report``: one self-contained HTML report of a recorded run (:mod:`rlpipe.engine.tracking.report`).

``rlpipe report RUN [--out PATH] [--no-predict] [--log]`` reads RUN's lineage, metrics and sampled
trajectories from MLflow (as ``rlpipe lineage`` does), runs ``rlpipe simulate`` on RUN's own config for the
prediction beside the measured figures (``--no-predict`` skips it; a prediction that cannot be made is a note
in the report, not an error), and writes the page (default ``report-<run id[:8]>.html``). ``--log`` also
logs it to the run as ``report.html``, replacing the one the run's end wrote (which has no prediction).
RUN is a run id, a unique prefix, a run name, ``latest``, or a run's output folder
(``<output_dir>/<name>-<run id[:8]>``). A RUN that names no run is an error: one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from rich.console import Console

log = logging.getLogger(__name__)

_RUN_FOLDER = re.compile(r"-([0-9a-f]{8})$")
"""A run's output folder ends with its run id's first 8 characters (rlpipe.engine.runtime.run_output_dir)."""
PREDICT_STEPS = 100
"""Steps simulated for the prediction: ``rlpipe simulate``'s default (its figures are rates)."""


def add_commands(sub) -> None:
    """Register the ``report`` sub-command."""
    cmd = sub.add_parser("report", help="write one self-contained HTML report of a recorded run")
    cmd.add_argument("run", help="run id, a unique prefix of one, a run name, 'latest', or the run's output folder")
    cmd.add_argument("--out", metavar="PATH", default=None, help="the HTML file (default report-<run id[:8]>.html)")
    cmd.add_argument("--no-predict", action="store_true",
                     help="leave out rlpipe simulate's prediction (it loads the planner: a few seconds)")
    cmd.add_argument("--log", action="store_true", help="also log it to the run as report.html")
    cmd.add_argument("--tracking-uri", default=None,
                     help="MLflow store (default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    cmd.add_argument("--experiment", default=None, help="only runs of this MLflow experiment")


def run_ref(ref: str) -> str:
    """A run reference as ``find_run`` takes it: a run's output folder becomes its id prefix."""
    from rlpipe.engine.tracking.runs import RunNotFoundError

    path = Path(ref)
    if not path.is_dir():
        return ref
    found = _RUN_FOLDER.search(path.resolve().name)
    if found is None:
        raise RunNotFoundError(f"{ref} is a folder but not a run's output folder (<output_dir>/<name>-<run id[:8]>); "
                               "give a run id, a run name or 'latest' (`rlpipe runs` lists them)")
    return found.group(1)


def run_command(args: argparse.Namespace) -> int:
    from rlpipe.engine.tracking import explain, report, runs
    from rlpipe.engine.tracking.report import read

    uri = runs.resolve_tracking_uri(args.tracking_uri)
    run_id = explain.find_run(run_ref(args.run), uri, args.experiment).info.run_id
    prediction, notes = None, []
    if not args.no_predict:
        prediction, notes = predict(run_id, uri)
    data = read.gather(run_id, uri, prediction=prediction)
    data.notes.extend(notes)
    path = report.write(data, args.out or f"report-{run_id[:8]}.html")
    out = Console()
    out.print(f"wrote [bold]{path}[/] (run {run_id}, {data.steps} steps, {len(data.trajectories)} trajectories"
              f"{', with simulate' if prediction else ''})", highlight=False)
    if args.log:
        _log(runs.client(uri), run_id, path)
        out.print(f"logged to run {run_id} as {report.REPORT_ARTIFACT}", highlight=False)
    return 0


def _log(client, run_id: str, path: Path) -> None:
    """Log ``path`` to the run as ``report.html`` (MLflow names an artifact after its file: a copy of that name)."""
    import shutil
    import tempfile

    from rlpipe.engine.tracking.report import REPORT_ARTIFACT

    with tempfile.TemporaryDirectory(prefix="rlpipe-report-") as tmp:
        copy = Path(tmp) / REPORT_ARTIFACT
        shutil.copyfile(path, copy)
        client.log_artifact(run_id, str(copy))


def predict(run_id: str, tracking_uri: str):
    """``rlpipe simulate RUN`` on the run's own config, as the report's :class:`Prediction`; (None, [why]) when
    it cannot be made (an async recording without sync generate calls, a config that no longer validates)."""
    from rlpipe import cli_simulate
    from rlpipe.engine.tracking.report.data import Prediction, PredictionRow
    from rlpipe.errors import RlpipeError
    from rlpipe.simulate import simulate_recording

    try:
        result = simulate_recording(run_id, [], PREDICT_STEPS, tracking_uri)
    except (RlpipeError, ValueError) as exc:
        log.info("no simulate prediction for run %s: %s", run_id, exc)
        return None, [f"no simulate prediction: {exc}"]
    p = result.prediction
    return Prediction(
        title=cli_simulate.title(result, []),
        rows=[PredictionRow(figure=f, predicted=a, recorded=b) for f, a, b in cli_simulate.comparison_rows(result)],
        verdict=p.verdict + (f": {p.verdict_reason}" if p.verdict_reason else ""), notes=list(p.notes)), []
