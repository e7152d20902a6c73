"""What ``rlpipe validate`` (and every run, before Ray starts) checks beyond the schema.

Each check fails with one line that names the field and the fix, instead of a raw
traceback minutes into a run:

* ``trainer.output_dir`` can be created and written (its nearest existing folder is a
  writable directory);
* ``model.path`` / ``tokenizer.path`` are folders with a model config and weights / tokenizer files
  (read as files, nothing loaded);
* a file dataset's files exist and every row of a file up to ``data.check_whole_files_mb`` (the first
  ``PREVIEW_ROWS`` of a bigger one) parses and carries the fields (the dataset's own ``preview``,
  :func:`rlpipe.stages.datasets.preview_dataset`); on those rows: chat-message prompts need
  ``data.apply_chat_template``, every data_source has a scorer route, and every prompt, tokenized as the
  run will (the tokenizer is built, no model), fits ``data.max_prompt_length``; errors name file and line,
  and what was read is kept on the plan (``Plan.data_checked``) for ``rlpipe validate`` to print;
* ``data.max_prompt_length + generate max_tokens`` fits the model's positions
  (``model.architecture.max_position_embeddings``, or ``config.json`` of ``model.path``);
* a generate stage attached to running servers (``params.server.urls``) names one per rollout
  replica (``resources.rollout_replicas``);
* per-node checks a stage registers (``StageSpec.check``, e.g. group estimators need
  ``n ≥ 2``);
* ``trainer.lora``: every ``target_modules`` name is a linear module of the model (its modules listed from the
  config alone: built on the meta device, no weight read), and the rollout engine takes adapter pushes (embedded,
  or vLLM with ``server.max_loras`` ≥ the mode's staleness bound + 1 and a rank vLLM serves; not SGLang yet).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlpipe.errors import ConfigError
from rlpipe.stages.dataset_records import PREVIEW_ROWS, PROMPT_MESSAGES
from rlpipe.stages.datasets import preview_dataset


def check_config(config) -> None:
    """Checks of the config alone (no plan needed)."""
    check_output_dir(config.trainer.output_dir)
    check_model_folders(config)


def check_plan(config, plan) -> None:
    """Checks that need the planned nodes."""
    check_positions(config, plan)
    check_server_urls(config, plan)
    check_lora(config, plan)
    for field, data in (("data", config.data), ("eval.data", config.eval.data if config.eval else None)):
        preview = preview_dataset(data.source, data.params, int(data.check_whole_files_mb * 2**20)) if data else None
        if preview is None:
            continue
        rows = preview.table
        if PROMPT_MESSAGES in rows.column_names and not data.apply_chat_template:
            raise ConfigError(f"{field}: the prompts of dataset {data.source!r} are lists of chat messages; set "
                              f"{field}.apply_chat_template: true so the tokenizer's chat template renders them")
        check_routes(rows, plan)
        check_prompt_lengths(rows, config, data, field, preview.places)
        plan.data_checked.append(describe_read(field, preview, data.check_whole_files_mb))


def describe_read(field: str, preview, whole_mb: float) -> str:
    """One line saying what the preflight read of a dataset: every row, or which files only in part."""
    if not preview.partial:
        return f"{field}: every row checked ({preview.table.num_rows})"
    return (f"{field}: {preview.table.num_rows} rows checked; only the first {PREVIEW_ROWS} of "
            f"{', '.join(preview.partial)} (over {field}.check_whole_files_mb={whole_mb:g}; the rest when the run "
            "loads it)")


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json", "*.bin.index.json")


def check_model_folders(config) -> None:
    """``model.path`` holds a config.json with a model_type and weight files; ``tokenizer.path`` holds a
    tokenizer. Only the files are read (no weights loaded, no transformers import)."""
    if config.model.path is not None:
        folder = Path(config.model.path)
        if not folder.is_dir():
            raise ConfigError(f"model.path {config.model.path!r} is not a folder on this machine; point it at a local "
                              "Hugging Face model folder (nothing is downloaded), or set model.architecture to build one")
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"model.path {config.model.path!r}: no readable config.json ({type(exc).__name__}: "
                              f"{exc}); point model.path at the folder a model was saved to") from None
        if not model_type:
            raise ConfigError(f"model.path {config.model.path!r}: config.json has no model_type; it is not a "
                              "Hugging Face model config")
        if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
            raise ConfigError(f"model.path {config.model.path!r} has config.json but no weights (*.safetensors, "
                              "*.bin); copy the model's weight files there")
    if config.tokenizer.path is not None:
        folder = Path(config.tokenizer.path)
        if not folder.is_dir():
            raise ConfigError(f"tokenizer.path {config.tokenizer.path!r} is not a folder on this machine; point it at "
                              "a local Hugging Face tokenizer folder, or use tokenizer.chars / byte_level: true")
        if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(f"tokenizer.path {config.tokenizer.path!r} has no tokenizer.json or "
                              "tokenizer_config.json; save the tokenizer there (tokenizer.save_pretrained)")


def check_routes(rows, plan) -> None:
    """Every data_source of the dataset's checked rows has a scorer (reward impl `rule` without a function)."""
    from rlpipe.stages.reward import resolve_routes

    sources = sorted(set(rows.column("data_source").to_pylist()) - {None})
    for reward in plan.with_role("scores"):
        if reward.kind != "reward" or reward.impl != "rule" or getattr(reward.params, "function", None) is not None:
            continue
        try:
            resolve_routes(sources, reward.params)
        except ConfigError as exc:
            raise ConfigError(f"stages[{reward.name}]: {exc}") from None


