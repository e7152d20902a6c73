"""The weight bucket format: round trip, bucketing, checks before any write."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import WeightBucket, WeightTransportError, export_buckets, load_buckets
from rlpipe.errors import RlpipeError
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig

TOK = build_tokenizer(TokenizerConfig(chars="abc 0123456789"))


def model(seed=0, dtype="float32", hidden=32, family="qwen2"):
    arch = ArchitectureConfig(family=family, hidden_size=hidden, num_layers=2, num_heads=4, intermediate_size=64)
    return build_model(ModelConfig(architecture=arch, dtype=dtype), TOK, seed).eval()


def logits(m):
    with torch.no_grad():
        return m(torch.tensor([TOK.encode("ab 12 c")])).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_gives_identical_outputs(dtype):
    src, dst = model(0, dtype), model(1, dtype)
    assert not torch.equal(logits(src), logits(dst))
    loaded = load_buckets(dst, export_buckets(src))
    assert torch.equal(logits(src), logits(dst))
    assert sorted(loaded) == sorted(name for name, _ in src.named_parameters())


def test_a_float_push_into_another_float_dtype_is_converted_as_it_loads():
    trained = model(0)  # float32 training, a bfloat16 rollout copy (model.rollout_dtype)
    rollout = model(1, "bfloat16")
    load_buckets(rollout, export_buckets(trained))
    for (name, p), (_, q) in zip(trained.named_parameters(), rollout.named_parameters()):
        assert q.dtype == torch.bfloat16
        assert torch.equal(q, p.to(torch.bfloat16)), name  # round to nearest, as .to() does
    widened = model(2)  # and back: bfloat16 into float32 is exact
    load_buckets(widened, export_buckets(rollout))
    assert all(torch.equal(p, q.float()) for p, q in zip(widened.parameters(), rollout.parameters()))


def test_local_tensors_are_checked_whole_before_any_is_copied():
    from rlpipe.backends.weights import load_tensors

    src, dst = model(0), model(1)
    before = logits(dst)
    named = [(name, p.detach()) for name, p in src.named_parameters()]
    wrong = named[:-1] + [(named[-1][0], torch.zeros(3, 3))]
    with pytest.raises(WeightTransportError, match=r"pushed float32\[3, 3\] but the engine holds float32"):
        load_tensors(dst, wrong)
    with pytest.raises(WeightTransportError, match="a full weight push misses 1 parameter"):
        load_tensors(dst, named[:-1])
    assert torch.equal(logits(dst), before)  # nothing was written
    assert sorted(load_tensors(dst, named)) == sorted(n for n, _ in named)
    assert torch.equal(logits(dst), logits(src))
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(src.parameters(), dst.parameters()))  # copied


def test_small_buckets_split_between_tensors_never_inside_one():
    src = model(0)
    buckets = export_buckets(src, bucket_bytes=4096)
    assert len(buckets) > 3
    sizes = {name: p.numel() * p.element_size() for name, p in src.named_parameters()}
    for bucket in buckets:
        assert bucket.data.dtype == np.uint8 and bucket.data.ndim == 1
        # a bucket exceeds the target only when it holds a single oversized tensor
        assert bucket.nbytes <= 4096 or len(bucket.tensors) == 1
        for meta in bucket.tensors:
            assert meta.nbytes == sizes[meta.name] and meta.offset % 64 == 0
    dst = model(1)
    load_buckets(dst, buckets)
    assert torch.equal(logits(src), logits(dst))


def test_tied_embeddings_travel_once():
    names = [m.name for b in export_buckets(model(0)) for m in b.tensors]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))


def test_read_only_buckets_load_without_warnings():
    # Ray's object store hands numpy arrays back read-only.
    buckets = export_buckets(model(0))
    for b in buckets:
        b.data.setflags(write=False)
    dst = model(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_buckets(dst, buckets)
    assert torch.equal(logits(model(0)), logits(dst))


def test_checksum_mismatch_raises_and_leaves_the_model_untouched():
    buckets = export_buckets(model(0), bucket_bytes=8192)
    corrupted = buckets[-1].data.copy()
    corrupted[0] ^= 0xFF
    buckets[-1] = WeightBucket(corrupted, buckets[-1].tensors, buckets[-1].checksum)
    dst = model(1)
    before = logits(dst)
    with pytest.raises(WeightTransportError, match="checksum mismatch.*push the weights again"):
        load_buckets(dst, buckets)
    assert torch.equal(logits(dst), before)  # the good buckets before it were not applied either


def test_shape_dtype_and_name_mismatches_name_the_tensor():
    with pytest.raises(WeightTransportError, match=r"'model\.embed_tokens\.weight': pushed float32\[\d+, 64\]"):
        load_buckets(model(hidden=32), export_buckets(model(hidden=64)))
    pushed = export_buckets(model())
    as_ints = [dataclasses.replace(pushed[0], tensors=(dataclasses.replace(pushed[0].tensors[0], dtype="int32"),
                                                       *pushed[0].tensors[1:])), *pushed[1:]]
    with pytest.raises(WeightTransportError, match="pushed int32.*engine holds float32"):
        load_buckets(model(), as_ints)
    renamed = export_buckets(model(), name_map=lambda name: "policy." + name)
    with pytest.raises(WeightTransportError, match="'policy.model.embed_tokens.weight' is not a parameter"):
        load_buckets(model(), renamed)
    assert issubclass(WeightTransportError, RlpipeError)


def test_name_map_hook_and_partial_pushes():
    identity = export_buckets(model(0), name_map=lambda name: name)
    load_buckets(model(1), identity)
    first_bucket_only = export_buckets(model(0), bucket_bytes=1)[:1]
    with pytest.raises(WeightTransportError, match="misses .* parameter"):
        load_buckets(model(1), first_bucket_only)
    assert load_buckets(model(1), first_bucket_only, strict=False) == [first_bucket_only[0].tensors[0].name]


def test_a_delta_carries_only_changed_words_and_rebuilds_the_new_bucket():
    from rlpipe.backends.weights import apply_delta, delta_bucket

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    (old,) = export_buckets(model)
    with torch.no_grad():
        model[0].weight[3, :4] += 1.0
        model[1].bias[0] -= 0.5
    (new,) = export_buckets(model)
    delta = delta_bucket(old, new)
    assert len(delta.indices) == 5 and delta.nbytes < new.nbytes // 20
    rebuilt = apply_delta(old, delta)
    assert rebuilt.checksum == new.checksum and np.array_equal(rebuilt.data, new.data)


def test_a_delta_on_the_wrong_base_or_corrupted_is_refused():
    from rlpipe.backends.weights import DeltaBucket, apply_delta, delta_bucket

    model = torch.nn.Linear(4, 4)
    (old,) = export_buckets(model)
    with torch.no_grad():
        model.weight += 1.0
    (new,) = export_buckets(model)
    delta = delta_bucket(old, new)
    with pytest.raises(WeightTransportError, match="another copy"):
        apply_delta(new, delta)
    bad = DeltaBucket(delta.base_checksum, delta.indices, delta.values ^ 1, delta.tensors, delta.checksum)
    with pytest.raises(WeightTransportError, match="does not match its checksum"):
        apply_delta(old, bad)
