"""A recorded run read back from MLflow for ``rlpipe simulate``: its config, lineage and trajectory lineage.

The same artifacts ``rlpipe lineage`` reads (:mod:`rlpipe.engine.tracking.runs`): the per-step
``lineage/steps/*.parquet`` parts (or ``lineage/lineage.parquet``), ``lineage/trajectories``
and the run's ``resolved_config.json`` — the validated config the run was started with, which
``-o`` overrides change before they are validated again.
"""

from __future__ import annotations

from typing import Any

from rlpipe.engine.tracking import explain, runs
from rlpipe.engine.tracking.lineage import table_to_records
from rlpipe.simulate.calibration import Recording


def load_recording(run_ref: str, tracking_uri: str | None = None,
                   experiment: str | None = None) -> tuple[Recording, dict[str, Any]]:
    """The recording of run ``run_ref`` (an id, prefix, name or ``latest``) and its raw config."""
    from rlpipe.engine.planning.config_io import validate_config

    uri = runs.resolve_tracking_uri(tracking_uri)
    run = explain.find_run(run_ref, uri, experiment)
    run_id = run.info.run_id
    raw = runs.resolved_config(run_id, uri)
    records = table_to_records(runs.lineage_table(run_id, uri))
    try:
        trajectories = runs.trajectory_lineage_table(run_id, uri)
    except runs.RunNotFoundError:  # a run stopped before its first step ended
        trajectories = None
    config = validate_config(raw, source=f"run {run_id}'s resolved_config.json")
    return Recording(run_id, config, records, trajectories), raw
