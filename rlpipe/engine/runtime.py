"""One pipeline run: plan, tracking, Ray workers, the mode, the end.

``run_pipeline`` is what ``rlpipe run`` calls. Whatever happens, the observer
is told how the run ended, so metrics, lineage and saved models already
produced stay in MLflow.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.engine import interrupt
from rlpipe.engine.state import checkpoint
from rlpipe.engine.state.data import PromptLoader
from rlpipe.engine.host import run_thread_budget
from rlpipe.engine.execution.executor import Backend, StepExecutor
from rlpipe.engine.tracking.lineage import PROMPT_TEXT, trajectory_lineage
from rlpipe.engine.tracking.metric_loggers import with_metric_loggers
from rlpipe.engine.execution.inline import InlineBackend
from rlpipe.engine.tracking.observer import NullObserver, Observer
from rlpipe.engine.tracking.run_start import RunStart
from rlpipe.engine.tracking.spool import SPOOL_NAME
from rlpipe.engine.planning.plan import Plan, build_plan
from rlpipe.engine.resume import plan_resume, resolve_checkpoint
from rlpipe.engine.execution.ray_runtime import RayBackend, init_ray
from rlpipe.engine.files.ship import shares_filesystem, ship_model_dirs
from rlpipe.registry import registry
from rlpipe.errors import RlpipeError
from rlpipe.schemas.batch import PROMPT_IDS, REWARD, STATUS, STATUS_FAILED, UID
from rlpipe.schemas.config import PipelineConfig

log = logging.getLogger(__name__)

STEP_END_METRIC = "timing/step_end_s"
"""A step metric: the driver's seconds on the step's records (node records, headline, sampled trajectories,
trajectory lineage) before it hands them to the tracking process."""
DRIVER_CALL_METRIC = "timing/driver_call_s"
"""A step metric: the median round trip of the driver's calls to its workers during the step (the async modes'
buffer and rollout calls; absent where it made none): what ``rlpipe simulate`` charges a call of another mode's
protocol."""


@dataclass
class RunResult:
    """What a finished run leaves behind."""

    run_id: str
    output_dir: str
    final_metrics: dict[str, float]
    steps: int
    """Steps this invocation ran (a resumed run counts only the steps after its checkpoint)."""
    model_dir: str = ""
    """The final model's folder."""
    checkpoint_dir: str | None = None
    """Where step checkpoints went (None: none written)."""


