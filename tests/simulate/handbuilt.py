"""Hand-built recordings for the simulator's tests: lineage records laid out back to back with chosen durations."""

from __future__ import annotations

import itertools

import pyarrow as pa

from conftest import quickstart_raw
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.tracking.lineage import TRAJECTORY_LINEAGE_SCHEMA
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.simulate import Recording

NODES = [("generate", "embedded", "rollout×1"), ("reward", "rule", "task"), ("balance", "tokens", "task"),
         ("old_log_prob", "trainer", "actor×1"), ("advantage", "grpo", "task"), ("update", "ppo", "actor×1"),
         ("weight_sync", "object_store", "driver")]


def handbuilt(tmp_path, durations: dict, steps: int = 6, groups: int = 4, n: int = 2,
              lengths: list[list[int]] | None = None, max_tokens: int = 8) -> tuple[Recording, dict]:
    """A sync recording of the quickstart pipeline whose node executions last ``durations[node]`` seconds (0 when
    not given; ``generate`` may be a function of (tokens, longest response)), back to back, every step's groups'
    response lengths taken in turn from ``lengths`` (default: all ``max_tokens``)."""
    raw = quickstart_raw(name="handbuilt", data={"prompts_per_step": groups},
                         trainer={"total_steps": steps, "output_dir": str(tmp_path)}, tracking={"enabled": False})
    for stage in raw["stages"]:
        if stage["kind"] == "generate":
            stage["params"] = {**stage["params"], "n": n, "max_tokens": max_tokens}
    raw["model"]["architecture"]["max_position_embeddings"] = 512
    config = validate_config(raw)
    cycle = itertools.cycle(lengths or [[max_tokens] * n])
    records, rows, clock = [], [], 1000.0
    for step in range(steps):
        step_groups = [next(cycle) for _ in range(groups)]
        tokens = sum(map(sum, step_groups))
        longest = max(map(max, step_groups))
        for gi, lens in enumerate(step_groups):
            for j, length in enumerate(lens):
                rows.append({"uid": f"{step}-{gi}", "sample_index": j, "prompt_step": step, "consumed_step": step,
                             "num_tokens": length, "min_version": step, "max_version": step, "versions_spanned": 1,
                             "replica": 0})
        for name, impl, worker in NODES:
            d = durations.get(name, 0.0)
            d = d(tokens, longest) if callable(d) else d
            metrics = {}
            if name == "generate":
                metrics = {"generate/response_length_max": float(longest),
                           "generate/response_length_mean": tokens / (groups * n)}
            records.append(NodeRecord(
                run_id="handbuilt", step=step, node=name, kind=name, impl=impl, params={}, params_hash="",
                code_hash="", input_fingerprint="", output_fingerprint="",
                rows_in=groups if name == "generate" else groups * n, rows_out=groups * n, policy_versions=[step],
                trainer_version=step + (name == "weight_sync"), start_time=clock, duration_s=d, metrics=metrics,
                worker=worker))
            clock += d
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_LINEAGE_SCHEMA)
    return Recording("handbuilt", config, records, table), raw
