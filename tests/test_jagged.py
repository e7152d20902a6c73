"""Jagged Arrow ↔ padded tensor conversions, checked against hand-written layouts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlpipe import jagged


def _lists(rows, t=pa.int32()):
    return pa.array(rows, type=pa.list_(t))


def test_to_padded_right_and_left():
    arr = _lists([[1, 2, 3], [], [4]])
    right = jagged.to_padded(arr, pad_value=-1)
    assert right.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
    left = jagged.to_padded(arr, pad_value=0, left=True, width=4)
    assert left.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 0, 4]]


def test_sliced_and_chunked_inputs():
    arr = _lists([[9], [1, 2], [3, 4, 5]]).slice(1)
    assert jagged.to_padded(arr).tolist() == [[1, 2, 0], [3, 4, 5]]
    chunked = pa.chunked_array([_lists([[1]]), _lists([[2, 3]])])
    assert jagged.lengths(chunked).tolist() == [1, 2]


def test_round_trip_from_padded():
    arr = _lists([[0.5, 1.5], [2.5], [3.5, 4.5, 5.5]], pa.float32())
    padded = jagged.to_padded(arr, dtype=torch.float32)
    back = jagged.from_padded(padded, jagged.lengths(arr), pa.float32())
    assert back.to_pylist() == arr.to_pylist()
    left = jagged.to_padded(arr, dtype=torch.float32, left=True)
    assert jagged.from_padded(left, jagged.lengths(arr), pa.float32(), left=True).to_pylist() == arr.to_pylist()


def test_width_too_small_raises():
    with pytest.raises(ValueError, match="does not fit width 1"):
        jagged.to_padded(_lists([[1, 2]]), width=1)


def test_last_token_placement_uses_last_valid_mask_position():
    mask = pa.array([[1, 1, 0], [0, 0], [1, 0, 1, 0]], type=pa.list_(pa.int8()))
    out = jagged.last_token_placement(np.array([0.5, 2.0, 3.0]), mask)
    assert out.to_pylist() == [[0.0, 0.5, 0.0], [0.0, 0.0], [0.0, 0.0, 3.0, 0.0]]


def test_sequence_inputs_layout_and_logprob_alignment():
    prompts = _lists([[5, 6], [7]])
    responses = _lists([[8, 9, 10], [11]])
    seq = jagged.SequenceInputs(prompts, responses, pad_token_id=0)
    assert seq.input_ids.tolist() == [[5, 6, 8, 9, 10], [0, 7, 11, 0, 0]]
    assert seq.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert seq.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]  # padding repeats the last position
    # logits that put all mass on "the next input token" give logprob 0 on real response tokens
    vocab = 12
    logits = torch.full((2, 5, vocab), -1e4)
    nxt = torch.roll(seq.input_ids, -1, dims=1)
    logits.scatter_(2, nxt.unsqueeze(-1), 0.0)
    logp = seq.response_logprobs(logits)
    assert logp.shape == (2, 3)
    assert torch.allclose(logp, torch.zeros(2, 3), atol=1e-3)
    uniform = seq.response_logprobs(torch.zeros(2, 5, vocab))
    expected = torch.tensor([[1.0, 1, 1], [1, 0, 0]]) * -np.log(vocab)
    assert torch.allclose(uniform, expected, atol=1e-5)
