"""A recorded run read back from MLflow for ``rlpipe simulate``: its config, lineage and trajectory lineage.

The same artifacts ``rlpipe lineage`` reads (:mod:`rlpipe.engine.tracking.runs`): the per-step
``lineage/steps/*.parquet`` parts (or ``lineage/lineage.parquet``), ``lineage/trajectories`` and the
run's ``resolved_config.json`` — the validated config the run was started with, which ``-o``
overrides change before they are validated again; and of an async run four step metrics: the wait
for its batch (``async/guard_wait_s``), its replicas' decode iterations (``rollout/decode_*``),
the driver's records of each step (``timing/step_end_s``) and its calls' round trips
(``timing/driver_call_s``).
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
    waits, decode, step_ends, calls = None, None, None, None
    if config.mode != "sync":  # the driver's wait for each batch (taken out of the step gaps), the replicas' decode
        from mlflow import MlflowClient  # iterations, the driver's own records of each step

        from rlpipe.engine.runtime import DRIVER_CALL_METRIC, STEP_END_METRIC
        from rlpipe.modes.async_common import DECODE_SUMS, WAIT_METRIC

        client = MlflowClient(uri)

        def history(name: str) -> dict[int, float]:
            return {int(m.step): float(m.value) for m in client.get_metric_history(run_id, name)}

        waits, step_ends = history(WAIT_METRIC) or None, history(STEP_END_METRIC) or None
        calls = history(DRIVER_CALL_METRIC) or None
        decode = {name: history(name) for name in DECODE_SUMS.values()}
        decode = decode if all(decode.values()) else None
    return Recording(run_id, config, records, trajectories, waits, decode, step_ends, calls), raw
