"""The one exception hierarchy of rlpipe.

Every error a user can cause derives from :class:`RlpipeError`, so the CLI can
print it without a traceback and exit non-zero. Messages say what is wrong *and*
what to do about it.
"""

from __future__ import annotations


class RlpipeError(Exception):
    """Base class of every error rlpipe raises on purpose."""


class ConfigError(RlpipeError):
    """A pipeline YAML (or an override) is invalid."""


class RegistryError(RlpipeError):
    """An unknown or duplicate name in one of the registries."""


class PlanError(RlpipeError):
    """The step DAG cannot be built: column contracts, cycles, impls, mode constraints."""


class StageError(RlpipeError):
    """A stage failed while running. Carries where: kind, impl and step."""

    def __init__(self, kind: str, impl: str, step: int, cause: BaseException | str, details: str = ""):
        self.kind = kind
        self.impl = impl
        self.step = step
        self.cause = cause
        self.details = details
        """The traceback where the stage failed (on its worker); ``rlpipe run`` writes it to the error log."""
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"stage {kind!r} (impl {impl!r}) failed at step {step}: {detail}")

    def __reduce__(self):  # keep the fields (and the worker's traceback) when Ray pickles the error across processes
        cause = self.cause if isinstance(self.cause, str) else f"{type(self.cause).__name__}: {self.cause}"
        return (type(self), (self.kind, self.impl, self.step, cause, self.details))  # the same text on both sides


class BatchError(RlpipeError):
    """A batch does not have the columns or types a stage needs."""
