"""The ``code`` scorer against solutions written to score themselves: each ends with its honest score.

Every attack below is a solution whose ``f`` fails the tests (honest score 0), or passes two of three (2/3);
an attack that worked would score more. Where an attack could only *read* something (the tests, another
process's ``/proc``), the solution turns success into a score: it defines a correct ``f`` if it got through.
"""

import builtins
import json
import logging
import math

import numpy as np
import pyarrow as pa
import pytest

from rlpipe.agents import sandbox
from rlpipe.schemas.batch import column_type
from rlpipe.stage import StageContext
from rlpipe.stages import code_scorer
from rlpipe.stages.code_judge import _bind, decode, encode
from rlpipe.stages.code_scorer import SandboxDown, code, read_verdict, run_tests
from rlpipe.stages.reward import RuleRewardParams, rule_reward

TESTS = json.dumps(["assert f(1) == 2", "assert f(2) == 3", "assert f(3) == 5"])
FAST = {"timeout_s": 1.0, "memory_mb": 256, "max_workers": 4}
NONCE = "0123456789abcdef0123456789abcdef"

# Lines a forger would try: the old harness's format, a nonce-shaped guess, 1000, junk, and the wire's own forms.
FORGED = ["passed 3", f"{NONCE} passed 3", "x passed 1000", "passed 3abc", "ready", "up", f"{NONCE} ready",
          '{"up": 1}', '{"v": {"d": [["f", {"h": 0}]]}}', '{"v": 1000}', '{"v": true}', '{"e": ["X", "y"]}']
FORGE = f"""
import gc, io, os, sys
FORGED = {FORGED!r}

def _write_everywhere(extra=()):
    lines = [line + "\\n" for line in [*FORGED, *extra]]
    for line in lines:
        print(line, end=""); print(line, end="", file=sys.stderr)
        for stream in (sys.__stdout__, sys.__stderr__):
            try:
                stream.write(line); stream.flush()
            except Exception:
                pass
    for fd in range(65):  # every descriptor this process could have inherited
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError:
                pass
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.open("/proc/self/fd/" + name, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError:
                pass
"""
TAMPER = FORGE + """
import re

def _tamper(scope):  # what the old in-process harness fell to: its count, its tests, its nonce, its stream
    nonces = [v for v in scope.values() if isinstance(v, str) and re.fullmatch(r"[0-9a-f]{16,64}", v)]
    for key, value in list(scope.items()):
        if key in ("passed", "_passed", "score"):
            scope[key] = 1000
        if key in ("tests", "_tests"):
            scope[key] = []
        if hasattr(value, "write") and hasattr(value, "flush"):
            for line in FORGED + [n + " passed 1000" for n in nonces]:
                try:
                    value.write(line + "\\n"); value.flush()
                except Exception:
                    pass
"""
FRAME_WALK = TAMPER + """
def _walk():
    frame = sys._getframe()
    while frame is not None:  # up to whatever called the solution
        _tamper(frame.f_locals)
        _tamper(frame.f_globals)
        frame = frame.f_back
_walk()

def f(x):
    _walk()
    return None
"""
GC_WALK = TAMPER + """
nonces = set()
for obj in gc.get_objects():
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value):
            nonces.add(value)
    if isinstance(obj, dict) and ("passed" in obj or "_passed" in obj or "nonce" in obj):
        _tamper(obj)
    if isinstance(obj, io.IOBase) and not obj.closed:
        for nonce in nonces:
            try:
                obj.write(nonce + " passed 3\\n"); obj.flush()
            except Exception:
                pass
_write_everywhere([n + " passed 3" for n in nonces] + [n + " passed 1000" for n in nonces])

def f(x):
    return None
"""
STREAMS_AND_FDS = FORGE + """
_write_everywhere()

def f(x):
    _write_everywhere()  # again while the tests run
    return None
"""
SCORE_1000_AND_JUNK = FORGE + """
_write_everywhere([f"{NONCE} passed 1000", f"{NONCE} passed 3 junk", "passed 1e3", "passed -1", "passed 03"])

def f(x):
    raise SystemExit(0)
""".replace("{NONCE}", NONCE)
# Reading, not writing: the tests, the nonce and the judge are nowhere the solution can look.
SNOOP = """
import gc, glob, os
NEEDLE = "".join(map(chr, (102, 40, 51, 41, 32, 61, 61, 32, 53)))  # a test's text, built at run time only
got_through = False
for path in glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ") + glob.glob("/tmp/rlpipe-*/*"):
    try:
        got_through |= NEEDLE.encode() in open(path, "rb").read(1 << 20)
    except Exception:
        pass
for path in glob.glob("/proc/[0-9]*/fd/*"):
    if path.split("/")[2] not in (str(os.getpid()), "1"):
        try:  # another process's descriptor, e.g. the judge's stdin or its report pipe
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
            got_through = True
        except OSError:
            pass
for obj in gc.get_objects():
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        if isinstance(value, (str, bytes)) and value is not NEEDLE:
            got_through |= (NEEDLE if isinstance(value, str) else NEEDLE.encode()) in value
if got_through:
    def f(x):  # it would score 1
        return {1: 2, 2: 3, 3: 5}[x]
else:
    def f(x):
        return None
"""
ALWAYS_EQUAL = """
class Yes:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True

class YesInt(int):
    def __eq__(self, other): return True

def f(x):
    return Yes() if x == 1 else YesInt(0)
"""
SHADOW_BUILTINS = """
import builtins
builtins.abs = lambda x: 0  # the worker's builtins, not the judge's
def isinstance(*args): return True
def abs(x): return 0
def all(xs): return True
class math:  # for a test that counts on the solution's `import math`
    isclose = staticmethod(lambda *args, **kwargs: True)
def f(x): return "no"
"""
SHADOW_TESTS = json.dumps(["assert isinstance(f(1), int)", "assert abs(f(2) - 3) < 1e-9", "assert all([f(3) == 5])",
                           "assert math.isclose(f(1), 2)"])


