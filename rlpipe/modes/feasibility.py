"""Configurations that cannot make progress, decided from the config alone (no recording, no simulation).

``rlpipe simulate``'s event model (:mod:`rlpipe.simulate`) finds these by running them; these few are
certain before anything runs, so ``rlpipe validate`` refuses them (the async modes' plan check calls
:func:`progress_blockers`) and ``rlpipe simulate`` gives them its ``no_progress`` verdict. Each message
says what happens, with the numbers, and what to set:

* ``colocate_async`` with ``overlap`` submits step k+1's prompts during step k; they are consumed
  at step k+1 with staleness 2. Below a threshold of 2 the buffer refuses them (``wait``: the
  run fails at the first step) or drops every one (``drop``: the trainer waits forever — the mode
  has no stall timeout).
* A replay buffer whose ``sampler_params`` make its capacity (``capacity_steps × groups_per_step``
  prompts) smaller than a step's batch (``data.prompts_per_step`` groups) never holds a batch.
* A replay buffer whose ``group_size`` is not the generate stage's ``n``: a larger one never
  completes a group, a smaller one refuses the extra samples.

Not decidable from the config: whether generation keeps up, how much a threshold drops, whether a
guard stricter than the buffer trips (it depends on timing) — ``rlpipe simulate`` predicts those.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_SIMULATING: ContextVar[bool] = ContextVar("rlpipe_simulating", default=False)


@contextmanager
def simulating() -> Iterator[None]:
    """Within: the plan check lets blocked configurations through (``rlpipe simulate`` plans one to show what it
    does; it reports the blockers as its verdict)."""
    token = _SIMULATING.set(True)
    try:
        yield
    finally:
        _SIMULATING.reset(token)


def refusing() -> bool:
    """Whether the plan check refuses blocked configurations (everywhere but inside :func:`simulating`)."""
    return not _SIMULATING.get()


def progress_blockers(config, plan, sampler_params: Any | None) -> list[str]:
    """Why ``config`` cannot make progress (empty: nothing certain). ``plan``: its checked plan (the validated
    mode params, the generate node); ``sampler_params``: the async modes' validated sampler params (None: sync)."""
    out = []
    mode_params = plan.mode_params
    threshold = getattr(mode_params, "max_off_policy_threshold", None)
    if config.mode == "colocate_async" and getattr(mode_params, "overlap", False) and threshold is not None \
            and threshold < 2:
        fate = ("drops every one of them and the trainer waits forever" if mode_params.strategy == "drop"
                else "refuses them and the run fails at step 0")
        out.append(f"colocate_async with overlap: true submits step k+1's prompts during step k, so they are "
                   f"consumed with staleness 2 > mode_params.max_off_policy_threshold={threshold}: the replay buffer "
                   f"{fate}; set mode_params.max_off_policy_threshold: 2 (or overlap: false)")
    if sampler_params is None:
        return out
    groups = config.data.prompts_per_step
    steps, per_step = getattr(sampler_params, "capacity_steps", None), getattr(sampler_params, "groups_per_step", None)
    if steps is not None and per_step is not None and steps * per_step < groups:
        out.append(f"the replay buffer holds at most capacity_steps × groups_per_step = {steps} × {per_step} = "
                   f"{steps * per_step} prompts but a step trains on data.prompts_per_step={groups} groups: no batch "
                   f"can ever be served; drop groups_per_step from mode_params.sampler_params (the mode sets it) or "
                   f"raise capacity_steps to {-(-groups // per_step)}")
    size = getattr(sampler_params, "group_size", None)
    gen = plan.anchor("generates")
    n = getattr(gen.params, "n", None) if gen is not None else None
    if size is not None and n is not None and size != n:
        fate = "never completes a group" if size > n else "refuses the samples beyond its group_size"
        out.append(f"the replay buffer's group_size={size} (mode_params.sampler_params) is not the generate stage's "
                   f"n={n}: it {fate}; drop group_size from sampler_params (the mode sets it from n)")
    return out
