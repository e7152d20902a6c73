"""A recorded run read back from MLflow for ``rlpipe simulate``: its config, lineage and trajectory lineage.

The same artifacts ``rlpipe lineage`` reads (:mod:`rlpipe.engine.tracking.runs`): the per-step
``lineage/steps/*.parquet`` parts (or ``lineage/lineage.parquet``), ``lineage/trajectories``
and the run's ``resolved_config.json`` — the validated config the run was started with, which
``-o`` overrides change before they are validated again.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

from rlpipe.engine.tracking import explain, runs
from rlpipe.engine.tracking.lineage import table_to_records
from rlpipe.simulate.calibration import Recording


def recorded_config(run_id: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """The resolved config (a plain dict) the run was started with."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = runs.client(tracking_uri).download_artifacts(run_id, "resolved_config.json", tmp)
        except Exception as exc:  # MLflow raises different types per artifact store
            raise runs.RunNotFoundError(f"run {run_id} has no resolved_config.json ({exc}); was it recorded by "
                                        "rlpipe with tracking enabled?") from None
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def load_recording(run_ref: str, tracking_uri: str | None = None,
                   experiment: str | None = None) -> tuple[Recording, dict[str, Any]]:
    """The recording of run ``run_ref`` (an id, prefix, name or ``latest``) and its raw config."""
    from rlpipe.engine.planning.config_io import validate_config

    uri = runs.resolve_tracking_uri(tracking_uri)
    run = explain.find_run(run_ref, uri, experiment)
    run_id = run.info.run_id
    raw = recorded_config(run_id, uri)
    records = table_to_records(runs.lineage_table(run_id, uri))
    try:
        trajectories = runs.trajectory_lineage_table(run_id, uri)
    except runs.RunNotFoundError:  # a run stopped before its first step ended
        trajectories = None
    config = validate_config(raw, source=f"run {run_id}'s resolved_config.json")
    return Recording(run_id, config, records, trajectories), raw
