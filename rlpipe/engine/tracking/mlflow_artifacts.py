"""What an :class:`~rlpipe.engine.tracking.mlflow_observer.MLflowObserver` writes as artifacts of its parent run.

The per-step lineage parts and the whole-run lineage files, the sampled trajectories, the recorded node
inputs (``batches/``, for ``rlpipe replay``), the browsable tables and figures, the run report, and the files
handed to ``on_artifact`` (the layout is in the observer's module docstring). Kept apart from the observer, which
keeps the Observer protocol, the run's start and resume, and the buffered metrics and traces: these
methods only write out what the observer has collected.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlpipe.engine.tracking import figures, runs, ui_tables
from rlpipe.engine.tracking.lineage import params_json, records_to_table
from rlpipe.engine.tracking.mlflow_names import key as _key
from rlpipe.engine.tracking.observer import NodeRecord

log = logging.getLogger(__name__)


class ArtifactWriter:
    """Mixin of :class:`~rlpipe.engine.tracking.mlflow_observer.MLflowObserver`: its artifact writes.

    The observer provides ``client``, ``run_id``, ``tracking``, ``tracking_uri``, ``_tmp`` (the local staging
    folder), ``_artifact_uri`` and what it collected: ``_records``, ``_trajectory_lineage``, ``_trajectory_rows``,
    ``_dirty_steps`` and ``_rewards``. Callers hold the observer's lock.
    """

    def _write_trajectory_parts(self, table: pa.Table) -> None:
        """The consumed trajectories of ``table``'s consuming steps (their versions and prompt step), one
        part per step under ``lineage/trajectories/`` (a step written again replaces its part)."""
        steps = pc.unique(table.column("consumed_step")).to_pylist()
        for step in steps:
            part = table if len(steps) == 1 else table.filter(pc.equal(table.column("consumed_step"), step))
            self._log_parquet(part, runs.TRAJECTORY_LINEAGE_STEPS_DIR, f"step_{step:06d}.parquet")

    def _log_parquet(self, table: pa.Table, artifact_dir: str, name: str) -> None:
        folder = self._tmp / artifact_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        pq.write_table(table, path)
        self.client.log_artifact(self.run_id, str(path), artifact_dir)
        path.unlink()

    def _log_node_input(self, step: int, node: str, table: pa.Table, context: dict[str, Any]) -> None:
        folder = self._tmp / "batches"
        folder.mkdir(exist_ok=True)
        name = _key(node).replace("/", "_")
        dest = f"{runs.BATCHES_DIR}/step_{step:06d}"
        parquet, context_file = folder / f"{name}.parquet", folder / f"{name}.json"
        # non-compliant nesting keeps list children named "item": the batch reads back with its exact types
        pq.write_table(table, parquet, use_compliant_nested_type=False)
        context_file.write_text(params_json(context))
        for path in (parquet, context_file):
            self.client.log_artifact(self.run_id, str(path), dest)
            path.unlink()

    def _log_trajectories(self, step: int, trajectories: Any) -> None:
        if isinstance(trajectories, pa.RecordBatch):
            trajectories = pa.Table.from_batches([trajectories])
        elif not isinstance(trajectories, pa.Table):
            trajectories = pa.Table.from_pandas(trajectories, preserve_index=False)
        table = trajectories.slice(0, self.tracking.sample_trajectories)
        folder = self._tmp / runs.TRAJECTORIES_DIR
        folder.mkdir(exist_ok=True)
        path = folder / f"step_{step:06d}.parquet"
        pq.write_table(table, path)
        self.client.log_artifact(self.run_id, str(path), runs.TRAJECTORIES_DIR)
        path.unlink()
        self._trajectory_rows.extend(ui_tables.trajectory_rows(step, table))
        del self._trajectory_rows[: -ui_tables.MAX_TRAJECTORY_ROWS]

    def _write_views(self) -> None:
        """Figures (figures/*.png) and the browsable tables (tables/*.json) from what the run has so far."""
        records = [r for step in sorted(self._records) for r in self._records[step].values()]
        folder = self._tmp / "tables"
        folder.mkdir(exist_ok=True)
        if self._trajectory_rows:
            ui_tables.write_table(self.client, self.run_id, self._trajectory_rows, ui_tables.TRAJECTORIES_TABLE, folder)
        if records:
            ui_tables.write_table(self.client, self.run_id, ui_tables.lineage_rows(records), ui_tables.LINEAGE_TABLE,
                                  folder)
        lineage = pa.concat_tables(self._trajectory_lineage) if self._trajectory_lineage else None
        by_step = {step: list(recs.values()) for step, recs in self._records.items()}
        figures.log_figures(self.client, self.run_id, self._rewards, by_step, lineage)

    def _write_report(self, status: str) -> None:
        """``report.html`` (:mod:`~rlpipe.engine.tracking.report`) from the records, trajectory lineage and rewards
        held here; the sampled trajectories (a bounded few) and the tokenizer are read back from the store.

        Never raises and is not a tracking failure: the report only shows what is already stored, so one that
        cannot be written is a warning (``rlpipe report RUN`` writes it later), not a call for the spool."""
        try:
            self._report(status)
        except Exception as exc:  # noqa: BLE001 - whatever broke, the run and its tracking go on
            log.warning("the run report (report.html) was not written: %s: %s; `rlpipe report %s` writes it",
                        type(exc).__name__, exc, self.run_id, exc_info=log.isEnabledFor(logging.DEBUG))

    def _report(self, status: str) -> None:
        from rlpipe.engine.tracking import report
        from rlpipe.engine.tracking.report.read import gather

        records = [r for step in sorted(self._records) for r in self._step_records(step)]
        lineage = pa.concat_tables(self._trajectory_lineage) if self._trajectory_lineage else None
        started = time.perf_counter()
        data = gather(self.run_id, self.tracking_uri, status=status, records=records, trajectory_lineage=lineage,
                      rewards=self._rewards)
        self.client.log_artifact(self.run_id, str(report.write(data, self._tmp / report.REPORT_ARTIFACT)))
        log.info("run report written in %.2f s", time.perf_counter() - started)

    def _step_records(self, step: int) -> list[NodeRecord]:
        return sorted(self._records.get(step, {}).values(), key=lambda r: r.start_time)

    def _write_lineage_parts(self) -> None:
        """A part per step that got records since the last write (``lineage/steps/``)."""
        for step in sorted(self._dirty_steps):
            if self._records.get(step):
                self._log_parquet(records_to_table(self._step_records(step)), runs.LINEAGE_STEPS_DIR,
                                  f"step_{step:06d}.parquet")
            self._dirty_steps.discard(step)

    def _write_whole_lineage(self) -> None:
        """``lineage/lineage.parquet`` and ``lineage/trajectories.parquet``: the whole run in one file each."""
        records = [r for step in sorted(self._records) for r in self._step_records(step)]
        if records:
            self._log_parquet(records_to_table(records), "lineage", "lineage.parquet")
        if self._trajectory_lineage:
            self._log_parquet(pa.concat_tables(self._trajectory_lineage), "lineage", "trajectories.parquet")

    def _log_artifact(self, local: Path, artifact_path: str | None) -> None:
        if not local.exists():
            raise FileNotFoundError(f"{local} does not exist")
        if local.is_dir():
            dest = artifact_path or local.name
            self.client.log_artifacts(self.run_id, str(local), dest)
        else:
            dest = f"{artifact_path.rstrip('/')}/{local.name}" if artifact_path else local.name
            self.client.log_artifact(self.run_id, str(local), artifact_path)
        uri = f"{self._artifact_uri}/{dest}"
        self.client.set_tag(self.run_id, _key(f"rlpipe.artifact.{dest}"), uri)
