"""The lineage walkthrough notebook runs top to bottom against a tracked run and writes its plots.

The run is the session's real end-to-end sync run (tests/conftest.py: Ray + MLflow).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "lineage_walkthrough.ipynb"


def execute_notebook(cwd: Path, uri: str, out: Path, experiment: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"MLFLOW_TRACKING_URI": uri, "RLPIPE_NOTEBOOK_OUT": str(out), "MPLBACKEND": "Agg",
           "RLPIPE_EXPERIMENT": experiment}
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


@pytest.mark.e2e
def test_lineage_walkthrough_runs_and_writes_plots(sync_run, tmp_path):
    """The notebook opens the latest run of a real pipeline run (Ray + MLflow) and plots it."""
    uri, run_id = sync_run.tracking_uri, sync_run.run_id
    out = tmp_path / "plots"
    nb = execute_notebook(tmp_path, uri, out, experiment="rlpipe-e2e")

    text = "\n".join(
        str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert run_id in text and "e2e-sync" in text
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    for png in ("reward_per_step.png", "stage_durations.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5_000, png
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
