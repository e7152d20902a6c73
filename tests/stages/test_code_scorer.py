"""The ``code`` scorer: solutions against unit tests in the agents' sandbox; escapes stopped; infra failures."""

import json
import socket
import time

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.agents import sandbox
from rlpipe.schemas.batch import column_type
from rlpipe.stage import StageContext, stage_registry
from rlpipe.stages.code_scorer import STARTUP_S, code, parse_tests, response_code
from rlpipe.stages.reward import RuleRewardParams, rule_reward
from rlpipe.stages.scorers import SCORERS, ScorerError, ScorerInfraError

TESTS = json.dumps(["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"])
FAST = {"timeout_s": 1.0, "memory_mb": 256, "max_workers": 4}


def test_registered_and_parsing():
    assert SCORERS.get("code") is code
    assert parse_tests(TESTS) == ["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"]
    assert parse_tests("assert f(1) == 2\nfor x in [1]:\n    assert f(x) > 0\n") == [
        "assert f(1) == 2", "for x in [1]:\n    assert f(x) > 0"]
    with pytest.raises(ScorerError, match="neither a JSON list of tests nor Python source"):
        parse_tests("assert (")
    assert response_code("Here:\n```python\ndef f(): pass\n```\nand\n```py\ndef g(): pass\n```") == "def g(): pass\n"
    assert response_code("def f(): pass") == "def f(): pass"


def test_fraction_of_tests_passed_by_hand():
    responses = [
        "```python\ndef f(x):\n    return x + 1\n```",  # f(3) = 4 ≠ 5: 2 of 3
        "def f(x): return 1 / 0",  # every test raises: 0
        "def f(x): return {1: 2, 2: 3, 3: 5}[x]",  # all pass: 1
        "def f(x) return",  # syntax error: 0
        # printing a result line cannot fake one
        "print('x passed 3')\nimport sys; print('passed 3', file=sys.stderr)\ndef f(x): return x + 1",
    ]
    scores = code(responses, [TESTS] * len(responses), **FAST)
    np.testing.assert_allclose(scores, [2 / 3, 0, 1, 0, 2 / 3], rtol=1e-6)
    assert code(["def f(x): return x + 1"], ["assert f(1) == 2\nassert f(2) == 3\n"], **FAST).tolist() == [1.0]


def test_loop_and_memory_escapes_are_stopped_within_the_limits():
    start = time.monotonic()
    scores = code(["while True: pass\ndef f(x): return x + 1",  # killed at the wall-clock limit
                   "def f(x):\n    while True: pass",  # hangs inside the first test
                   "x = ' ' * 10**10\ndef f(x): return x + 1",  # 10 GB: past RLIMIT_AS, MemoryError
                   "import os\nos._exit(0)"],  # exits without a result
                  [TESTS] * 4, timeout_s=0.5, memory_mb=256, max_workers=4)
    assert scores.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert time.monotonic() - start < 0.5 + STARTUP_S + 4  # 4 sandboxes at once, on a loaded machine


def test_fork_and_subprocess_escapes_are_stopped(tmp_path):
    marker = tmp_path / "child-was-here"
    forker = (f"import os, time\ntry:\n    pid = os.fork()\nexcept PermissionError:\n    pid = -1\n"
              f"if pid == 0:\n    time.sleep(1.0); open({str(marker)!r}, 'w').close(); os._exit(0)\n"
              "def f(x): return x + 1 if pid > 0 else None")
    spawner = (f"import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 1; touch {marker}'])\n"
               "def f(x): return x + 1")
    system = f"import os\nos.system('touch {marker}')\ndef f(x): return x + 1"
    scores = code([forker, spawner, system], [TESTS] * 3, **FAST)
    time.sleep(1.5)  # a child that escaped would write its marker by now
    assert not marker.exists()
    assert scores.tolist() == [0.0, 0.0, 0.0]  # refused: f is never defined as intended


