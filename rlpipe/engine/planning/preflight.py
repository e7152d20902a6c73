"""What ``rlpipe validate`` (and every run, before Ray starts) checks beyond the schema.

Each check fails with one line that names the field and the fix, instead of a raw
traceback minutes into a run:

* ``trainer.output_dir`` can be created and written (its nearest existing folder is a
  writable directory);
* a file dataset's files exist and their first rows parse and carry the fields
  (the dataset's own ``preview``, :func:`rlpipe.stages.datasets.preview_dataset`);
* ``data.max_prompt_length + generate max_tokens`` fits the model's positions
  (``model.architecture.max_position_embeddings``, or ``config.json`` of ``model.path``);
* a generate stage attached to running servers (``params.server.urls``) names one per rollout
  replica (``resources.rollout_replicas``);
* per-node checks a stage registers (``StageSpec.check``, e.g. group estimators need
  ``n ≥ 2``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlpipe.errors import ConfigError
from rlpipe.stages.datasets import preview_dataset


def check_config(config) -> None:
    """Checks of the config alone (no plan needed)."""
    check_output_dir(config.trainer.output_dir)
    preview_dataset(config.data.source, config.data.params)


def check_plan(config, plan) -> None:
    """Checks that need the planned nodes."""
    check_positions(config, plan)
    check_server_urls(config, plan)


def check_server_urls(config, plan) -> None:
    generate = plan.node("generate")
    urls = getattr(getattr(generate.params, "server", None), "urls", None) if generate else None
    replicas = config.resources.rollout_replicas
    if urls and len(urls) != replicas:
        raise ConfigError(
            f"stages[{generate.name}].params.server.urls names {len(urls)} server(s) for "
            f"resources.rollout_replicas={replicas}; give one address per rollout replica")


def check_output_dir(output_dir: str) -> None:
    path = Path(output_dir).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"trainer.output_dir {output_dir!r}: {existing} is a file, not a folder; "
                          "point trainer.output_dir at a folder")
    if existing is None or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"trainer.output_dir {output_dir!r} is not writable ({existing} does not let this user create files); "
            "point trainer.output_dir at a writable folder"
        )


def model_positions(model) -> int | None:
    """The model's maximum positions, when known without loading it."""
    if model.architecture is not None:
        return model.architecture.max_position_embeddings
    config_file = Path(model.path) / "config.json"
    try:
        value = json.loads(config_file.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def check_positions(config, plan) -> None:
    generate = plan.node("generate")
    max_tokens = getattr(generate.params, "max_tokens", None) if generate else None
    positions = model_positions(config.model)
    if not isinstance(max_tokens, int) or positions is None:
        return
    needed = config.data.max_prompt_length + max_tokens
    if needed > positions:
        source = "model.architecture.max_position_embeddings" if config.model.architecture else "the model's config.json"
        raise ConfigError(
            f"data.max_prompt_length ({config.data.max_prompt_length}) + stages[{generate.name}].params.max_tokens "
            f"({max_tokens}) = {needed} exceeds the model's {positions} positions ({source}); lower "
            "data.max_prompt_length or max_tokens"
            + (", or raise model.architecture.max_position_embeddings" if config.model.architecture else "")
        )
