"""Imports every module that registers built-in parts (loaded on the first registry lookup)."""

# Stage implementations (each module registers with rlpipe.stage.stage).
import rlpipe.stages.generate  # noqa: F401
import rlpipe.stages.reward  # noqa: F401
import rlpipe.stages.remax_baseline  # noqa: F401
import rlpipe.stages.balance  # noqa: F401
import rlpipe.stages.logprobs  # noqa: F401
import rlpipe.stages.advantage  # noqa: F401
import rlpipe.stages.update  # noqa: F401
import rlpipe.stages.weight_sync  # noqa: F401
import rlpipe.stages.filter_groups  # noqa: F401
import rlpipe.stages.rollout_correction  # noqa: F401
import rlpipe.stages.critic  # noqa: F401
import rlpipe.stages.staleness_guard  # noqa: F401
import rlpipe.stages.gar  # noqa: F401
import rlpipe.stages.reward_families  # noqa: F401

# RL math registries (advantage_estimator, policy_loss, kl_penalty ...).
import rlpipe.stages.algos.advantages  # noqa: F401
import rlpipe.stages.algos.policy_loss  # noqa: F401

# Data and rewards.
import rlpipe.stages.datasets  # noqa: F401
import rlpipe.stages.agent_tasks  # noqa: F401
import rlpipe.stages.scorers  # noqa: F401
import rlpipe.stages.code_scorer  # noqa: F401

# Agents and their tools.
import rlpipe.agents.tool_agent  # noqa: F401
import rlpipe.agents.gateway_agent  # noqa: F401

# Engine parts: worker roles and modes.
import rlpipe.engine.state.roles  # noqa: F401
import rlpipe.engine.state.trainer_backends  # noqa: F401
import rlpipe.engine.state.reward_pool  # noqa: F401
import rlpipe.engine.state.replay_buffer  # noqa: F401
import rlpipe.modes.sync  # noqa: F401
import rlpipe.modes.separate_async  # noqa: F401
import rlpipe.modes.colocate_async  # noqa: F401

# Metric loggers beside MLflow (tracking.loggers).
import rlpipe.engine.tracking.metric_loggers  # noqa: F401
