"""The run report's data and page on hand-built lineage (no MLflow, no run): timeline rows per worker, staleness
and length per step, tokens coloured per version with masked spans, the engine/trainer log-prob mismatch."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pyarrow as pa
import pytest

from rlpipe.engine.tracking.lineage import TRAJECTORY_LINEAGE_SCHEMA
from rlpipe.engine.tracking.observer import NodeRecord
from rlpipe.engine.tracking.report import data as D
from rlpipe.engine.tracking.report.page import render

NODES = [("generate", "rollout×1", 0.5), ("reward", "task", 0.1), ("update", "actor×1", 0.3),
         ("weight_sync", "driver", 0.05)]


def records(steps: int = 3) -> list[NodeRecord]:
    """Back-to-back executions, step 0 (warm-up) ten times longer."""
    out, clock = [], 100.0
    for step in range(steps):
        for node, worker, d in NODES:
            d = d * 10 if step == 0 else d
            out.append(NodeRecord(run_id="r", step=step, node=node, kind=node, impl="x", params={}, params_hash="",
                                  code_hash="", input_fingerprint="", output_fingerprint="", rows_in=4, rows_out=4,
                                  policy_versions=[step], trainer_version=step, start_time=clock, duration_s=d,
                                  worker=worker, error="boom" if (step, node) == (2, "reward") else ""))
            clock += d
    return out


def sampled() -> dict[int, pa.Table]:
    """Two steps' sampled trajectories: versions 3..5, a masked observation span, a non-finite log-prob."""
    lst = pa.list_
    step3 = pa.table({
        "uid": ["3-0", "3-1"], "sample_index": pa.array([0, 0], pa.int32()),
        "response_ids": pa.array([[11, 12, 13, 14], [15, 16]], lst(pa.int32())),
        "response_mask": pa.array([[1, 0, 0, 1], [1, 1]], lst(pa.int8())),
        "token_versions": pa.array([[3, 3, 3, 4], [4, 4]], lst(pa.int32())),
        "rollout_logprobs": pa.array([[-1.0, 0.0, 0.0, -2.0], [-0.5, -3.0]], lst(pa.float32())),
        "old_logprobs": pa.array([[-1.25, -9.0, -9.0, -2.0], [-0.25, float("-inf")]], lst(pa.float32())),
        "reward": pa.array([1.0, 0.0], pa.float32()), "status": ["ok", "truncated"], "prompt_text": ["12=", "34="],
    })
    step5 = pa.table({
        "uid": ["5-0"], "response_ids": pa.array([[17, 18, 19]], lst(pa.int32())),
        "token_versions": pa.array([[5, 5, 5]], lst(pa.int32())),
        "rollout_logprobs": pa.array([[-1.0, -1.0, -1.0]], lst(pa.float32())),
        "old_logprobs": pa.array([[-1.5, -1.0, -0.5]], lst(pa.float32())),
    })
    return {3: step3, 5: step5}


def test_timeline_rows_per_worker_leave_out_the_warm_up_step():
    tl = D.timeline(records())
    assert tl.workers == ["rollout×1", "task", "actor×1", "driver"] and "warm-up step 0" in tl.note
    assert {b.step for b in tl.bars} == {1, 2} and len(tl.bars) == 8
    assert [sum(b.worker == w for b in tl.bars) for w in tl.workers] == [2, 2, 2, 2]
    # times from the first shown execution: step 1 starts at 0, step 2 after step 1's 0.95 s
    assert tl.step_starts == [(1, 0.0), (2, pytest.approx(0.95))] and tl.span_s == pytest.approx(1.9)
    assert [b.error for b in tl.bars if b.step == 2] == [False, True, False, False]
    assert D.timeline(records(30), max_steps=5).step_starts[0][0] == 25  # the last 5 steps
    assert D.timeline([]).bars == [] and D.timeline(records(1)).note is None  # one step: it is shown


def test_series_staleness_and_length_per_consuming_step():
    rows = [{"uid": "a", "sample_index": 0, "prompt_step": p, "consumed_step": c, "num_tokens": n}
            for p, c, n in [(0, 1, 4), (1, 1, 2), (0, 2, 6), (2, 2, 2), (None, 2, 1)]]
    lineage = pa.Table.from_pylist(rows, schema=TRAJECTORY_LINEAGE_SCHEMA)
    by = {s.name: s.points for s in D.series({0: 0.5, 1: float("nan"), 2: 0.7}, lineage)}
    assert by["reward/mean"] == [(0, 0.5), (2, 0.7)]  # a non-finite reward is not drawn
    assert by["response length (tokens, mean)"] == [(1, 3.0), (2, 3.0)]
    assert by["staleness (mean)"] == [(1, 1.5), (2, 2.0)] and by["staleness (max)"] == [(1, 2.0), (2, 3.0)]
    assert [s.name for s in D.series({}, None)] == ["reward/mean"]


