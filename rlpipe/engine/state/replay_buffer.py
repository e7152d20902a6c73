"""The replay buffer of the async modes: prompt states, staleness-bounded sampling, DAPO refill.

Algorithm (verl's ``ReplayBufferAsync``, seed 7.2–7.3 and A.4; AReaL's capacity
control, Fu et al. 2025, https://arxiv.org/abs/2505.24298):

* Every prompt is a *group* of ``group_size`` trajectories with one state:
  pending → running → finished | failed. A prompt is finished when all its
  samples are back, failed when all of them are infrastructure failures.
* Staleness of a prompt consumed at step ``s`` = ``s − submit_step + 1``.
* Strategy **drop**: before sampling, finished groups whose staleness exceeds
  ``max_off_policy_threshold`` are evicted and refilled. In-flight prompts are
  left alone (they are evicted when they finish, if still too stale).
* Strategy **wait** (dropless): nothing is evicted for staleness; instead the
  buffer keeps a *schedule invariant* — for every future step ``t``, the
  unconsumed prompts that reach the threshold by ``t`` fit in the batches left
  until ``t``. ``sample`` blocks (returns None) while taking the oldest ready
  groups would break it, which includes verl's rule "block while any in-flight
  prompt has reached the threshold" and also covers groups that finish together
  and could not all be consumed in time; ``refill_needed``/``add_prompts`` admit
  new prompts only within it (AReaL's ``(η + v + 1)·B`` capacity, per level).
  Once every in-flight prompt has finished, the oldest groups always pass, so
  waiting terminates; consumed staleness never exceeds the threshold.
* **DAPO** (``filter_groups``, classifier :func:`rlpipe.stages.algos.dapo.classify_groups`):
  a finished group with fewer than two valid trajectories, or whose valid
  trajectories share one reward, is evicted on arrival and ``refill_factor``
  (2) × as many prompts are asked for. Infra failures (status ``failed``) take
  no part in that decision; all-failed groups are evicted and refilled 1×.
* Refill accounting is exact: ``refill_needed`` = capacity + bonus − prompts in
  the buffer (pending + running + ready), so every consumed or evicted group is
  replaced one for one, and each DAPO eviction adds ``refill_factor − 1`` bonus
  prompts. As in verl's sync DAPO, the bonus is speculative: it is forgotten
  once a batch is served (prompts already submitted stay and are used later,
  lowering the next refills), so the buffer never grows without bound. Async
  modes submit one prompt at a time.

Left out: evicting or aborting in-flight prompts that are already stale
(verl also waits for them to finish); keeping the partial samples of a
re-queued prompt (it is regenerated whole, its submit step kept); priorities
other than oldest-submission-first; thread safety (one Ray actor serializes
calls).
"""

from __future__ import annotations

import heapq
import logging
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from pydantic import Field

from rlpipe.engine.state.replay_records import (
    FINISHED,
    PENDING,
    RUNNING,
    ReplayBufferError,
    _concat,
    _Prompt,
    _require,
    _split_by_uid,
    _strings,
    _Window,
)
from rlpipe.engine.tracking.lineage import trajectory_lineage
from rlpipe.jagged import contiguous
from rlpipe.registry import registry
from rlpipe.schemas import batch as B
from rlpipe.stage import StageParams
from rlpipe.stages.algos.dapo import classify_groups

log = logging.getLogger(__name__)

_STATE_COL, _SEQ_COL = "buffer_state", "buffer_seq"
_EMPTY_PROMPTS = pa.schema([pa.field(c, B.column_type(c)) for c in B.PROMPT_COLUMNS])



def wait_slack(submit_steps: np.ndarray, remaining: int, first_level: int, step: int, threshold: int,
               groups_per_step: int) -> int:
    """The wait schedule's arithmetic: min over steps t ≥ first_level of (batches left until t) − (prompts due by t).

    A prompt submitted at p is due (reaches the threshold T) at t = p + T − 1; at the current ``step``
    ``remaining`` groups may still be consumed, ``groups_per_step`` at every later one. (rlpipe.simulate's buffer
    keeps the same rules on integers.)"""
    ps = np.sort(submit_steps)
    last = max(first_level, int(ps[-1]) + threshold - 1) if len(ps) else first_level
    t = np.arange(first_level, last + 1)
    due = np.searchsorted(ps, t - threshold + 1, side="right")
    return int(np.min(remaining + (t - step) * groups_per_step - due))


