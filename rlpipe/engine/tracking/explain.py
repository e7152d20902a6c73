"""Answers about a recorded run, for ``rlpipe lineage`` and ``rlpipe runs``: plain rows, no printing.

* :func:`find_run` — a pipeline run by id, unique id prefix, run name, or ``latest``.
* :func:`recent_runs` — pipeline runs, newest first: status, steps done, last reward.
* :func:`step_nodes` — one step's node executions: durations, rows, fingerprints, versions.
* :func:`trajectory_story` — one trajectory (a prompt uid; every sample of it): the step
  that drew its prompt, the rollout replica, the policy versions of its tokens, the step
  that consumed it, and the update and weight push it fed.

Everything is read back from what :mod:`rlpipe.engine.tracking.mlflow_observer` wrote
(lineage Parquet, trajectory lineage, the trajectories table), with the plain MLflow client.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc
from mlflow.entities import Run

from rlpipe.engine.tracking import runs, ui_tables
from rlpipe.engine.tracking.lineage import table_to_records
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.stage_kinds import step_role_of


def _pipeline_runs(uri: str, experiment: str | None, max_results: int, extra_filter: str = "") -> list[Run]:
    c = runs.client(uri)
    if experiment is not None:
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            raise runs.RunNotFoundError(f"no MLflow experiment {experiment!r} at {uri}; `rlpipe runs` lists what there is")
        ids = [exp.experiment_id]
    else:
        ids = [e.experiment_id for e in c.search_experiments()]
    where = f"tags.`{runs.ROLE_TAG}` = '{runs.ROLE_PIPELINE}'" + (f" and {extra_filter}" if extra_filter else "")
    return c.search_runs(ids, filter_string=where, order_by=["attributes.start_time DESC"], max_results=max_results)


def find_run(ref: str, tracking_uri: str | None = None, experiment: str | None = None) -> Run:
    """The pipeline run ``ref`` names: ``latest``, a run id, a unique prefix of one (≥ 4 characters), or a run name."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    c = runs.client(uri)
    if ref == "latest":
        found = _pipeline_runs(uri, experiment, 1)
        if not found:
            raise runs.RunNotFoundError(f"no rlpipe run at {uri}; run a pipeline with tracking enabled first")
        return found[0]
    if len(ref) == 32:
        try:
            return c.get_run(ref)
        except Exception:  # noqa: BLE001 - MLflow raises per store; fall through to the search
            pass
    candidates = _pipeline_runs(uri, experiment, 1000)
    matches = [r for r in candidates if len(ref) >= 4 and r.info.run_id.startswith(ref)]
    matches = matches or [r for r in candidates if r.info.run_name == ref][:1]  # a name: its newest run
    if len(matches) != 1:
        what = "matches several runs" if matches else "matches no rlpipe run"
        raise runs.RunNotFoundError(
            f"{ref!r} {what} at {uri}; give a run id (or a longer prefix) from `rlpipe runs`"
            " (--tracking-uri / MLFLOW_TRACKING_URI pick the store)"
        )
    return matches[0]


@dataclass
class RunSummary:
    """One line of ``rlpipe runs``."""

    run_id: str
    name: str
    experiment: str
    status: str
    mode: str
    steps: int
    """Steps finished (the last logged step + 1)."""
    total_steps: int | None
    reward: float | None
    """The last reward/mean."""
    started_ms: int
    duration_s: float | None


