"""Stage kinds: what a node of the step DAG is for, registered like its implementations.

A kind (``registry("stage_kind")``) names a family of interchangeable implementations and says

* where its implementations run unless they say otherwise (task / worker of a role / driver);
* the **step role** it plays for the modes, if any. The modes find their anchors by role, never by kind
  name: the node that generates rows, the one that selects groups, the staleness guard, the policy update,
  the weight push, the scorers;
* whether every step needs one (``required``);
* whether it is a **barrier**: the rows after it are not the rows before it (created, selected, or taken
  from a buffer), so every other node runs on the side of it its YAML position says;
* the **state** its nodes read or change besides columns (a model's weights), which orders them whatever
  the YAML order: a reader of the state as the step found it runs before every node that changes it (the
  trainer's log-probs before the update), a reader of the updated state after them (the weight push).

The built-in kinds are registered below exactly as a plugin registers its own, in one file::

    from rlpipe.stage import StageResult, cols, stage
    from rlpipe.stage_kinds import stage_kind

    stage_kind("length_penalty", doc="Rewrites token_rewards by response length.")

    @stage("length_penalty", "linear", reads=cols("token_rewards", "response_mask"), writes=cols("token_rewards"))
    def linear(batch, params, ctx): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlpipe.errors import RegistryError
from rlpipe.registry import registry

Placement = Literal["task", "worker", "driver"]
StepRole = Literal["generates", "scores", "selects_groups", "guards_staleness", "updates_policy", "pushes_weights"]
SINGLE_ROLES: tuple[StepRole, ...] = ("generates", "selects_groups", "guards_staleness", "updates_policy",
                                      "pushes_weights")
"""Step roles at most one node of a pipeline plays (the modes anchor on it); ``scores`` may be many."""


@dataclass(frozen=True)
class StageKind:
    """A registered stage kind."""

    name: str
    doc: str
    """One line: what nodes of this kind do (``rlpipe stages`` shows it)."""
    placement: Placement = "task"
    """Where an implementation runs when its registration does not say."""
    role: str | None = None
    """The worker role of an implementation with placement ``worker`` that names none."""
    step_role: StepRole | None = None
    """What the modes use a node of this kind for (None: a plain node the modes run where the DAG puts it)."""
    required: bool = False
    """Every pipeline has a node of this kind."""
    barrier: bool = False
    """Its output rows are not its input rows: others run before or after it by their YAML position."""
    reads_state: tuple[str, ...] = ()
    """Non-column state its nodes read as the step found it (``policy``: the trainer's weights before the update)."""
    reads_updated_state: tuple[str, ...] = ()
    """Non-column state its nodes read once every node that changes it is done (the weight push)."""
    writes_state: tuple[str, ...] = ()
    """Non-column state its nodes change (``policy``: the update)."""


def kind_registry():
    """The registry of stage kinds."""
    return registry("stage_kind")


def stage_kind(name: str, *, doc: str, placement: Placement = "task", role: str | None = None,
               step_role: StepRole | None = None, required: bool = False, barrier: bool = False,
               reads_state: tuple[str, ...] = (), reads_updated_state: tuple[str, ...] = (),
               writes_state: tuple[str, ...] = ()) -> StageKind:
    """Register a stage kind (a plugin calls it before registering implementations of it)."""
    if not name.isidentifier():
        raise RegistryError(f"stage kind {name!r}: a kind name is an identifier (letters, digits, '_')")
    if placement == "worker" and not role:
        raise RegistryError(f"stage kind {name!r}: a worker placement needs a role")
    kind = StageKind(name, doc, placement, role, step_role, required, barrier, tuple(reads_state),
                     tuple(reads_updated_state), tuple(writes_state))
    kind_registry().add(name, kind)
    return kind


def get_kind(name: str) -> StageKind:
    """The registered kind ``name``; a RegistryError listing the known kinds otherwise."""
    return kind_registry().get(name)


def known_kinds() -> list[str]:
    """Every registered kind: the built-ins in step order, then the others by name."""
    names = kind_registry().names()
    return [k for k in BUILTIN_KINDS if k in names] + sorted(set(names) - set(BUILTIN_KINDS))


def step_role_of(kind: str) -> StepRole | None:
    """The step role of ``kind``; None for a plain kind or one not registered in this process."""
    found = kind_registry()._items.get(kind)  # a record's kind: its plugin may not be loaded here
    return found.step_role if found is not None else None


def kinds_with_role(step_role: StepRole) -> list[str]:
    """The registered kinds that play ``step_role``."""
    return [k for k in known_kinds() if get_kind(k).step_role == step_role]


# The built-in kinds, in the order of a step (the order `rlpipe stages` and the reference list them in).
_BUILTINS = (
    StageKind("generate", "Rollout: turns prompts into responses (creates the step's rows).", "worker", "rollout",
              "generates", required=True, barrier=True),
    StageKind("reward", "Scores responses (writes reward and token_rewards).", step_role="scores",
              required=True),
    StageKind("filter_groups", "Drops groups without signal (DAPO dynamic sampling).", step_role="selects_groups",
              barrier=True),
    StageKind("staleness_guard", "Async modes: the cut between rollout and training; checks the batch's staleness "
              "bound.", step_role="guards_staleness", barrier=True),
    StageKind("balance", "Assigns rows to data-parallel ranks (writes dp_rank).", required=True),
    StageKind("old_log_prob", "π_old: the response tokens' log-probs under the trainer's weights.", "worker",
              "actor", required=True, reads_state=("policy",)),
    StageKind("ref", "Reference-model log-probs for the KL term.", "worker", "ref"),
    StageKind("rollout_correction", "Importance weights / rejection masks for rollout-vs-trainer mismatch."),
    StageKind("critic_values", "The critic's value per token.", "worker", "critic", reads_state=("critic",)),
    StageKind("advantage", "Advantages from rewards (GRPO, RLOO, GAE ...).", required=True),
    StageKind("critic_update", "Trains the critic on returns.", "worker", "critic", writes_state=("critic",)),
    StageKind("update", "Trains the policy on the batch.", "worker", "actor", "updates_policy", required=True,
              writes_state=("policy",)),
    StageKind("weight_sync", "Pushes the trainer's weights to the rollout engines (a new policy version).",
              "driver", step_role="pushes_weights", required=True, reads_updated_state=("policy",)),
)
BUILTIN_KINDS = tuple(k.name for k in _BUILTINS)
for _kind in _BUILTINS:
    kind_registry().add(_kind.name, _kind)
