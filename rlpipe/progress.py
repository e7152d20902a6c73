"""What ``rlpipe run`` shows while a run goes: start-up phases, steps, the end.

:func:`reporter` picks one of two faces by where stderr goes:

* **a terminal** — a rich progress bar with ETA and the step's key figures (reward,
  response length, step time, staleness in the async modes); each start-up phase
  (starting Ray, building workers, loading the model, the first step) shows while it
  runs and is printed with its duration when it ends.
* **a file or pipe** (CI, nohup, cluster logs) — plain lines: one per start-up phase
  with its duration, one per ``every`` steps with the same figures, so a log tail
  tells where a run is.

Both print the end summary: wall time, steps/s, the model and checkpoint folders and
the command that opens the MLflow UI on the run.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

KEY_METRICS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("resp_len", "generate/response_length_mean", "{:.1f}"),
    ("step_s", "step_s", "{:.2f}"),
    ("staleness", "staleness/mean", "{:.2f}"),
)
"""(label, metric, format) of the figures shown per step; absent metrics are left out."""


def step_figures(metrics: dict[str, float]) -> str:
    """``reward 0.412  resp_len 2.0  step_s 0.05`` from a step's metrics."""
    parts = []
    for label, key, fmt in KEY_METRICS:
        value = metrics.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    return "  ".join(parts)


@dataclass
class RunEnd:
    """What the end summary tells."""

    steps: int
    """Steps run by this invocation."""
    wall_s: float
    model_dir: str
    checkpoint_dir: str | None
    run_id: str | None
    ui_command: str | None
    reward: float | None = None
    """The last step's reward/mean."""
    ui_route: str | None = None
    """The UI's route to the run (``#/experiments/…``), shown after the ``mlflow ui`` address."""


class _Base:
    def __init__(self, name: str, total_steps: int, stream: TextIO):
        self.name, self.total, self.stream = name, total_steps, stream
        self.started = time.time()
        self._phase: tuple[str, float] | None = None
        self._last_step_end: float | None = None
        self.first_step: int | None = None

    def phase(self, name: str) -> None:
        """A start-up phase begins (and the previous one ends)."""
        self._end_phase()
        self._phase = (name, time.time())
        self._show_phase(name)

    def _end_phase(self) -> None:
        if self._phase is not None:
            name, t = self._phase
            self._phase = None
            self._phase_done(name, time.time() - t)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        """A global step ended with ``metrics``."""
        self._end_phase()
        now = time.time()
        if self.first_step is None:
            self.first_step = step
        metrics = dict(metrics)
        if self._last_step_end is not None:
            metrics["step_s"] = now - self._last_step_end
        self._last_step_end = now
        self._step_done(step, metrics)

    def finish(self, end: RunEnd, out: TextIO | None = None) -> None:
        """End the display and print the summary to ``out`` (default stdout: the command's answer)."""
        self._end_phase()
        self.close()
        rate = end.steps / end.wall_s if end.wall_s > 0 else 0.0
        reward = "" if end.reward is None else f", final reward/mean {end.reward:.3f}"
        lines = [f"done: {end.steps} steps in {end.wall_s:.1f}s ({rate:.2f} steps/s){reward}", f"model: {end.model_dir}"]
        if end.checkpoint_dir:
            lines.append(f"checkpoints: {end.checkpoint_dir}")
        if end.run_id:
            lines.append(f"MLflow run id: {end.run_id}")
        if end.ui_command:
            lines.append(f"open it with:  {end.ui_command}")
            if end.ui_route:
                lines.append(f"then browse:   http://127.0.0.1:5000/{end.ui_route}")
        for line in lines:
            print(line, file=out or sys.stdout, flush=True)

    def _show_phase(self, name: str) -> None: ...
    def _phase_done(self, name: str, seconds: float) -> None: ...
    def _step_done(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None:
        """Stop the live display (safe to call twice)."""


class LogReporter(_Base):
    """Plain lines for logs: phases with durations, one line per ``every`` steps."""

    def __init__(self, name: str, total_steps: int, stream: TextIO, every: int = 1):
        super().__init__(name, total_steps, stream)
        self.every = max(1, every)
        self._first_end: tuple[int, float] | None = None

    def _line(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} [{self.name}] {text}", file=self.stream, flush=True)

    def _show_phase(self, name: str) -> None:
        self._line(f"{name} ...")

    def _phase_done(self, name: str, seconds: float) -> None:
        self._line(f"{name}: {seconds:.1f}s")

    def _step_done(self, step: int, metrics: dict[str, float]) -> None:
        done = step + 1
        if done % self.every and done != self.total:
            return
        now = time.time()
        if self._first_end is None:
            self._first_end = (done, now)
        first_done, first_end = self._first_end
        # steps after the first (warm-up) one set the pace; before there are any, the first does
        pace = (now - first_end) / (done - first_done) if done > first_done else now - self.started
        eta = (self.total - done) * pace
        self._line(f"step {done}/{self.total}  {step_figures(metrics)}  elapsed {now - self.started:.0f}s  eta {eta:.0f}s")


class BarReporter(_Base):
    """A rich bar with ETA and the key figures; phases printed with their durations."""

    def __init__(self, name: str, total_steps: int, stream: TextIO):
        super().__init__(name, total_steps, stream)
        self.console = Console(file=stream)
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
                            TimeRemainingColumn(), console=self.console)
        self.task = self.bar.add_task(name, total=total_steps, status="")
        self.bar.start()

    def _show_phase(self, name: str) -> None:
        self.bar.update(self.task, status=f"{name} ...")

    def _phase_done(self, name: str, seconds: float) -> None:
        self.console.print(f"[green]✓[/] {name} [dim]{seconds:.1f}s[/]", highlight=False)

    def _step_done(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.update(self.task, completed=step + 1, status=step_figures(metrics))

    def close(self) -> None:
        if self.bar.live.is_started:
            self.bar.stop()


def reporter(name: str, total_steps: int, every: int = 1, stream: TextIO | None = None) -> _Base:
    """The bar on a terminal, log lines otherwise (``every``: steps between log lines)."""
    stream = stream or sys.stderr
    if stream.isatty():
        return BarReporter(name, total_steps, stream)
    return LogReporter(name, total_steps, stream, every)
