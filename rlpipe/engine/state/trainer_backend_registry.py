"""The ``trainer_backend`` registry (``trainer.backend``), apart from the backends it holds.

The built-in backends (:mod:`rlpipe.engine.state.trainer_backends`) build the rank's trainer
state (``build_state``: :class:`~rlpipe.engine.state.train_state.TrainState`, or
:class:`~rlpipe.engine.state.megatron_state.MegatronTrainState`), and those states look their
backend up by name. The registry lives here so that the states need only this module, not the
backends that import them: imports run one way, backends -> states -> registry.

Looking a name up fills the registry: the first miss imports ``rlpipe.builtins`` (which imports
the built-in backends) and the ``rlpipe.plugins`` entry points (see :mod:`rlpipe.registry`).
"""

from __future__ import annotations

from rlpipe.registry import registry

TRAINER_BACKENDS = registry("trainer_backend")
