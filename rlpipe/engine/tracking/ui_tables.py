"""Tables the MLflow UI renders: sampled trajectories and the node lineage, as JSON table artifacts.

MLflow's artifact view shows a ``.json`` file as a table when it is in the
``split`` layout of :meth:`mlflow.MlflowClient.log_table` (``{"columns": [...],
"data": [[...], ...]}``) and listed in the run tag ``mlflow.loggedArtifacts``.
``log_table`` itself appends by downloading and re-uploading the whole file at
every call; the observer instead keeps the rows and rewrites each table now and
then (``tracking.figures_every``) and at the run's end, with the same layout and tag.

* ``tables/trajectories.json`` — the latest :data:`MAX_TRAJECTORY_ROWS` sampled
  trajectories (every step's sample stays in ``trajectories/step_*.parquet``): step, uid, prompt and
  response text (cut at :data:`MAX_TEXT` characters), reward, mean advantage over
  the response, token versions (min/max), prompt step, status, response length.
* ``tables/lineage.json`` — per node execution: step, node, kind/impl, worker,
  start (seconds since the run's first record), duration, rows, fingerprints,
  policy versions, trainer version, error. ``lineage/lineage.parquet`` stays the
  full record for tools.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

from rlpipe.engine.tracking.lineage import PROMPT_TEXT
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.schemas import batch as B

TRAJECTORIES_TABLE = "tables/trajectories.json"
LINEAGE_TABLE = "tables/lineage.json"
MAX_TEXT = 2000
"""Characters of prompt and response text kept per row."""
MAX_TRAJECTORY_ROWS = 5000
"""Rows of the trajectories table: the most recent ones (every step's sample stays in trajectories/*.parquet)."""


def _mean_per_row(table: pa.Table, name: str) -> list[float | None]:
    """Mean of a jagged float column per row (None for an empty or missing row)."""
    if name not in table.column_names:
        return [None] * table.num_rows
    col = table.column(name).combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy()
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.float64)
    sums = np.add.reduceat(flat, np.r_[0, np.cumsum(lengths)[:-1]]) if len(flat) else np.zeros(len(lengths))
    return [float(s / n) if n else None for s, n in zip(sums, lengths)]


def _versions(table: pa.Table) -> tuple[list, list, list]:
    """Per row: min and max token version, response length (None where there are no stamped tokens)."""
    n = table.num_rows
    if B.TOKEN_VERSIONS not in table.column_names:
        return [None] * n, [None] * n, [None] * n
    out_min, out_max, out_len = [], [], []
    for versions in table.column(B.TOKEN_VERSIONS).to_pylist():  # a sample of ≤ tracking.sample_trajectories rows
        v = [x for x in versions or [] if x is not None]
        out_min.append(min(v) if v else None)
        out_max.append(max(v) if v else None)
        out_len.append(len(versions or []))
    return out_min, out_max, out_len


def trajectory_rows(step: int, table: pa.Table) -> list[dict]:
    """The browsable rows of one step's sampled trajectories."""
    n = table.num_rows

    def col(name: str) -> list:
        return table.column(name).to_pylist() if name in table.column_names else [None] * n

    def text(values: list) -> list:
        return [None if v is None else str(v)[:MAX_TEXT] for v in values]

    vmin, vmax, length = _versions(table)
    columns = {
        "step": [step] * n,
        "uid": col(B.UID),
        "sample_index": col(B.SAMPLE_INDEX),
        "prompt": text(col(PROMPT_TEXT)),
        "response": text(col(B.RESPONSE_TEXT)),
        "reward": col(B.REWARD),
        "advantage": _mean_per_row(table, B.ADVANTAGES),
        "min_version": vmin,
        "max_version": vmax,
        "prompt_step": col(B.PROMPT_STEP),
        "status": col(B.STATUS),
        "response_tokens": length,
    }
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def lineage_rows(records: Iterable[NodeRecord]) -> list[dict]:
    """The browsable rows of node executions (sorted by step, then start)."""
    records = sorted(records, key=lambda r: (r.step, r.start_time))
    t0 = min((r.start_time for r in records), default=0.0)
    return [
        {
            "step": r.step, "node": r.node, "kind": r.kind, "impl": r.impl, "worker": r.worker,
            "start_s": round(r.start_time - t0, 4), "duration_s": round(r.duration_s, 4),
            "rows_in": r.rows_in, "rows_out": r.rows_out,
            "input_fingerprint": r.input_fingerprint[:12], "output_fingerprint": r.output_fingerprint[:12],
            "policy_versions": ",".join(map(str, r.policy_versions)), "trainer_version": r.trainer_version,
            "error": r.error,
        }
        for r in records
    ]


_TAG_LOCK = threading.Lock()


def write_table(client: MlflowClient, run_id: str, rows: list[dict], artifact_file: str, folder: Path) -> None:
    """Replace the table artifact ``artifact_file`` with ``rows`` and list it in ``mlflow.loggedArtifacts``."""
    local = folder / Path(artifact_file).name
    pd.DataFrame(rows).to_json(local, orient="split", index=False, date_format="iso")
    client.log_artifact(run_id, str(local), str(Path(artifact_file).parent))
    with _TAG_LOCK:  # read-modify-write of one tag: two tables written from two threads must not drop one
        logged = json.loads(client.get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        entry = {"path": artifact_file, "type": "table"}
        if entry not in logged:
            client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*logged, entry]))