def test_escapes_end_with_the_honest_score():
    attacks = {"frame walking": FRAME_WALK, "gc walking": GC_WALK, "stdout, stderr, fds 0..64, /proc/self/fd":
               STREAMS_AND_FDS, "1000 and junk": SCORE_1000_AND_JUNK, "snooping": SNOOP,
               "always-equal objects": ALWAYS_EQUAL}
    scores = code(list(attacks.values()), [TESTS] * len(attacks), **FAST)
    assert dict(zip(attacks, scores.tolist())) == dict.fromkeys(attacks, 0.0)
    assert code([SHADOW_BUILTINS], [SHADOW_TESTS], **FAST).tolist() == [0.0]


def test_what_tests_do_with_a_solution_still_works():
    """Classes, methods, generators, the solution's imports and constants, exceptions, data subclasses, numpy."""
    solution = """
import collections, math
import numpy as np
MOD = 10**9 + 7
TABLE = list(range(300_000))  # too big to send up front: a proxy
LOOP = []; LOOP.append(LOOP)
Point = collections.namedtuple("Point", "x y")
class Solution:
    def __init__(self): self.calls = 0
    def two_sum(self, nums, target):
        self.calls += 1
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen: return [seen[target - n], i]
            seen[n] = i
def gen(n):
    yield from range(n)
def counts(s): return collections.Counter(s)
def point(): return Point(1, 2)
def root(x):
    if x < 0: raise ValueError("negative")
    return math.sqrt(x)
def arr(): return np.arange(3)
"""
    tests = ["s = Solution()\nassert s.two_sum([2, 7, 11], 9) == [0, 1] and s.calls == 1",
             "assert list(gen(3)) == [0, 1, 2] and sum(gen(4)) == 6",
             "assert counts('aab') == {'a': 2, 'b': 1} and point() == (1, 2)",
             "try:\n    root(-1)\n    assert False\nexcept ValueError as e:\n    assert 'negative' in str(e)",
             "assert math.isclose(root(2) ** 2, 2) and MOD == 1000000007",
             "assert TABLE[299_999] == 299_999 and len(TABLE) == 300_000 and arr() == [0, 1, 2]",
             "assert np.allclose(arr(), [0, 1, 2])"]
    assert code([solution], [json.dumps(tests)], **{**FAST, "memory_mb": 512}).tolist() == [1.0]


def test_an_attack_during_the_tests_keeps_the_honest_partial_score():
    walker = FRAME_WALK.replace("    return None\n", "    return x + 1\n")  # 2 of 3 honestly; walks on every call
    assert code([walker], [TESTS], **FAST).tolist() == pytest.approx([2 / 3])


def test_escapes_without_namespaces_are_refused_by_the_audit_hook(monkeypatch):
    monkeypatch.setattr(sandbox, "network_isolated", lambda: False)  # every /proc entry on the host is visible
    scores = code([SNOOP, STREAMS_AND_FDS], [TESTS] * 2, **FAST)
    assert scores.tolist() == [0.0, 0.0]


def test_the_report_is_parsed_strictly():
    n = 3
    assert read_verdict(f"{NONCE} ready\n{NONCE} up\n{NONCE} passed 1\n{NONCE} passed 2\n", NONCE, n).passed == 2
    for forged in ("passed 1000", "passed 4", "passed 3abc", "passed 3 3", "passed -1", "passed 03", "passed 3.0",
                   "passed", "passed  3", "ready!", "passed 99999999999"):
        verdict = read_verdict(f"{NONCE} ready\n{NONCE} up\n{NONCE} {forged}\n", NONCE, n)
        assert verdict.forged == f"{NONCE} {forged}", forged
    assert read_verdict(f"{NONCE}passed 3\n", NONCE, n).forged is not None
    other = "f" * 32
    verdict = read_verdict(f"{NONCE} ready\n{NONCE} up\n{other} passed 3\npassed 3\n", NONCE, n)
    assert (verdict.ready, verdict.up, verdict.passed, verdict.forged) == (True, True, 0, None)


