"""Tools and parsers: the safe calculator, the python sandbox's limits (real subprocesses), the call parsers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from rlpipe.agents.parsers import build_parser
from rlpipe.agents.sandbox import SandboxLimits, network_isolated, run_python
from rlpipe.agents.tools import TOOLS, CalculatorError, LatencyTool, ToolCall, build_tool, evaluate
from rlpipe.errors import RegistryError


def test_calculator_is_arithmetic_only():
    assert evaluate("12*3") == 36 and evaluate("(1+2)**3 - 7//2 % 2") == 26 and evaluate("-1.5*2") == -3.0
    for bad in ("__import__('os')", "x+1", "open('f')", "[1][0]", "9**9**9", "1/0", "1+"):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    calc = build_tool("calculator")
    assert calc.run({"expression": "2+3"}).text == "5"
    assert calc.run({"expression": "7/2"}).text == "3.5"
    out = calc.run({"expression": "a"})
    assert not out.ok and out.text.startswith("error:")


def test_registry_names_the_known_tools():
    assert {"calculator", "python", "latency"} <= set(TOOLS.names())
    with pytest.raises(RegistryError, match="unknown tool 'nope'; known: calculator, latency, lookup, python"):
        build_tool("nope")


def test_latency_is_seeded_and_long_tailed():
    tool = LatencyTool(min_s=0.01, max_s=5.0, seed=3)
    delays = [tool.delay(str(i)) for i in range(2000)]
    assert delays == [LatencyTool(min_s=0.01, max_s=5.0, seed=3).delay(str(i)) for i in range(2000)]
    assert min(delays) >= 0.01 and max(delays) > 50 * sorted(delays)[1000]  # heavy tail
    assert LatencyTool(min_s=0.0, max_s=0.0).run({"key": "x"}).ok


def test_hermes_parser():
    parser = build_parser("hermes")
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            "<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>")
    calls = parser.parse(text)
    assert [c.call for c in calls[:2]] == [ToolCall("calculator", {"expression": "1+2"}),
                                          ToolCall("python", {"code": "print(1)"})]
    assert calls[2].call is None and "not valid JSON" in calls[2].error
    assert calls[3].call is None and "needs" in calls[3].error
    assert parser.parse("no call here") == []
    assert parser.observation([build_tool("calculator").run({"expression": "1+2"})]) == \
        "<tool_response>3</tool_response>"


def test_compact_parser():
    parser = build_parser("compact")
    calls = parser.parse("x[12*3] and [python:print(2)][latency:k]")
    assert [c.call for c in calls] == [ToolCall("calculator", {"expression": "12*3"}),
                                      ToolCall("python", {"code": "print(2)"}), ToolCall("latency", {"key": "k"})]
    assert parser.parse("12*3") == []
    assert parser.observation([build_tool("calculator").run({"expression": "1+2"})]) == "=3;"


# -- the sandbox: real subprocesses ---------------------------------------------------------

FAST = SandboxLimits(cpu_s=1, wall_s=4, memory_mb=200)


def test_sandbox_runs_code_and_reports_its_failure_as_an_observation():
    assert run_python("print(6*7)", FAST).text == "42\n"
    out = run_python("raise ValueError('bad')", FAST)
    assert not out.ok and "ValueError: bad" in out.text and "exit code 1" in out.text


def test_sandbox_cpu_limit():
    start = time.monotonic()
    out = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert not out.ok and "CPU limit" in out.text
    assert time.monotonic() - start < 25


def test_sandbox_memory_limit():
    out = run_python("x = bytearray(600 * 2**20); print('allocated')", FAST)
    assert not out.ok and "MemoryError" in out.text and "allocated" not in out.text


def test_sandbox_wall_limit_kills_forked_children():
    marker = f"rlpipe-sandbox-test-{os.getpid()}"
    code = ("import os, time\n"
            "for i in range(3):\n"
            "    if os.fork() == 0:\n"
            "        if i == 0: os.setsid()  # one child even leaves the process group\n"
            f"        os.execv({sys.executable!r}, ['python', '-c', 'import time; time.sleep(300)', '{marker}'])\n"
            "time.sleep(300)\n")
    start = time.monotonic()
    out = run_python(code, SandboxLimits(cpu_s=5, wall_s=1.5))
    assert not out.ok and "wall-clock limit" in out.text and time.monotonic() - start < 10
    time.sleep(0.3)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    if not network_isolated():  # without a PID namespace a setsid child escapes the process-group kill
        pytest.skip("unshare is not permitted here; only the process group was killed")
    assert left == [], f"sandbox children left running: {left}"


def test_sandbox_has_no_network():
    if not network_isolated():
        pytest.skip("unshare is not permitted here: the sandbox cannot cut the network (documented)")
    code = ("import socket\n"
            "s = socket.socket(); s.settimeout(2)\n"
            "s.connect(('1.1.1.1', 53))\n"
            "print('connected')\n")
    out = run_python(code, FAST)
    assert not out.ok and "connected" not in out.text and ("unreachable" in out.text or "OSError" in out.text)


def test_python_tool_through_the_registry():
    tool = build_tool("python", {"cpu_s": 1, "wall_s": 4})
    assert tool.run({"code": "print(sum(range(5)))"}).text == "10\n"
    assert not tool.run({}).ok


def test_agent_settings_are_checked_before_anything_runs():
    from pydantic import ValidationError

    from rlpipe.stages.generate import GenerateParams

    GenerateParams(agent="tool_agent", agent_loop={"tools": ["python"], "tool_settings": {"python": {"cpu_s": 2}}})
    for loop, text in (({"tools": ["nope"]}, "unknown tool(s) ['nope']; known: calculator, latency, lookup, python"),
                       ({"parser": "xml"}, "unknown tool parser 'xml'; known: compact, hermes, trigger"),
                       ({"tool_settings": {"python": {}}}, "not in tools"),
                       ({"tools": ["python"], "tool_settings": {"python": {"cpus": 2}}}, "tool_settings.python")):
        with pytest.raises(ValidationError, match=re.escape(text)):
            GenerateParams(agent="tool_agent", agent_loop=loop)
    with pytest.raises(ValidationError, match="unknown agent 'react'; known: gateway, single_turn, tool_agent"):
        GenerateParams(agent="react")
    with pytest.raises(ValidationError, match="unknown agent program 'x'; known: calculator_client"):
        GenerateParams(agent="gateway", gateway={"program": "x"})
    with pytest.raises(ValidationError, match="is not a file"):
        GenerateParams(agent="gateway", gateway={"script": "/nonexistent/agent.py"})
