"""Trainer files as bytes (resources.shared_filesystem false): a rank's checkpoint and saved model travel to the driver,
which writes them; they equal what the rank would have written itself."""

import pytest
import torch

from rlpipe.engine.state.checkpoint import write_files
from rlpipe.engine.state.train_state import TrainState
from rlpipe.errors import RlpipeError

from test_train_state import config, logits, some_training


def test_checkpoint_files_are_the_bytes_save_checkpoint_writes_and_load_back_bit_identical(tmp_path):
    state = TrainState(config(), 0, 1, None)
    some_training(state)
    written = state.save_checkpoint(str(tmp_path / "actor"))
    files = state.checkpoint_files("actor")
    assert sorted(files) == sorted(p.rsplit("/", 1)[-1] for p in written) == ["actor_rank0.json",
                                                                              "actor_rank0.safetensors"]
    assert all(files[name] == (tmp_path / name).read_bytes() for name in files)
    other = TrainState(config(), 0, 1, None)
    assert not torch.equal(logits(other.model), logits(state.model))
    other.load_checkpoint_files("actor", files)
    assert torch.equal(logits(other.model), logits(state.model))
    assert other.optimizer.state_dict()["state"].keys() == state.optimizer.state_dict()["state"].keys()


def test_hf_files_are_the_saved_model_on_rank_zero_only(tmp_path):
    state = TrainState(config(), 0, 1, None)
    files = state.hf_files()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert TrainState(config(), 1, 1, None).hf_files() == {}  # rank 1 of a single-rank group: no rendezvous


@pytest.mark.parametrize("name", ["../escape.json", "sub/x.json", "", "x.json.tmp"])
def test_the_driver_refuses_a_file_name_that_is_not_a_plain_name(tmp_path, name):
    with pytest.raises(RlpipeError, match=r"actor rank 0 sent a file named .* refused"):
        write_files(tmp_path / "ckpt", {name: b"{}"}, "actor rank 0")
    assert not (tmp_path / "escape.json").exists()