LENGTH_CHUNK = 8192
"""Prompts tokenized at once by the length check (their ids are dropped after counting)."""


def check_prompt_lengths(rows, config, data=None, field: str = "data", places=None) -> None:
    """Every checked row's prompt, tokenized (chat template included) as the data loader will, fits
    ``data.max_prompt_length``; the error names the row (its file and line, given ``places``), its length and how
    many more are too long."""
    from rlpipe.backends.tokenizer import build_tokenizer
    from rlpipe.engine.state.data import tokenize_prompts

    data = data or config.data
    tokenizer = build_tokenizer(config.tokenizer)
    prompts = rows.column("prompt")
    messages = rows.column(PROMPT_MESSAGES) if PROMPT_MESSAGES in rows.column_names else None
    lengths = []
    for start in range(0, rows.num_rows, LENGTH_CHUNK):  # lengths only, a chunk at a time: memory stays small
        chunk = slice(start, start + LENGTH_CHUNK)
        ids = tokenize_prompts(prompts[chunk].to_pylist(), tokenizer, data.apply_chat_template,
                               messages[chunk].to_pylist() if messages is not None else None)
        lengths.extend(len(x) for x in ids)
    limit = data.max_prompt_length
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    if too_long:
        first = too_long[0]
        where = f"{places(first)}" if places is not None else f"row {first + 1}"
        raise ConfigError(
            f"{field}: the prompt of {where} of dataset {data.source!r} has {lengths[first]} tokens > "
            f"{field}.max_prompt_length={limit} ({len(too_long)} of the {len(lengths)} rows checked are too long); raise "
            f"{field}.max_prompt_length or filter the dataset")


def check_lora(config, plan) -> None:
    """``trainer.lora`` names linear modules the model has, and the rollout engine can take adapter pushes."""
    lora = config.trainer.lora
    if lora is None:
        return
    generate = plan.anchor("generates")
    if generate is not None and generate.impl == "sglang":
        # SGLang's LoRA loads adapters by path beside the base (/load_lora_adapter) but rlpipe's SGLang runs on
        # CPU through the embedded engine behind SGLang's protocol, which has no adapter API to test it against
        raise ConfigError(f"trainer.lora: stages[{generate.name}] impl sglang cannot take adapter pushes yet (the "
                          "embedded engine merges them, vLLM loads them as adapters); use impl: embedded or vllm, or "
                          "drop trainer.lora")
    if generate is not None and generate.impl == "vllm":
        from rlpipe.inference.vllm_lora import check_adapter_slots

        server = generate.params.server
        check_adapter_slots(lora, server.max_loras, plan.mode_params, generate.name)
    from rlpipe.backends.lora import linear_module_names

    model_class, names = linear_module_names(config.model)
    missing = [n for n in lora.target_modules if n not in names]
    if missing:
        raise ConfigError(f"trainer.lora.target_modules: {', '.join(map(repr, missing))} is not a linear module of "
                          f"{model_class} (its linear modules, LM head aside: {', '.join(sorted(names))}); use those "
                          "names")


def check_server_urls(config, plan) -> None:
    generate = plan.anchor("generates")
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
    generate = plan.anchor("generates")
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