def wait_room(live_submit_steps: np.ndarray, remaining: int, submit_step: int, step: int, threshold: int,
              groups_per_step: int) -> int:
    """Prompts that may be submitted at ``submit_step`` without breaking the wait schedule."""
    first = max(step, submit_step + threshold - 1)
    return max(0, wait_slack(live_submit_steps, remaining, first, step, threshold, groups_per_step))

class ReplayBufferParams(StageParams):
    """Params of the built-in ``replay_buffer`` sampler."""

    max_off_policy_threshold: int = Field(8, ge=1)
    """Eviction threshold: largest staleness (consuming step − submit step + 1) a consumed group may have."""
    strategy: Literal["drop", "wait"] = "drop"
    """drop: evict finished groups beyond the threshold and refill; wait: block sampling instead (dropless)."""
    filter_groups: bool = False
    """DAPO: evict groups whose valid trajectories all share one reward, or that have < 2 valid ones."""
    filter_metric: str = B.REWARD
    """Scalar column the DAPO decision reads (the trajectories must carry it when they arrive)."""
    refill_factor: int = Field(2, ge=1)
    """Prompts asked for per DAPO-evicted group."""
    group_size: int = Field(1, ge=1)
    """Samples per prompt (n); set by the mode from the generate params."""
    groups_per_step: int = Field(1, ge=1)
    """Groups one global step consumes; set by the mode (prompts_per_step)."""
    capacity_steps: int = Field(2, ge=1)
    """Prompts kept in the system (pending + running + ready) = capacity_steps × groups_per_step.
    Under wait, admission additionally keeps the staleness schedule (at most threshold steps' worth)."""