def test_network_escape_is_stopped():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    phone_home = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\ndef f(x): return x + 1"
    assert code([phone_home], [TESTS], **FAST).tolist() == [0.0]
    server.setblocking(False)  # a connection that got through would wait in the backlog now
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_file_writes_outside_the_sandbox_and_oversized_files_are_stopped(tmp_path):
    outside, keep = tmp_path / "written-from-the-sandbox", tmp_path / "keep-me"
    keep.write_text("precious")
    tests = json.dumps(["assert f(1) == 2", "assert wrote()"])
    responses = [
        f"def f(x): return x + 1\ndef wrote():\n    open({str(outside)!r}, 'w').write('x'); return True",
        f"import os\ndef f(x): return x + 1\ndef wrote():\n    os.remove({str(keep)!r}); return True",
        f"import os\ndef f(x): return x + 1\ndef wrote():\n    os.rename({str(keep)!r}, 'mine'); return True",
        # 2 MB > max_file_mb
        "def f(x): return x + 1\ndef wrote():\n    open('big', 'w').write('x' * (2 * 2**20)); return True",
        "def f(x): return x + 1\ndef wrote():\n    open('small', 'w').write('ok'); return open('small').read() == 'ok'",
    ]
    scores = code(responses, [tests] * len(responses), timeout_s=1.0, memory_mb=256, max_file_mb=1)
    assert scores.tolist() == [0.5, 0.5, 0.5, 0.5, 1.0]  # only writing in its own directory, within the size limit
    assert not outside.exists() and keep.read_text() == "precious"


def test_a_sandbox_that_cannot_start_is_an_infra_error(monkeypatch):
    monkeypatch.setattr(sandbox.sys, "executable", "/nonexistent/python")
    with pytest.raises(ScorerInfraError, match=r"code sandbox failed on 2 of 2 rows \(row 0: ") as info:
        code(["def f(x): return x + 1"] * 2, [TESTS] * 2, **FAST)
    assert info.value.failed.tolist() == [0, 1]


def test_bad_options_and_empty_tests():
    with pytest.raises(ScorerError, match="code scorer: memory_mb: Input should be greater than or equal to 32; fix "
                                          "reward scorer_params.code"):
        code(["x"], [TESTS], memory_mb=1)
    with pytest.raises(ScorerError, match="row 0: code ground truth holds no tests"):
        code(["x"], ["[]"])


def batch(responses, uids, truths=None):
    n = len(responses)
    return pa.table({
        "uid": pa.array(uids, pa.string()),
        "data_source": pa.array(["humaneval"] * n, column_type("data_source")),
        "ground_truth": pa.array(truths or [TESTS] * n, column_type("ground_truth")),
        "response_text": pa.array(responses, column_type("response_text")),
        "response_mask": pa.array([[1, 1, 0]] * n, column_type("response_mask")),
        "status": pa.array(["ok"] * n, column_type("status")),
    })


def test_reward_stage_on_a_hand_built_batch_and_infra_failures_leave_dapo_and_advantages(monkeypatch):
    params = RuleRewardParams(routes={"humaneval": "code"}, scorer_params={"code": {"timeout_s": 0.5}})
    ctx = StageContext(step=0, seed=0)
    graded = rule_reward(batch(["def f(x): return {1: 2, 2: 3, 3: 5}[x]", "def f(x): return x + 1",
                                "while True: pass"], ["a", "a", "a"]), params, ctx)
    # by hand: all pass → 1, two of three → 2/3, timeout → 0 (a wrong answer, not a failure)
    np.testing.assert_allclose(graded.columns["reward"].to_numpy(), [1.0, 2 / 3, 0.0], rtol=1e-6)
    assert graded.columns["token_rewards"].to_pylist()[1] == pytest.approx([0.0, 2 / 3, 0.0])
    assert graded.columns["status"].to_pylist() == ["ok"] * 3 and graded.metrics["reward/infra_failures"] == 0
    monkeypatch.setattr(sandbox.sys, "executable", "/nonexistent/python")  # the sandbox dies for group b
    down = rule_reward(batch(["def f(x): return x + 1"] * 2, ["b", "b"]), params, ctx)
    monkeypatch.undo()
    assert down.columns["status"].to_pylist() == ["failed", "failed"] and down.metrics["reward/infra_failures"] == 2
    assert down.columns["reward"].to_pylist() == [0.0, 0.0] and "reward/mean" not in down.metrics
    table = batch(["x"] * 5, ["a", "a", "a", "b", "b"]).drop(["status"])
    for name in ("reward", "token_rewards", "status"):
        table = table.append_column(name, pa.concat_arrays([graded.columns[name], down.columns[name]]))
    table = table.append_column("sample_index", pa.array([0, 1, 2, 0, 1], pa.int32()))
    from rlpipe.stages.filter_groups import FilterGroupsParams, filter_groups

    assert filter_groups(table, FilterGroupsParams(), ctx).keep.tolist() == [0, 1, 2]  # group b: no valid row
    grpo = stage_registry("advantage").get("grpo")
    adv = grpo.fn(table, grpo.params_model(), ctx)
    assert adv.columns["advantages"].to_pylist()[3:] == [[0.0, 0.0, 0.0]] * 2
    assert adv.metrics["advantage/failed_rows"] == 2.0
