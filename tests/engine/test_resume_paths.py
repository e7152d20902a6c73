"""What --resume PATH means: a checkpoint, a run folder or its checkpoints/ folder, an interrupted checkpoint."""

import pytest

from rlpipe.engine.resume import resolve_checkpoint
from rlpipe.engine.state.checkpoint import MANIFEST
from rlpipe.errors import ConfigError


@pytest.fixture
def run(tmp_path):
    """A run's output folder: complete checkpoints at steps 2, 9 and 10, step 11 cut off during its write."""
    checkpoints = tmp_path / "pipe-1234abcd" / "checkpoints"
    for step in (2, 9, 10):
        (checkpoints / f"step_{step}").mkdir(parents=True)
        (checkpoints / f"step_{step}" / MANIFEST).write_text("{}")
    (checkpoints / "step_11").mkdir()
    (checkpoints / "step_11" / "actor_rank0.safetensors.tmp").write_bytes(b"partial")
    return tmp_path / "pipe-1234abcd"


def test_a_run_folder_or_its_checkpoints_folder_means_the_newest_complete_checkpoint(run):
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_10"  # by step number: 10 after 9, not 11
    assert resolve_checkpoint(run / "checkpoints") == run / "checkpoints" / "step_10"
    assert resolve_checkpoint(run / "checkpoints" / "step_2") == run / "checkpoints" / "step_2"


def test_an_interrupted_checkpoint_names_the_last_complete_one(run):
    with pytest.raises(ConfigError, match=r"step_11: an incomplete checkpoint \(no manifest\.json, written last: its "
                                          r"write was interrupted\); the last complete one is .*step_10: --resume "):
        resolve_checkpoint(run / "checkpoints" / "step_11")
    for step in (2, 9, 10):
        (run / "checkpoints" / f"step_{step}" / MANIFEST).unlink()
    with pytest.raises(ConfigError, match="no complete checkpoint precedes it"):
        resolve_checkpoint(run / "checkpoints" / "step_11")
    with pytest.raises(ConfigError, match=r"no complete checkpoint in .*checkpoints; start the run anew"):
        resolve_checkpoint(run)


def test_any_other_path_is_left_to_the_checkpoint_reader(tmp_path):
    assert resolve_checkpoint(tmp_path / "nowhere") == tmp_path / "nowhere"