@registry("sampler").register("replay_buffer")
class ReplayBuffer:
    """Prompt-level replay buffer over Arrow tables; see the module docstring for the algorithm."""

    Params = ReplayBufferParams

    def __init__(self, params: ReplayBufferParams, start_step: int = 0):
        self.params = params
        self._reset(start_step)

    def _reset(self, start_step: int) -> None:
        params = self.params
        self._prompts: dict[str, _Prompt] = {}
        self._heap: list[tuple[int, int, str]] = []  # (submit_step, seq, uid) of pending prompts, lazily pruned
        self._seq = 0
        self._step = start_step  # latest consuming step seen
        self._consumed = 0  # groups consumed at self._step
        self._capacity = params.capacity_steps * params.groups_per_step
        self._bonus = 0  # DAPO's extra refill since the last served batch
        self._prompt_schema: pa.Schema | None = None
        self._window = _Window()
        self._last_window = _Window()
        self._last_batch: dict[str, float] = {}
        self._totals: dict[str, int] = {"submitted": 0, "consumed": 0, **vars(_Window())}

    # ------------------------------------------------------------------ prompts in

    def add_prompts(self, prompts: pa.Table, submit_step: int) -> None:
        """Register prompts (one row each, prompt columns incl. a unique uid) as pending at ``submit_step``.

        Their ``prompt_step`` column is set to ``submit_step``. Submitting more than
        ``refill_needed`` over-fills the pipeline (later refills shrink to match); under
        wait, submitting more than the staleness schedule admits raises.
        """
        m = prompts.num_rows
        if m == 0:
            return
        _require(prompts, (B.UID,), "prompts")
        uids = _strings(prompts[B.UID])
        if len(np.unique(uids)) != m or any(u in self._prompts for u in uids):
            raise ReplayBufferError("prompt uids must be unique among the prompts in the buffer; draw fresh uids")
        if self.params.strategy == "wait" and m > (room := self._room(submit_step)):
            raise ReplayBufferError(
                f"strategy wait: {m} prompts submitted at step {submit_step} could not all be consumed within "
                f"max_off_policy_threshold={self._threshold} steps; submit at most {room} "
                "(refill_needed(submit_step) never asks for more)"
            )
        step_col = pa.array(np.full(m, submit_step, dtype=np.int32))
        if B.PROMPT_STEP in prompts.column_names:
            prompts = prompts.set_column(prompts.schema.get_field_index(B.PROMPT_STEP), B.PROMPT_STEP, step_col)
        else:
            prompts = prompts.append_column(B.PROMPT_STEP, step_col)
        self._prompt_schema = self._prompt_schema or prompts.schema
        for i, uid in enumerate(uids):  # one record per prompt, never per token
            self._prompts[uid] = _Prompt(uid, prompts.slice(i, 1), submit_step, self._seq)
            heapq.heappush(self._heap, (submit_step, self._seq, uid))
            self._seq += 1
        self._totals["submitted"] += m

    def refill_needed(self, submit_step: int | None = None) -> int:
        """Prompts to submit now to keep the pipeline full; pass the step ``add_prompts`` will be given
        (default: the latest consuming step), which under wait bounds the answer."""
        need = max(0, self._capacity + self._bonus - len(self._prompts))
        if self.params.strategy == "wait":
            need = min(need, self._room(self._step if submit_step is None else submit_step))
        return need

    def room(self, submit_step: int) -> int:
        """Prompts ``add_prompts`` accepts at ``submit_step`` beyond the capacity (separate_async's hybrid borrow
        draws there; later refills shrink by as many): under wait the staleness schedule's room, under drop no
        bound but the caller's."""
        return self._room(submit_step) if self.params.strategy == "wait" else 1 << 30

    def next_pending(self, k: int) -> pa.Table:
        """Up to ``k`` pending prompts, oldest first, now marked running (the rollout side's pull)."""
        picked: list[_Prompt] = []
        while self._heap and len(picked) < k:
            _, seq, uid = heapq.heappop(self._heap)
            p = self._prompts.get(uid)
            if p is not None and p.state == PENDING and p.seq == seq:
                p.state = RUNNING
                picked.append(p)
        if not picked:
            return (self._prompt_schema or _EMPTY_PROMPTS).empty_table()
        return contiguous(_concat([p.row for p in picked], "prompts"))

    def requeue(self, uids: list[str]) -> None:
        """Running prompts back to pending (aborted requests, resume); their partial samples are dropped."""
        for uid in uids:
            p = self._prompts.get(uid)
            if p is None:
                raise ReplayBufferError(f"cannot requeue {uid!r}: no such prompt in the buffer (consumed or evicted?)")
            if p.state == RUNNING:
                p.state, p.chunks, p.returned = PENDING, [], 0
                heapq.heappush(self._heap, (p.submit_step, p.seq, uid))

    # ------------------------------------------------------------------ trajectories in

    def add_trajectories(self, table: pa.Table) -> int:
        """Store returned samples (one row each); returns how many groups completed with them.

        Rows of prompts that are not running (re-queued, consumed, unknown) are
        dropped and counted as late; rows with status ``aborted`` are not samples
        (re-queue or resume their prompt).
        """
        if table.num_rows == 0:
            return 0
        _require(table, (B.UID, B.STATUS, B.PROMPT_STEP), "trajectories")
        aborted = _strings(table[B.STATUS]) == B.STATUS_ABORTED
        if aborted.any():
            self._bump("aborted_rows", int(aborted.sum()))
            table = table.filter(pa.array(~aborted))
        completed: list[str] = []
        for uid, chunk in _split_by_uid(table):
            p = self._prompts.get(uid)
            if p is None or p.state != RUNNING:
                self._bump("late_rows", chunk.num_rows)
                continue
            steps = chunk[B.PROMPT_STEP].to_numpy(zero_copy_only=False)
            if not np.all(steps == p.submit_step):
                raise ReplayBufferError(
                    f"trajectories of {uid!r} carry prompt_step {sorted(set(steps.tolist()))} but the prompt was "
                    f"submitted at step {p.submit_step}; generate must copy prompt_step from next_pending's rows"
                )
            p.returned += chunk.num_rows
            if p.returned > self.params.group_size:
                raise ReplayBufferError(
                    f"prompt {uid!r} got {p.returned} samples, more than group_size={self.params.group_size}; "
                    "set group_size to the generate stage's n"
                )
            p.chunks.append(chunk)
            if p.returned == self.params.group_size:
                completed.append(uid)
        if completed:
            self._complete(completed)
        return len(completed)

    def _complete(self, uids: list[str]) -> None:
        """Classify completed groups (vectorized over all of them): failed, DAPO-uninformative or finished."""
        groups = [_concat(self._prompts[u].chunks, "trajectories") for u in uids]
        rows = _concat(groups, "trajectories")
        gid = np.repeat(np.arange(len(uids)), [g.num_rows for g in groups])
        failed_row = _strings(rows[B.STATUS]) == B.STATUS_FAILED
        all_failed = np.bincount(gid, weights=failed_row, minlength=len(uids)) == self.params.group_size
        uninformative = np.zeros(len(uids), dtype=bool)
        if self.params.filter_groups:
            metric = self.params.filter_metric
            if metric not in rows.column_names:
                raise ReplayBufferError(
                    f"filter_groups needs a {metric!r} column on arriving trajectories; run the reward stage "
                    "before the replay buffer, or set filter_groups: false"
                )
            score = pc.fill_null(rows[metric].cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False)
            valid = ~failed_row & ~np.isnan(score)
            score = np.array(score)  # writable copy for torch
            verdict = classify_groups(torch.from_numpy(gid), torch.from_numpy(score), torch.from_numpy(valid))
            uninformative = ~verdict.informative.numpy() & ~all_failed
        for uid, group, failed, dapo in zip(uids, groups, all_failed, uninformative):
            p = self._prompts[uid]
            if failed or dapo:
                del self._prompts[uid]
                self._evict("evicted_failed" if failed else "evicted_dapo", 1)
            else:
                p.state, p.chunks = FINISHED, [group]

    def _evict(self, reason: str, count: int) -> None:
        self._bump(reason, count)
        if reason == "evicted_dapo":
            self._bonus += (self.params.refill_factor - 1) * count

    def _bump(self, name: str, count: int = 1) -> None:
        setattr(self._window, name, getattr(self._window, name) + count)
        self._totals[name] += count

    # ------------------------------------------------------------------ sampling

    def sample(self, num_groups: int, consuming_step: int) -> pa.Table | None:
        """``num_groups`` whole finished groups for training at ``consuming_step``, oldest first; None if not ready.

        Under drop, stale finished groups are evicted first (and credited for
        refill) even when None is returned. Under wait, None also means "blocked
        until older in-flight prompts finish".
        """
        self._at_step(consuming_step)
        if self.params.strategy == "drop":
            stale = [u for u, p in self._prompts.items() if p.state == FINISHED and self._age(p) > self._threshold]
            for uid in stale:
                del self._prompts[uid]
            if stale:
                self._evict("evicted_stale", len(stale))
        ready = sorted((p for p in self._prompts.values() if p.state == FINISHED), key=lambda p: (p.submit_step, p.seq))
        if len(ready) < num_groups:
            self._bump("not_ready")
            return None
        chosen = ready[:num_groups]
        if self.params.strategy == "wait" and not self._schedule_holds(chosen):
            self._bump("blocked")
            return None
        if any(self._age(p) > self._threshold for p in chosen):  # only when steps were skipped under wait
            raise ReplayBufferError(
                f"strategy wait: a group submitted at step {chosen[0].submit_step} is consumed at step "
                f"{self._step}, beyond max_off_policy_threshold={self._threshold}; the mode must sample "
                f"groups_per_step={self.params.groups_per_step} groups at every step"
            )
        for p in chosen:
            del self._prompts[p.uid]
        self._consumed += num_groups
        self._totals["consumed"] += num_groups
        self._bonus = 0
        batch = contiguous(_concat([p.chunks[0] for p in chosen], "trajectories"))
        self._close_window(batch)
        return batch

    @property
    def _threshold(self) -> int:
        return self.params.max_off_policy_threshold

    def _age(self, p: _Prompt, step: int | None = None) -> int:
        return (self._step if step is None else step) - p.submit_step + 1

    def _at_step(self, step: int) -> None:
        if step < self._step:
            raise ReplayBufferError(f"sample at step {step} after step {self._step}: consuming steps must not go back")
        if step > self._step:
            self._step, self._consumed = step, 0

    def _schedule_holds(self, chosen: list[_Prompt]) -> bool:
        """Wait gate: after taking ``chosen``, every other unconsumed prompt can still be consumed in time."""
        taken = {id(p) for p in chosen}
        left = np.array([p.submit_step for p in self._prompts.values() if id(p) not in taken], dtype=np.int64)
        remaining = max(0, self.params.groups_per_step - self._consumed - len(chosen))
        return wait_slack(left, remaining, self._step, self._step, self._threshold, self.params.groups_per_step) >= 0

    def _room(self, submit_step: int) -> int:
        """Prompts that may be submitted at ``submit_step`` without breaking the wait schedule."""
        live = np.array([p.submit_step for p in self._prompts.values()], dtype=np.int64)
        remaining = max(0, self.params.groups_per_step - self._consumed)
        return wait_room(live, remaining, submit_step, self._step, self._threshold, self.params.groups_per_step)

    # ------------------------------------------------------------------ metrics

    def _close_window(self, batch: pa.Table) -> None:
        staleness = self._step - batch[B.PROMPT_STEP].to_numpy(zero_copy_only=False).astype(np.int64) + 1
        stats: dict[str, float] = {
            "staleness/min": float(staleness.min()),
            "staleness/mean": float(staleness.mean()),
            "staleness/max": float(staleness.max()),
        }
        counts = np.bincount(np.clip(staleness, 0, None), minlength=self._threshold + 1)
        stats.update({f"staleness/hist_{k}": float(counts[k]) for k in range(1, len(counts))})
        if B.TOKEN_VERSIONS in batch.column_names:
            lin = trajectory_lineage(batch, self._step)
            has = lin["min_version"].is_valid().to_numpy(zero_copy_only=False)
            if has.any():
                span = (pc.subtract(lin["max_version"], lin["min_version"]).to_numpy(zero_copy_only=False)[has] + 1)
                stats["versions_spanned/mean"] = float(span.mean())
                stats["versions_spanned/max"] = float(span.max())
        self._last_batch, self._last_window, self._window = stats, self._window, _Window()

    def counts(self) -> dict[str, int]:
        """Prompts per live state."""
        states = [p.state for p in self._prompts.values()]
        return {s: states.count(s) for s in (PENDING, RUNNING, FINISHED)}

    def metrics(self, consuming_step: int | None = None) -> dict[str, float]:
        """``sampler/*``: live state counts, events up to the last batch, its staleness, in-flight age."""
        step = self._step if consuming_step is None else consuming_step
        out = {k: float(v) for k, v in self.counts().items()}
        out.update({k: float(v) for k, v in vars(self._last_window).items()})
        out.update({f"{k}_total": float(v) for k, v in self._totals.items()})
        out["refill_needed"] = float(self.refill_needed(step))
        inflight = [self._age(p, step) for p in self._prompts.values() if p.state != FINISHED]
        out["inflight_staleness/max"] = float(max(inflight, default=0))
        out.update(self._last_batch)
        return {f"sampler/{k}": v for k, v in out.items()}

    # ------------------------------------------------------------------ checkpoint

    def state(self) -> dict[str, Any]:
        """Checkpoint: counters, every live prompt (in-flight ones included) and the finished groups' rows."""
        live = sorted(self._prompts.values(), key=lambda p: p.seq)
        prompts = _concat([p.row for p in live], "prompts") if live else None
        if prompts is not None:
            prompts = prompts.append_column(_STATE_COL, pa.array([p.state for p in live]))
            prompts = prompts.append_column(_SEQ_COL, pa.array([p.seq for p in live], pa.int64()))
        finished = [p.chunks[0] for p in live if p.state == FINISHED]
        return {
            "format": 1,
            "group_size": self.params.group_size,
            "step": self._step,
            "consumed": self._consumed,
            "bonus": self._bonus,
            "next_seq": self._seq,
            "totals": dict(self._totals),
            "prompts": prompts,
            "trajectories": _concat(finished, "trajectories") if finished else None,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint; pending and running prompts come back pending, submit steps kept."""
        if state.get("group_size") != self.params.group_size:
            raise ReplayBufferError(
                f"checkpoint groups have {state.get('group_size')} samples, this buffer expects "
                f"group_size={self.params.group_size}; resume with the same generate n"
            )
        self._reset(int(state["step"]))
        self._consumed, self._bonus, self._seq = int(state["consumed"]), int(state["bonus"]), int(state["next_seq"])
        self._totals.update(state["totals"])
        groups = dict(_split_by_uid(state["trajectories"])) if state["trajectories"] is not None else {}
        prompts: pa.Table | None = state["prompts"]
        if prompts is None:
            return
        states, seqs = _strings(prompts[_STATE_COL]), prompts[_SEQ_COL].to_numpy()
        rows = prompts.drop_columns([_STATE_COL, _SEQ_COL])
        self._prompt_schema = rows.schema
        steps = rows[B.PROMPT_STEP].to_numpy(zero_copy_only=False)
        for i, uid in enumerate(_strings(rows[B.UID])):
            p = _Prompt(uid, rows.slice(i, 1), int(steps[i]), int(seqs[i]))
            if states[i] == FINISHED:
                p.state, p.chunks, p.returned = FINISHED, [groups[uid]], self.params.group_size
            else:
                heapq.heappush(self._heap, (p.submit_step, p.seq, uid))
            self._prompts[uid] = p