def test_tokens_carry_versions_masks_and_log_probs_and_are_bounded():
    trajs = D.sampled_trajectories(sampled(), decode=lambda ids: [chr(ord("a") + i - 11) for i in ids])
    assert [(t.step, t.uid) for t in trajs] == [(3, "3-0"), (3, "3-1"), (5, "5-0")]
    first = trajs[0]
    assert "".join(tok.text for tok in first.tokens) == "abcd" and first.prompt == "12=" and first.reward == 1.0
    assert [tok.masked for tok in first.tokens] == [False, True, True, False]
    assert [tok.version for tok in first.tokens] == [3, 3, 3, 4]
    assert first.tokens[0].engine_logprob == -1.0 and first.tokens[0].trainer_logprob == -1.25
    assert not any(tok.masked for tok in trajs[2].tokens)  # no response_mask column: every token trained on
    versions = D.token_versions(trajs)
    assert versions == [3, 4, 5]
    assert [D.version_class(v, versions) for v in (3, 4, 5, None)] == ["ver-0", "ver-1", "ver-2", "ver-none"]
    assert D.version_class(11, list(range(3, 12))) == "ver-0"  # the 9th version wraps around the 8 colours
    short = D.sampled_trajectories(sampled(), limit=2, max_tokens=2)
    assert len(short) == 2 and short[0].tokens_left_out == 2 and short[0].tokens[0].text == "[11]"


def test_mismatch_against_hand_computation():
    m = D.mismatch(sampled())
    # trained-on, finite: step 3: (-1, -1.25), (-2, -2), (-0.5, -0.25); step 5: (-1, -1.5), (-1, -1), (-1, -0.5)
    deltas = [-0.25, 0.0, 0.25, -0.5, 0.0, 0.5]
    assert m.tokens == 6
    assert m.mean_abs == pytest.approx(sum(map(abs, deltas)) / 6) and m.max_abs == pytest.approx(0.5)
    assert m.mean == pytest.approx(0.0, abs=1e-9)
    assert sorted(m.points) == sorted([(-1.0, -1.25), (-2.0, -2.0), (-0.5, -0.25), (-1.0, -1.5), (-1.0, -1.0),
                                       (-1.0, -0.5)])
    assert len(D.mismatch(sampled(), max_points=3).points) == 3
    assert D.mismatch({1: sampled()[3].drop_columns(["old_logprobs"])}) is None


def test_pick_steps_spreads_from_first_to_last():
    assert D.pick_steps(list(range(100)), 5) == [0, 25, 50, 74, 99]
    assert D.pick_steps([4, 2], 5) == [2, 4]


def _report() -> D.ReportData:
    trajs = D.sampled_trajectories(sampled())
    prediction = D.Prediction(title="rlpipe simulate: run r (sync) → sync", verdict="ok",
                              rows=[D.PredictionRow(figure="steps/s", predicted="12.6", recorded="7.23")])
    return D.ReportData(run_id="r" * 32, run_name="hand", status="FINISHED", mode="sync", steps=3,
                        timeline=D.timeline(records()), series=D.series({0: 0.1, 1: 0.2, 2: 0.4}, None),
                        trajectories=trajs, versions=D.token_versions(trajs), mismatch=D.mismatch(sampled()),
                        prediction=prediction)


def test_page_draws_the_timeline_tokens_mismatch_and_prediction():
    report = _report()
    page = render(report)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained: nothing fetched, nothing run
    svgs = {el.get("id"): el for el in (ET.fromstring(s[: s.index("</svg>") + 6])
                                         for s in ("<svg" + part for part in page.split("<svg")[1:]))}
    assert set(svgs) == {"timeline", "reward-chart", "length-chart", "staleness-chart", "mismatch-scatter"}
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in svgs["timeline"].iter(f"{ns}rect") if r.get("class") == "bar"]
    assert len(bars) == len(report.timeline.bars) == 8 and all(float(b.get("width")) >= 1 for b in bars)
    assert [b.get("stroke") for b in bars].count("#c00") == 1  # the failed execution is outlined
    assert len([c for c in svgs["mismatch-scatter"].iter(f"{ns}circle") if c.get("class") == "mm-point"]) == 6
    assert len(list(svgs["reward-chart"].iter(f"{ns}polyline"))) == 1
    assert page.count('class="tok ver-0"') == 3 and page.count('class="tok ver-1"') == 3 \
        and page.count('class="tok ver-2"') == 3
    assert page.count('<span class="masked-span"') == 1  # the two masked tokens: one marked span
    assert "Δ -2.50e-01" in page and ">v5</span>" in page  # a token's tooltip; the version legend
    assert "steps/s" in page and "12.6" in page and "7.23" in page


def test_page_says_what_is_missing():
    empty = D.ReportData(run_id="x" * 32, notes=["no sampled trajectories"])
    page = render(empty)
    assert "no node execution recorded" not in page  # an empty timeline says 'nothing recorded'
    assert "nothing recorded" in page and "no sampled trajectories" in page and "not recorded" in page
    assert "rlpipe report xxxxxxxx" in page  # where the prediction comes from


def test_ticks_are_round():
    from rlpipe.engine.tracking.report.svg import ticks

    assert ticks(0, 1, 4) == [0, 0.25, 0.5, 0.75, 1.0]
    assert ticks(0, 0.17, 4) == [0, 0.05, 0.1, 0.15]
    assert ticks(1, 1) == [1] and ticks(math.nan, 1) == []
