"""The balance stage: equal rows per rank, near-equal tokens, checked against a brute-force optimum."""

import itertools

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.errors import ConfigError
from rlpipe.schemas.batch import column_type
from rlpipe.stage import NoParams, StageContext, stage_registry
from rlpipe.stages.balance import TokenBalanceParams, balance_none, balance_tokens, greedy_partition, refine


def loads(lengths, ranks, k):
    return np.bincount(ranks, weights=lengths, minlength=k)


def optimum(lengths, k):
    """Smallest possible max load over partitions into k groups of equal size (exhaustive)."""
    m, best = len(lengths) // k, [np.inf]

    def search(remaining, worst):
        if worst >= best[0]:
            return
        if not remaining:
            best[0] = worst
            return
        first, rest = remaining[0], remaining[1:]
        for combo in itertools.combinations(rest, m - 1):
            group = (first, *combo)
            search([r for r in rest if r not in combo], max(worst, lengths[list(group)].sum()))

    search(list(range(len(lengths))), 0)
    return best[0]


def test_hand_example():
    lengths = np.array([10, 9, 1, 1])
    ranks = greedy_partition(lengths, 2)  # round 1: 10 → r0, 9 → r1; round 2: lightest r1 gets 1, r0 gets 1
    assert loads(lengths, ranks, 2).tolist() == [11, 10]
    assert np.bincount(ranks).tolist() == [2, 2]


def test_close_to_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(150):
        k = int(rng.choice([2, 3, 4]))
        n = k * int(rng.integers(1, 4 if k == 4 else 5))
        lengths = rng.integers(1, 100, n)
        ranks = refine(lengths, greedy_partition(lengths, k), k, 64)
        load = loads(lengths, ranks, k)
        assert np.bincount(ranks, minlength=k).tolist() == [n // k] * k  # equal row counts
        assert load.max() - load.min() <= lengths.max()  # the greedy's guarantee survives refinement
        ratios.append(load.max() / optimum(lengths, k))
    assert max(ratios) <= 1.1 and np.mean(ratios) <= 1.01


def test_refinement_never_hurts_and_beats_round_robin_on_a_large_batch():
    rng = np.random.default_rng(1)
    lengths = rng.integers(10, 2000, 1024)
    greedy = greedy_partition(lengths, 8)
    refined = refine(lengths, greedy, 8, 64)
    assert loads(lengths, refined, 8).max() <= loads(lengths, greedy, 8).max()
    assert loads(lengths, refined, 8).max() / lengths.mean() / 128 < 1.0001
    assert loads(lengths, np.arange(1024) % 8, 8).max() / lengths.mean() / 128 > 1.005


def batch(prompt_lens, response_lens):
    return pa.table({
        "prompt_ids": pa.array([[1] * p for p in prompt_lens], column_type("prompt_ids")),
        "response_ids": pa.array([[2] * r for r in response_lens], column_type("response_ids")),
        "uid": pa.array([f"g{i // 2}" for i in range(len(prompt_lens))], column_type("uid")),
    })


def test_stage_counts_prompt_and_response_tokens():
    table = batch([2, 2, 2, 2, 2, 2], [30, 1, 1, 10, 10, 10])  # totals 32, 3, 3, 12, 12, 12 = 74
    result = balance_tokens(table, TokenBalanceParams(), StageContext(step=0, seed=0, dp_size=2))
    ranks = result.columns["dp_rank"]
    assert ranks.type == pa.int32() and np.bincount(ranks.to_numpy()).tolist() == [3, 3]
    assert result.metrics == {"balance/max_tokens_per_rank": 38.0, "balance/min_tokens_per_rank": 36.0,
                              "balance/imbalance": pytest.approx(38 / 37)}
    none = balance_none(table, NoParams(), StageContext(step=0, seed=0, dp_size=2))
    assert none.columns["dp_rank"].to_pylist() == [0, 1, 0, 1, 0, 1]
    # rows 0, 2, 4 = 32 + 3 + 12 on rank 0
    assert none.metrics["balance/max_tokens_per_rank"] == 47.0
    assert none.metrics["balance/imbalance"] == pytest.approx(47 / 37)


def test_single_rank_and_empty_batch():
    one = balance_tokens(batch([1, 2, 3], [4, 5, 6]), TokenBalanceParams(), StageContext(step=0, seed=0))
    assert one.columns["dp_rank"].to_pylist() == [0, 0, 0] and one.metrics["balance/imbalance"] == 1.0
    empty = balance_tokens(batch([], []), TokenBalanceParams(), StageContext(step=0, seed=0, dp_size=4))
    assert empty.columns["dp_rank"].to_pylist() == []


def test_rows_not_divisible_by_dp_size():
    for fn, params in ((balance_tokens, TokenBalanceParams()), (balance_none, NoParams())):
        with pytest.raises(ConfigError, match=r"5 rows cannot be split evenly over trainer.dp_size=2 ranks.*"
                                              r"data.prompts_per_step × the number of samples per prompt divisible"):
            fn(batch([1] * 5, [1] * 5), params, StageContext(step=0, seed=0, dp_size=2))


def test_contract():
    for impl in ("tokens", "none"):
        spec = stage_registry("balance").get(impl)
        params = spec.params_model()
        assert set(spec.read_columns(params)) == {"prompt_ids", "response_ids", "uid"}
        assert spec.write_columns(params) == {"dp_rank": pa.int32()}
