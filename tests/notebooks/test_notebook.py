"""The lineage walkthrough notebook runs top to bottom against a tracked run and writes its plots.

The run is produced here by feeding the MLflow observer hand-made records (fast, no
Ray); the notebook only relies on what any rlpipe run logs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"

import nbformat  # noqa: E402
import pyarrow as pa  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

from rlpipe.engine.lineage import fingerprint, params_hash  # noqa: E402
from rlpipe.engine.mlflow_observer import MLflowObserver  # noqa: E402
from rlpipe.engine.observer import NodeRecord  # noqa: E402
from rlpipe.schemas.config import TrackingConfig  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "lineage_walkthrough.ipynb"
NODES = [("generate", "generate", "hf_generate"), ("reward", "reward", "rule"), ("advantage", "advantage", "grpo"), ("update", "update", "ppo")]


def produce_run(uri: str, steps: int = 3) -> str:
    """A finished run with the layout rlpipe logs: 4 nodes × ``steps`` steps, trajectories, reward."""
    obs = MLflowObserver(TrackingConfig(uri=uri, sample_trajectories=4), "notebook-demo")
    run_id = obs.on_run_start({"name": "notebook-demo", "mode": "sync"}, "name: notebook-demo\n", {"mode": "sync"})
    for step in range(steps):
        batch = pa.table(
            {
                "uid": [f"p{i // 2}" for i in range(6)],
                "sample_index": pa.array([i % 2 for i in range(6)], pa.int32()),
                "prompt_step": pa.array([step] * 6, pa.int32()),
                "token_versions": pa.array([[step] * (i + 1) for i in range(6)], pa.list_(pa.int32())),
                "reward": pa.array([0.1 * step + 0.05 * i for i in range(6)], pa.float32()),
            }
        )
        for j, (node, kind, impl) in enumerate(NODES):
            params = {"impl_setting": j}
            obs.on_node_end(NodeRecord(
                run_id=run_id, step=step, node=node, kind=kind, impl=impl, params=params,
                params_hash=params_hash(params), code_hash=f"c{j}", input_fingerprint=fingerprint(batch.slice(j)),
                output_fingerprint=fingerprint(batch), rows_in=6, rows_out=6, policy_versions=[step],
                trainer_version=step, start_time=time.time(), duration_s=0.1 + 0.05 * j, metrics={f"{kind}/x": step},
            ))
        obs.on_step_end(step, {"reward/mean": 0.1 * step}, batch)
    obs.on_run_end("FINISHED")
    assert obs.failures == []
    return run_id


def execute_notebook(cwd: Path, uri: str, out: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"MLFLOW_TRACKING_URI": uri, "RLPIPE_NOTEBOOK_OUT": str(out), "MPLBACKEND": "Agg"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def test_lineage_walkthrough_runs_and_writes_plots(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = produce_run(uri)
    out = tmp_path / "plots"
    nb = execute_notebook(tmp_path, uri, out)

    text = "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert run_id in text and "notebook-demo" in text
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    for png in ("reward_per_step.png", "stage_durations.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000, png
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