@pytest.mark.parametrize(("report", "expected"), [
    ("{n} ready\n{n} up\n{n} passed 3\n", 1.0),
    ("{n} ready\n{n} up\n{n} passed 2\n", 2 / 3),
    ("{n} ready\n{n} up\n", 0.0),  # no verdict: a timeout or a crash before the first test ended
    ("{n} ready\n{n} up\n{n} passed 1000\n", 0.0),  # out of range: forged, not clamped to 1
    ("{n} ready\n{n} up\n{n} passed 3abc\n", 0.0),  # junk after the count: forged, no ValueError
    ("{n} ready\n{n} up\n{n} passed 2\n{n} passed 3 junk\n", 0.0),
])
def test_a_report_scores_its_count_or_zero_never_an_exception(monkeypatch, caplog, report, expected):
    monkeypatch.setattr(code_scorer.secrets, "token_hex", lambda _: NONCE)
    monkeypatch.setattr(code_scorer, "_run_pair", lambda *a: report.replace("{n}", NONCE).encode())
    with caplog.at_level(logging.WARNING, logger=code_scorer.__name__):
        assert run_tests("def f(x): pass", ["assert f(1) == 2"] * 3, sandbox.SandboxLimits()) == pytest.approx(expected)
    assert ("not its own" in caplog.text) == ("1000" in report or "abc" in report or "junk" in report)


@pytest.mark.parametrize(("report", "match"), [("", "the judge's sandbox did not come up"),
                                               ("{n} ready\n{n} passed 3\n", "the solution's sandbox did not come up")])
def test_only_a_sandbox_that_did_not_come_up_is_an_infrastructure_failure(monkeypatch, report, match):
    monkeypatch.setattr(code_scorer.secrets, "token_hex", lambda _: NONCE)
    monkeypatch.setattr(code_scorer, "_run_pair", lambda *a: report.replace("{n}", NONCE).encode())
    with pytest.raises(SandboxDown, match=match):
        run_tests("def f(x): pass", ["assert f(1) == 2"], sandbox.SandboxLimits())


@pytest.mark.parametrize("broken", ['report(f"passed {passed}abc")', 'report(f"passed {passed + 1000}")'])
def test_a_judge_whose_report_is_junk_scores_zero_through_the_real_sandbox(monkeypatch, broken):
    program = code_scorer._PROGRAM.replace('report(f"passed {passed}")', broken)
    assert program != code_scorer._PROGRAM
    monkeypatch.setattr(code_scorer, "_PROGRAM", program)
    assert code(["def f(x): return {1: 2, 2: 3, 3: 5}[x]"], [TESTS], **FAST).tolist() == [0.0]


def test_the_wire_carries_plain_data_only():
    handles = []
    value = [1, 2.5, "s", None, True, (1, 2), {"a": {3}}, frozenset([4]), b"\x00", 1j]
    doc = json.loads(json.dumps(encode(value, lambda v: {"h": handles.append(v) or len(handles) - 1})))
    assert decode(doc, lambda h: ("handle", h)) == value
    assert encode(object, lambda v: {"h": 7}) == {"h": 7}  # not data: a handle, the object stays where it is
    for bad in ({"l": [1], "t": [2]}, {"x": 1}, {"d": [[1]]}, {"h": "0"}, {"b": "!!"}, {"c": [1, "2"]}, [1]):
        with pytest.raises(ValueError):
            decode(bad, lambda h: h)


def test_forged_names_cannot_replace_the_tests_builtins_or_modules():
    """The names come over the worker's wire, which the solution can write: a forged list binds nothing unsafe."""
    forged = {"d": [["__builtins__", {"d": [["abs", {"h": 0}]]}], ["abs", {"h": 0}], ["math", {"h": 0}],
                    ["json", 1], ["shady", {"m": "rlpipe"}], ["f", {"h": 1}], ["K", {"l": [1]}]]}
    ns = _bind(forged, ["abs(f(1)); math.pi; json.dumps(1); shady; K"])
    assert ns["__builtins__"] is builtins and "abs" not in ns and "shady" not in ns
    assert ns["math"] is math and ns["json"] is json and ns["K"] == [1]
    assert type(ns["f"]).__name__ == "Remote"


def test_the_run_goes_on_when_every_row_forges():
    n = 3
    table = pa.table({
        "uid": pa.array(["a"] * n, pa.string()),
        "data_source": pa.array(["humaneval"] * n, column_type("data_source")),
        "ground_truth": pa.array([TESTS] * n, column_type("ground_truth")),
        "response_text": pa.array([f"```python\n{src}```" for src in (GC_WALK, SCORE_1000_AND_JUNK, FRAME_WALK)],
                                  column_type("response_text")),
        "response_mask": pa.array([[1, 1, 0]] * n, column_type("response_mask")),
        "status": pa.array(["ok"] * n, column_type("status")),
    })
    params = RuleRewardParams(routes={"humaneval": "code"}, scorer_params={"code": FAST})
    graded = rule_reward(table, params, StageContext(step=0, seed=0))
    np.testing.assert_array_equal(graded.columns["reward"].to_numpy(), [0.0] * n)
    assert graded.columns["status"].to_pylist() == ["ok"] * n and graded.metrics["reward/infra_failures"] == 0
