"""The MLflow experiment and tags a pipeline run starts in, and the error raised when it cannot start.

Kept apart from :mod:`rlpipe.engine.tracking.mlflow_observer`: finding or creating the experiment (where
a sqlite store keeps its artifacts, the experiment kind the UI opens on) and turning the plan summary
into tags need an MLflow client and the store's address, none of the observer's state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from rlpipe.engine.tracking.mlflow_names import key as _key
from rlpipe.errors import RlpipeError

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""The experiment kind MLflow 3's UI opens on its training runs (not on the GenAI overview)."""


class TrackingError(RlpipeError):
    """MLflow tracking cannot start."""


def open_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """The id of experiment ``name`` (created if missing, tagged with the experiment kind)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(
                f"MLflow experiment {name!r} at {tracking_uri} is deleted; restore it "
                f"(`mlflow experiments restore`) or set tracking.experiment to another name"
            )
        if EXPERIMENT_KIND_TAG not in exp.tags:  # an experiment without a kind opens on the GenAI overview
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(tracking_uri, name),
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:
        exp = client.get_experiment_by_name(name)  # another process created it meanwhile
        if exp is None:
            raise
        return exp.experiment_id


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a local sqlite store live next to the database, wherever the run was started from."""
    if not tracking_uri.startswith("sqlite:///"):
        return None  # servers and other stores: their own default
    db = Path(tracking_uri[len("sqlite:///") :]).expanduser().resolve()
    return str(db.parent / "mlruns" / _key(experiment).replace("/", "_"))


def summary_tags(summary: dict[str, Any]) -> dict[str, str]:
    """Parent-run tags ``rlpipe.<key>`` from the plan summary (large structures are left out)."""
    tags: dict[str, str] = {}
    for k, v in summary.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            tags[_key(f"rlpipe.{k}")] = str(v)[:MAX_TAG_VAL_LENGTH]
        elif isinstance(v, list) and v and all(isinstance(x, dict) and "name" in x for x in v):
            tags[_key(f"rlpipe.{k}")] = ",".join(str(x["name"]) for x in v)[:MAX_TAG_VAL_LENGTH]
        else:
            text = json.dumps(v, sort_keys=True, default=str)
            if len(text) <= 500:  # larger structures live in plan_summary.json only
                tags[_key(f"rlpipe.{k}")] = text
    return tags