class Runtime:
    """The live parts of a run, shared by the mode and the executor."""

    def __init__(self, config: PipelineConfig, plan: Plan, observer: Observer, run_id: str, backend: Backend,
                 on_step: Callable[[int, dict[str, float]], None] | None = None):
        self.config = config
        self.plan = plan
        self.observer = observer
        self.run_id = run_id
        self.on_step = on_step
        self.start_step = 0
        self.output_dir = run_output_dir(config, run_id)
        self.tokenizer = build_tokenizer(config.tokenizer)
        self.loader = PromptLoader(config.data, self.tokenizer, config.seed)
        self.backend = backend
        self.workers = backend.workers
        record = config.tracking.record_batches_every if config.tracking.enabled else 0
        self.executor = StepExecutor(plan, backend, observer, run_id, config.seed, record,
                                     config.resources.concurrent_branches)
        self.last_metrics: dict[str, float] = {}
        self.failed_steps: list[int] = []
        """The current run of consecutive steps whose every row failed (trainer.max_failed_steps)."""
        self.steps_run = 0
        self._initial_sync()

    def _initial_sync(self) -> None:
        """Version 0 everywhere: rollout and reference start from the trainer's weights. With trainer.lora the push
        holds the (zero-delta) adapters and the reference keeps the base it built, which is a LoRA run's reference."""
        buckets = self.workers.call_async("actor", "export_weights")[0]
        for role in ("rollout",) if self.config.trainer.lora is not None else ("rollout", "ref"):
            if self.workers.has_role(role):
                self.workers.call(role, "load_weights", buckets, 0)

    def end_step(self, step: int, table: pa.Table, metrics: dict[str, float]) -> None:
        """Headline metrics, sampled trajectories, periodic model saves. The step's node records come first: a
        mode that started the next step's run before ending this one left them pending (executor.finish), and they
        are written while that run's first call works."""
        began = time.perf_counter()
        self.executor.write_backlog()
        headline = {**metrics, **self._reward_headline(step, table)}
        headline["step"] = step
        headline["policy_version"] = self.executor.policy_version
        sample = self._sample(table)
        replicas = self.executor.replica_of
        lineage = trajectory_lineage(table, step, replicas)
        # the driver's own work on the step's records before the tracking process takes them (rlpipe simulate
        # charges it between a sync run's steps when it calibrates on an async run, whose steps overlap it)
        headline[STEP_END_METRIC] = time.perf_counter() - began
        if trips := self.workers.take_round_trips():
            headline[DRIVER_CALL_METRIC] = float(np.median(trips))
        self.observer.on_step_end(step, headline, sample, lineage)
        if UID in table.column_names:
            for uid in pc.unique(table.column(UID)).to_pylist():
                replicas.pop(uid, None)
        self.last_metrics = headline
        self._check_failed_steps(step)
        self.steps_run += 1
        if self._due(self.config.trainer.save_every, step):
            self.save_model(f"step_{step + 1}")
        if self._due(self.config.trainer.checkpoint_every, step):
            checkpoint.save(self, step + 1)
        if self.on_step:
            self.on_step(step, headline)

    def _reward_headline(self, step: int, table: pa.Table) -> dict[str, float]:
        """``reward/mean`` over the valid rows only and ``reward/failed_rows`` (status ``failed``: an
        infrastructure failure, not a wrong answer); a step whose every row failed is a warning and
        ``trainer.max_failed_steps`` of them in a row fail the run."""
        if not table.num_rows or REWARD not in table.column_names:
            return {}
        failed = np.zeros(table.num_rows, dtype=bool)
        if STATUS in table.column_names:
            failed = np.asarray(table.column(STATUS).to_pylist(), dtype=object) == STATUS_FAILED
        out = {"reward/failed_rows": float(failed.sum())}
        if not failed.all():
            out["reward/mean"] = float(np.mean(table.column(REWARD).to_numpy()[~failed]))
            self.failed_steps = []
            return out
        self.failed_steps.append(step)
        log.warning("step %d: all %d rows failed (infrastructure failures); nothing was learned from this step",
                    step, table.num_rows)
        return out

    def _check_failed_steps(self, step: int) -> None:
        limit = self.config.trainer.max_failed_steps
        if limit and len(self.failed_steps) >= limit:
            raise RlpipeError(
                f"steps {self.failed_steps[0]}-{step}: every row of {len(self.failed_steps)} consecutive steps is an "
                "infrastructure failure (status 'failed', see reward/infra_failures); fix the failing service (e.g. "
                "the reward sandbox) and resume, or raise trainer.max_failed_steps (0 disables this check)"
            )
    def _sample(self, table: pa.Table) -> pa.Table | None:
        """The trajectories shown in MLflow, with their prompts decoded (a few rows: cheap on the driver)."""
        n = self.config.tracking.sample_trajectories
        if not n:
            return None
        sample = table.slice(0, n)
        if PROMPT_IDS in sample.column_names and PROMPT_TEXT not in sample.column_names:
            texts = self.tokenizer.batch_decode(sample.column(PROMPT_IDS).to_pylist(), skip_special_tokens=True)
            sample = sample.append_column(PROMPT_TEXT, pa.array(texts, pa.string()))
        return sample

    def checkpoints_after(self, step: int) -> bool:
        """Whether :meth:`end_step` writes a checkpoint after ``step``."""
        return self._due(self.config.trainer.checkpoint_every, step)

    def _due(self, every: int, step: int) -> bool:
        """Every ``every`` steps (0 = never), except after the last step (the end of the run handles it)."""
        return bool(every) and (step + 1) % every == 0 and step + 1 < self.config.trainer.total_steps

    def save_model(self, tag: str) -> str:
        path = os.path.abspath(os.path.join(self.output_dir, tag))
        checkpoint.check_free_disk(Path(path), checkpoint.model_bytes(self), f"the model {tag!r}",
                                   "set trainer.save_every: 0")
        if self.backend.shared_filesystem:
            self.workers.call("actor", "save_hf", path)
        else:  # rank 0's files come through the object store; only the driver writes output_dir
            files = next((f for f in self.workers.call("actor", "hf_files") if f), None)
            if not files:
                raise RlpipeError(f"no actor rank returned the files of model {tag!r}; nothing was saved to {path}")
            checkpoint.write_files(Path(path), files, "actor rank 0")
        self.observer.on_artifact(path, f"model/{tag}")
        return path


def make_observer(config: PipelineConfig, resume_run_id: str | None = None,
                  tags: dict[str, str] | None = None) -> Observer:
    if not config.tracking.enabled:
        return NullObserver(resume_run_id)  # a resumed run goes on in its own output folder
    from rlpipe.engine.tracking.process_observer import mlflow_process_observer

    tracking = config.tracking
    # bound every MLflow HTTP call (its defaults retry one call for minutes); the user's environment wins
    # (set before the tracking process starts: it inherits this environment)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(tracking.http_timeout_s))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(tracking.http_max_retries))
    # the writer runs in its own process (off this one's GIL); the spool path must pickle, so no lambda
    spool_path = partial(spool_file, config.trainer.output_dir, config.name)
    observer = mlflow_process_observer(tracking, config.name, spool_path, resume_run_id=resume_run_id, tags=tags)
    observer.spawn()
    return observer


def spool_file(output_dir: str, name: str, run_id: str) -> Path:
    """The tracking spool of a run: in its output folder (:func:`run_output_dir`)."""
    return Path(output_dir) / f"{name}-{run_id[:8]}" / SPOOL_NAME


