"""The report's data from a recorded run, through the readers ``rlpipe lineage`` and ``rlpipe simulate`` use
(:mod:`rlpipe.engine.tracking.runs`, :func:`rlpipe.engine.tracking.explain.find_run`).

At the end of a run the MLflow observer hands over what it holds in memory (node records, trajectory lineage,
rewards) instead of having them read back; the sampled trajectories and the tokenizer are read from the store
in both cases. Everything read is bounded: the trajectories of at most :data:`~.data.MAX_SAMPLE_STEPS` steps,
one tokenizer file.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pyarrow as pa

from rlpipe.engine.tracking import explain, runs
from rlpipe.engine.tracking.lineage import table_to_records
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.engine.tracking.report import data as D

log = logging.getLogger(__name__)

TOKENIZER_ARTIFACTS = ("model/final/tokenizer.json",)
"""Where a run keeps its tokenizer (the final model's folder, saved with it): decodes the shown tokens."""


def sampled_steps(run_id: str, tracking_uri: str | None = None) -> list[int]:
    """The steps whose sampled trajectories were logged (``trajectories/step_XXXXXX.parquet``), sorted."""
    found = runs.client(tracking_uri).list_artifacts(run_id, runs.TRAJECTORIES_DIR)
    names = (Path(a.path).name for a in found if not a.is_dir)
    return sorted(int(n[len("step_"):-len(".parquet")]) for n in names
                  if n.startswith("step_") and n.endswith(".parquet") and n[5:-8].isdigit())


def decoder(run_id: str, tracking_uri: str | None = None) -> Callable[[list[int]], list[str]] | None:
    """Each token id decoded alone, with the run's saved tokenizer (the ``tokenizers`` library: no transformers
    import); None when the run saved none."""
    from tokenizers import Tokenizer

    c = runs.client(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        for path in TOKENIZER_ARTIFACTS:
            try:
                local = c.download_artifacts(run_id, path, tmp)
            except Exception:  # noqa: BLE001 - absent: MLflow raises different types per artifact store
                continue
            tok = Tokenizer.from_file(local)
            return lambda ids: tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return None


def gather(run_id: str, tracking_uri: str | None = None, *, status: str | None = None,
           records: list[NodeRecord] | None = None, trajectory_lineage: pa.Table | None = None,
           rewards: Mapping[int, float] | None = None, prediction: D.Prediction | None = None) -> D.ReportData:
    """The report of run ``run_id``; ``records``, ``trajectory_lineage`` and ``rewards`` are read from the store
    when not given, ``status`` is the run's own unless given (the observer reports before it marks the run)."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    run = runs.client(uri).get_run(run_id)
    notes: list[str] = []
    if records is None:
        try:
            records = table_to_records(runs.lineage_table(run_id, uri))
        except runs.RunNotFoundError:
            records, _ = [], notes.append("no lineage recorded (the run stopped before its first step ended)")
    if trajectory_lineage is None:
        try:
            trajectory_lineage = runs.trajectory_lineage_table(run_id, uri)
        except runs.RunNotFoundError:
            trajectory_lineage = None
    if rewards is None:
        history = runs.metric_history(run_id, "reward/mean", uri)
        rewards = dict(zip(history["step"].astype(int), history["value"].astype(float)))
    tables = {}
    for step in D.pick_steps(sampled_steps(run_id, uri)):
        try:
            tables[step] = runs.trajectories(run_id, step, uri)
        except runs.RunNotFoundError as exc:
            notes.append(str(exc))
    if not tables:
        notes.append("no sampled trajectories (tracking.sample_trajectories: 0, or no step ended)")
    decode = None
    if tables:
        try:
            decode = decoder(run_id, uri)
        except Exception as exc:  # noqa: BLE001 - a tokenizer that does not load: ids instead of text
            log.warning("run report: the run's tokenizer did not load (%s); tokens are shown as ids", exc)
        if decode is None:
            notes.append("tokens are shown as [ids]: the run saved no tokenizer (model/final/tokenizer.json)")
    trajectories = D.sampled_trajectories(tables, decode=decode)
    mismatch = D.mismatch(tables)
    if tables and mismatch is None:
        notes.append("no log-prob mismatch: the sampled trajectories lack rollout_logprobs or old_logprobs")
    steps = {r.step for r in records} | set(rewards)
    return D.ReportData(
        run_id=run_id, run_name=run.info.run_name or "", status=status or run.info.status,
        mode=run.data.tags.get("rlpipe.mode", ""), steps=len(steps), timeline=D.timeline(records),
        series=D.series(rewards, trajectory_lineage), trajectories=trajectories,
        versions=D.token_versions(trajectories), mismatch=mismatch, prediction=prediction, notes=notes)


def gather_ref(run_ref: str, tracking_uri: str | None = None, experiment: str | None = None,
               prediction: D.Prediction | None = None) -> D.ReportData:
    """:func:`gather` of the run ``run_ref`` names (an id, a unique prefix, a name or ``latest``)."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    return gather(explain.find_run(run_ref, uri, experiment).info.run_id, uri, prediction=prediction)