def recent_runs(tracking_uri: str | None = None, experiment: str | None = None, limit: int = 20) -> list[RunSummary]:
    """Pipeline runs of ``experiment`` (default: every experiment), newest first."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    c = runs.client(uri)
    names = {e.experiment_id: e.name for e in c.search_experiments()}
    out = []
    for r in _pipeline_runs(uri, experiment, limit):
        m, p = r.data.metrics, r.data.params
        total = r.data.tags.get("rlpipe.extended_to") or p.get("trainer.total_steps")  # --extend raises it
        end = r.info.end_time
        out.append(RunSummary(
            run_id=r.info.run_id, name=r.info.run_name, experiment=names.get(r.info.experiment_id, "?"),
            status=r.info.status, mode=r.data.tags.get("rlpipe.mode", "?"),
            steps=int(m["step"]) + 1 if "step" in m else 0, total_steps=int(total) if total else None,
            reward=m.get("reward/mean"), started_ms=r.info.start_time,
            duration_s=(end - r.info.start_time) / 1000 if end else None,
        ))
    return out


def _records(run_id: str, uri: str) -> list[NodeRecord]:
    return table_to_records(runs.lineage_table(run_id, uri))


def step_nodes(run_id: str, step: int, tracking_uri: str | None = None) -> list[NodeRecord]:
    """The node executions of ``step`` in start order."""
    records = _records(run_id, runs.resolve_tracking_uri(tracking_uri))
    found = sorted((r for r in records if r.step == step), key=lambda r: r.start_time)
    if not found:
        steps = sorted({r.step for r in records})
        where = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
        raise runs.RunNotFoundError(f"run {run_id} has no record of step {step} (it has {where})")
    return found


@dataclass
class TrajectoryStory:
    """Where one trajectory (one sample of a prompt) came from and what it fed."""

    uid: str
    sample_index: int | None
    prompt_step: int | None
    """The step that drew its prompt (in async modes, earlier than the consuming step)."""
    replica: int | None
    """The rollout replica that generated it (None: not recorded; -1: the trainer, separate_async's borrow)."""
    num_tokens: int
    min_version: int | None
    max_version: int | None
    """Oldest and newest policy version among its tokens."""
    versions_spanned: int
    consumed_step: int
    update: NodeRecord | None
    """The update node execution of the consuming step (trained on it)."""
    weight_push: NodeRecord | None
    """The weight push after that update: the version of the weights it helped make."""
    sampled: dict = field(default_factory=dict)
    """Its row of the trajectories table (prompt, response, reward, advantage), when it was sampled."""


def trajectory_story(run_id: str, uid: str, tracking_uri: str | None = None) -> list[TrajectoryStory]:
    """Every consumed sample of prompt ``uid`` with its lineage."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    table = runs.trajectory_lineage_table(run_id, uri)
    rows = table.filter(pc.equal(table.column("uid"), uid)).to_pylist()
    if not rows:
        example = table.column("uid")[0].as_py() if table.num_rows else None
        raise runs.RunNotFoundError(
            f"run {run_id} consumed no trajectory with uid {uid!r}"
            + (f" (uids look like {example!r}; `rlpipe lineage {run_id[:8]} --step S` shows a step)" if example else "")
        )
    records = _records(run_id, uri)
    sampled = {(r["uid"], r["sample_index"]): r for r in runs.table_rows(run_id, ui_tables.TRAJECTORIES_TABLE, uri)}
    out = []
    for row in sorted(rows, key=lambda r: (r["consumed_step"], r["sample_index"] or 0)):
        step = row["consumed_step"]
        in_step = sorted((r for r in records if r.step == step), key=lambda r: r.start_time)
        update = next((r for r in in_step if step_role_of(r.kind) == "updates_policy"), None)
        push = next((r for r in in_step if step_role_of(r.kind) == "pushes_weights" and (update is None or r.start_time >= update.start_time)),
                    None)
        out.append(TrajectoryStory(
            uid=uid, sample_index=row["sample_index"], prompt_step=row["prompt_step"], replica=row.get("replica"),
            num_tokens=row["num_tokens"], min_version=row["min_version"], max_version=row["max_version"],
            versions_spanned=row["versions_spanned"], consumed_step=step, update=update, weight_push=push,
            sampled=sampled.get((uid, row["sample_index"]), {}),
        ))
    return out


def overview(run_id: str, tracking_uri: str | None = None, examples: int = 3) -> tuple[list[int], list[str]]:
    """The steps with records, and a few uids the last step consumed."""
    uri = runs.resolve_tracking_uri(tracking_uri)
    steps = sorted({r.step for r in _records(run_id, uri)})
    try:
        table = runs.trajectory_lineage_table(run_id, uri)
    except runs.RunNotFoundError:
        return steps, []
    if not table.num_rows:
        return steps, []
    last = pc.max(table.column("consumed_step")).as_py()
    uids = pc.unique(table.filter(pc.equal(table.column("consumed_step"), last)).column("uid")).to_pylist()
    return steps, uids[:examples]
