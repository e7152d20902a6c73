"""Extra metric loggers beside MLflow: TensorBoard and Weights & Biases (registry ``metric_logger``).

``tracking.loggers: [tensorboard, wandb]`` sends every step's metrics (the ones MLflow gets as the
pipeline run's metrics) to dashboards users already have; MLflow stays the lineage store (node
runs, traces, lineage parquet). They work with ``tracking.enabled: false`` too.

- ``tensorboard``: event files under ``<output_dir>/<run>/tensorboard`` (torch's SummaryWriter; the
  ``tensorboard`` package), one scalar per metric at its step, the resolved config as text.
- ``wandb``: a W&B run (``tracking.wandb``). Offline by default: the run is written under
  ``<output_dir>/<run>/wandb`` with no network, and ``wandb sync`` uploads it later.

A logger is a factory ``open(config, run_id, run_dir) -> handle`` whose handle has ``log(step,
metrics)`` and ``close(status)``, and a ``check(config)`` run by ``rlpipe validate`` (the package is
importable). They run on a writer thread of their own (BackgroundObserver): a slow dashboard does not
hold the step. A logger that fails while the run goes on is switched off with one warning; the run
and MLflow continue (a dashboard is not worth a training run).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from rlpipe.errors import ConfigError
from rlpipe.registry import registry

log = logging.getLogger(__name__)

METRIC_LOGGERS = registry("metric_logger")

TENSORBOARD_FLUSH_S = 10
"""Seconds between the SummaryWriter's flushes to disk (its default, 120, hides a short run's curves)."""


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str) -> None: ...


@dataclass(frozen=True)
class MetricLoggerSpec:
    """A registered metric logger: how to open it for a run and how ``validate`` checks it can."""

    open: Callable[[Any, str, Path], MetricSink]
    """``open(config, run_id, run_dir)``: the sink of one run (config: the validated PipelineConfig)."""
    package: str
    """The module it needs; ``check`` refuses the config when it is not importable."""
    install: str
    """How to install that module (shown in the error)."""

    def check(self, name: str) -> None:
        if importlib.util.find_spec(self.package) is None:
            raise ConfigError(f"tracking.loggers: {name!r} needs the {self.package} package, which is not installed; "
                              f"{self.install}, or remove {name!r} from tracking.loggers")


def check_loggers(config) -> None:
    """Every name in ``tracking.loggers`` is registered (did-you-mean otherwise) and can be opened here."""
    for name in config.tracking.loggers:
        METRIC_LOGGERS.get(name).check(name)


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics as floats, without the non-finite ones (a NaN loss is in MLflow and the run's error)."""
    out = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[key] = number
    return out


class TensorBoardSink:
    def __init__(self, config, run_id: str, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=TENSORBOARD_FLUSH_S)
        self.writer.add_text("config", f"```\n{config.model_dump_json(indent=2)}\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in finite_metrics(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()


class WandbSink:
    def __init__(self, config, run_id: str, run_dir: Path):
        import wandb

        settings = config.tracking.wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project or config.tracking.experiment, entity=settings.entity, name=config.name,
            id=run_id, resume="allow", dir=str(run_dir), mode=settings.mode, tags=list(settings.tags),
            config=config.model_dump(mode="json"), settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(finite_metrics(metrics), step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


METRIC_LOGGERS.add("tensorboard", MetricLoggerSpec(
    TensorBoardSink, "tensorboard", "pip install tensorboard (or pip install 'rlpipe[loggers]')"))
METRIC_LOGGERS.add("wandb", MetricLoggerSpec(WandbSink, "wandb", "pip install wandb (or pip install 'rlpipe[loggers]')"))


class MetricLoggersObserver:
    """The observer half of the loggers: opens each at run start, forwards step metrics, closes them.

    Only step ends are forwarded (node records, trajectories and artifacts are MLflow's)."""

    def __init__(self, config, run_id: str, run_dir: Path):
        self.config, self.run_id, self.run_dir = config, run_id, run_dir
        self.sinks: dict[str, MetricSink] = {}

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        for name in self.config.tracking.loggers:
            try:
                self.sinks[name] = METRIC_LOGGERS.get(name).open(self.config, self.run_id, self.run_dir)
            except Exception as exc:  # noqa: BLE001 - a dashboard that cannot open does not stop the run
                log.warning("tracking.loggers: %s could not start (%s: %s); the run goes on without it",
                            name, type(exc).__name__, exc)
        return self.run_id

    def on_metrics(self, step, metrics) -> None:
        self.on_step_end(step, metrics, None)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, metrics)
            except Exception as exc:  # noqa: BLE001
                log.warning("tracking.loggers: %s failed at step %d (%s: %s); it is off for the rest of the run",
                            name, step, type(exc).__name__, exc)
                self.sinks.pop(name)

    def on_node_end(self, record) -> None:
        pass

    def on_artifact(self, local_path, artifact_path=None) -> None:
        pass

    def on_run_end(self, status, error=None) -> None:
        for name, sink in self.sinks.items():
            try:
                sink.close(status)
            except Exception as exc:  # noqa: BLE001
                log.warning("tracking.loggers: %s did not close cleanly (%s: %s)", name, type(exc).__name__, exc)
        self.sinks = {}


def open_metric_loggers(config, run_id: str):
    """The loggers' observer of run ``run_id``, on a writer thread of its own, in the run's output folder."""
    from rlpipe.engine.runtime import run_output_dir
    from rlpipe.engine.tracking.background_observer import BackgroundObserver

    inner = MetricLoggersObserver(config, run_id, Path(run_output_dir(config, run_id)))
    return BackgroundObserver(inner, config.tracking.drain_timeout_s)


def with_metric_loggers(observer, config):
    """``observer`` with the run's ``tracking.loggers`` behind it (itself when there are none)."""
    if not config.tracking.loggers:
        return observer
    return FanOutObserver(observer, lambda run_id: open_metric_loggers(config, run_id))


class FanOutObserver:
    """The run's observer (MLflow or none) first, then the metric loggers, opened with its run id."""

    def __init__(self, primary, open_secondary: Callable[[str], Any]):
        self.primary = primary
        self.open_secondary = open_secondary
        self.secondary = None

    def __getattr__(self, name: str):  # the primary's extras (spooled, run_id ...) stay reachable
        return getattr(self.__dict__["primary"], name)

    def on_run_start(self, config, pipeline_yaml, plan_summary) -> str:
        run_id = self.primary.on_run_start(config, pipeline_yaml, plan_summary)
        self.secondary = self.open_secondary(run_id)
        self.secondary.on_run_start(config, pipeline_yaml, plan_summary)
        return run_id

    def on_node_end(self, record) -> None:
        self.primary.on_node_end(record)

    def on_step_end(self, step, metrics, trajectories, trajectory_lineage=None) -> None:
        self.primary.on_step_end(step, metrics, trajectories, trajectory_lineage)
        if self.secondary is not None:
            self.secondary.on_step_end(step, metrics, None)

    def on_metrics(self, step, metrics) -> None:
        self.primary.on_metrics(step, metrics)
        if self.secondary is not None:
            self.secondary.on_metrics(step, metrics)

    def on_artifact(self, local_path, artifact_path=None) -> None:
        self.primary.on_artifact(local_path, artifact_path)

    def on_node_input(self, step, node, table, context) -> None:
        if hasattr(self.primary, "on_node_input"):
            self.primary.on_node_input(step, node, table, context)

    def on_run_end(self, status, error=None) -> None:
        try:
            self.primary.on_run_end(status, error)
        finally:
            if self.secondary is not None:
                self.secondary.on_run_end(status, error)