def run_output_dir(config: PipelineConfig, run_id: str) -> str:
    """``<trainer.output_dir>/<name>-<run id[:8]>``: where a run's models, checkpoints and tracking spool go."""
    return str(spool_file(config.trainer.output_dir, config.name, run_id).parent)


def run_pipeline(config: PipelineConfig, pipeline_yaml: str = "",
                 on_step: Callable[[int, dict[str, float]], None] | None = None,
                 observer: Observer | None = None, inline: bool = False,
                 resume_from: str | None = None, on_phase: Callable[[str], None] | None = None,
                 fork: bool = False, extend: bool = False) -> RunResult:
    """Plan, start, run every step, save the final model; returns where things are.

    ``inline=True`` runs every stage in this process (no Ray): for benchmarks and tests.
    ``resume_from`` continues from a checkpoint folder (trainer.checkpoint_every); a finished run
    only with ``fork`` (a new run linked to it) or ``extend`` (more steps, same run): see rlpipe.engine.resume.
    ``on_phase(name)`` is told when each start-up phase begins (starting Ray, building workers,
    loading the model, the first step ...); the first ``on_step`` call ends the last one.
    """
    phase = on_phase or (lambda name: None)
    plan = build_plan(config)
    if resume_from:
        resume_from = str(resolve_checkpoint(resume_from))  # a run folder or its checkpoints/: the newest complete
    resume = plan_resume(config, resume_from, fork, extend) if resume_from else None
    resumed = resume.state if resume else None
    mode_cls = registry("mode").get(config.mode)
    # decided once, here: every worker process applies the number (rlpipe.engine.host); the logged config shows it
    roles, threads = run_thread_budget(config, plan, inline)
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"torch_threads": threads.threads})})
    log.info("torch threads per worker process: %d (%s)", threads.threads, threads.reason)
    observer = observer or make_observer(config, resume.run_id if resume else None, resume.tags if resume else None)
    observer = with_metric_loggers(observer, config)
    summary = plan.summary()
    if not inline:  # what the executor will do on Ray (rlpipe validate prints it too)
        from rlpipe.engine.execution.physical_plan import physical_plan

        summary["physical_plan"] = physical_plan(config, plan, roles)
    # the run opens in the tracking store while the workers start (rlpipe.engine.tracking.run_start)
    tracking = RunStart(observer, config.model_dump(mode="json"), pipeline_yaml, summary)
    beside = " (MLflow tracking starts beside it)" if config.tracking.enabled else ""
    runtime = backend = None
    finished = False
    started = time.time()
    try:
        try:
            if inline:
                phase("building workers in this process" + beside.replace(" it)", " them)"))
                backend = InlineBackend(config, roles)
            else:
                phase("starting Ray" + beside)
                init_ray(config.resources.ray_address, config.resources.num_cpus)
                tracking.raise_if_failed()
                shipped = None
                if not shares_filesystem(config, inline=False):
                    phase("packing the model folders into Ray's object store (resources.shared_filesystem: false)")
                    shipped = ship_model_dirs(config)
                phase(f"building workers ({', '.join(sorted(roles))})")
                backend = RayBackend.start(config, roles, shipped)
        finally:  # a run that failed to start its workers is still recorded, as FAILED
            if not tracking.done():
                phase("waiting for MLflow tracking to start")
            run_id = tracking.run_id()
        phase("loading data and the first weight sync")
        runtime = Runtime(config, plan, observer, run_id, backend, on_step)
        if resumed:
            phase("restoring the checkpoint")
            checkpoint.restore(runtime, resume_from, resumed)
        # the final model must fit: a full disk found now, not after all the training (checked again at the save)
        checkpoint.check_free_disk(Path(runtime.output_dir), checkpoint.model_bytes(runtime), "the final model",
                                   "lower the model's size")
        mode = mode_cls(runtime, plan.mode_params)
        phase(f"step {runtime.start_step} (the first: warm-up)")
        mode.run()
        phase("saving the final model")
        model_dir = runtime.save_model("final")
        if config.trainer.checkpoint_every:  # what --extend continues from
            checkpoint.save(runtime, config.trainer.total_steps)
        finished = True
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGINT/SIGTERM under `rlpipe run` (rlpipe.engine.interrupt)
        if tracking.opened() is not None:
            observer.on_run_end("KILLED", str(interrupt.stop_of(exc)))
        raise
    except BaseException as exc:
        if tracking.opened() is not None:  # none: the run never opened (the error says why)
            observer.on_run_end("FAILED", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if backend is not None:
            backend.shutdown(finished)
    observer.on_run_end("FINISHED")
    log.info("run %s finished in %.1fs", run_id, time.time() - started)
    checkpoints = Path(runtime.output_dir) / "checkpoints"
    return RunResult(run_id, runtime.output_dir, runtime.last_metrics, runtime.steps_run, model_dir,
                     str(checkpoints.resolve()) if checkpoints.is_dir() else None)
