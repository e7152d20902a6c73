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


def left_running(marker: str) -> list[str]:
    """Processes whose command line carries ``marker`` (the sandboxed code is on its command line)."""
    time.sleep(0.2)
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


def test_sandbox_cpu_limit():
    marker = f"rlpipe-cpu-{os.getpid()}"
    start = time.monotonic()
    out = run_python(f"# {marker}\nwhile True: pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert not out.ok and "CPU limit" in out.text
    assert time.monotonic() - start < 25
    assert left_running(marker) == []


def test_sandbox_memory_limit():
    marker = f"rlpipe-memory-{os.getpid()}"
    out = run_python(f"# {marker}\nx = bytearray(600 * 2**20); print('allocated')", FAST)
    assert not out.ok and "MemoryError" in out.text and "allocated" not in out.text
    assert left_running(marker) == []


def test_sandbox_stops_a_fork_bomb():
    marker = f"rlpipe-forkbomb-{os.getpid()}"
    start = time.monotonic()
    out = run_python(f"# {marker}\nimport os\nwhile True:\n    os.fork()\n", FAST)
    assert not out.ok and "PermissionError: sandbox: starting processes (os.fork)" in out.text
    assert time.monotonic() - start < 10
    seconds = f"{300 + os.getpid() % 1000}.5"  # this test's own: another test process may sleep 300 meanwhile
    out = run_python(f"# {marker}\nimport subprocess\nsubprocess.run(['sleep', '{seconds}'])\n", FAST)
    assert not out.ok and "starting processes (import subprocess)" in out.text
    assert left_running(marker) == []
    assert subprocess.run(["pgrep", "-f", f"sleep {seconds}"], capture_output=True).stdout == b""


def test_sandbox_stops_writes_outside_its_temp_dir(tmp_path):
    target = tmp_path / "escaped.txt"
    attempts = {
        "open": f"open({str(target)!r}, 'w').write('x')",
        "pathlib": f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')",
        "os.open": f"import os; os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        "append": f"open({str(target)!r}, 'a').write('x')",
        "rename out": f"open('here', 'w').write('x'); import os; os.rename('here', {str(target)!r})",
        "symlink out": f"import os; os.symlink({str(tmp_path)!r}, 'link'); open('link/escaped.txt', 'w')",
        "relative": "import os; open(os.path.join('..', 'rlpipe-escaped.txt'), 'w')",
    }
    for name, code in attempts.items():
        out = run_python(code, FAST)
        assert not out.ok and "PermissionError: sandbox:" in out.text and "not allowed" in out.text, (name, out.text)
    assert list(tmp_path.iterdir()) == []  # nothing was written
    inside = run_python("import os; os.makedirs('a/b'); open('a/b/f', 'w').write('ok'); print(open('a/b/f').read())",
                        FAST)
    assert inside.ok and inside.text == "ok\n"  # the temp dir itself is writable
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    out = run_python(f"import os; os.remove({str(victim)!r})", FAST)
    assert not out.ok and "os.remove" in out.text and victim.read_text() == "keep"


def test_sandbox_refuses_sockets_even_without_a_network_namespace():
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    accepted, done = [], threading.Event()

    def serve():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not done.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    for code in (f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)",
                 f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)"):
        out = run_python(code, SandboxLimits(cpu_s=2, wall_s=6, isolate_network=False))
        assert not out.ok and "PermissionError: sandbox: network access" in out.text, out.text
    done.set()
    thread.join(5)
    server.close()
    assert accepted == []  # no connection reached the server


def test_sandbox_guard_cannot_be_stepped_around_by_ctypes():
    out = run_python("import ctypes; ctypes.CDLL(None).fork()", FAST)
    assert not out.ok and "calling foreign code" in out.text
    assert run_python("import numpy; print(int(numpy.arange(4).sum()))", SandboxLimits(memory_mb=512)).text == "6\n"


def test_sandbox_wall_limit_kills_forked_children():
    marker = f"rlpipe-sandbox-test-{os.getpid()}"
    code = ("import os, time\n"
            "for i in range(3):\n"
            "    if os.fork() == 0:\n"
            "        if i == 0: os.setsid()  # one child even leaves the process group\n"
            f"        os.execv({sys.executable!r}, ['python', '-c', 'import time; time.sleep(300)', '{marker}'])\n"
            "time.sleep(300)\n")
    start = time.monotonic()
    out = run_python(code, SandboxLimits(cpu_s=5, wall_s=1.5, allow_processes=True))  # forking allowed: see the kill
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
    assert not out.ok and "connected" not in out.text and "sandbox: network access" in out.text


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


def test_trigger_parser_lookup_tool_and_scorer():
    from rlpipe.agents.tools import lookup_value
    from rlpipe.stages.agent_tasks import lookup, lookup_answer, LookupParams

    parser = build_parser("trigger", "lookup")
    assert [c.call for c in parser.parse("9!", prompt="407?")] == [ToolCall("lookup", {"key": "407"})]
    assert parser.parse("407", prompt="407?") == []
    assert build_parser("trigger").parse("!", prompt="7*8=")[0].call == ToolCall("calculator", {"expression": "7*8"})
    tool = build_tool("lookup", {"secret": 3, "digits": 2})
    value = tool.run({"key": "407"}).text
    assert value == lookup_value("407", 3, 2) and len(value) == 2 and value != lookup_value("407", 4, 2)
    assert parser.observation([tool.run({"key": "407"})]) == f"={value}"
    assert not tool.run({"key": "4 7"}).ok
    # the dataset's answers are the tool's values; they are spread over all ten digits (nothing predicts them)
    table = lookup(LookupParams(size=500), seed=0)
    keys = [p[:-1] for p in table.column("prompt").to_pylist()]
    truths = table.column("ground_truth").to_pylist()
    assert truths == [lookup_value(k) for k in keys] and len(set(truths)) == 10
    # the answer is the character right after the lookup's observation "=<truth>"; no observation scores 0
    scores = lookup_answer(["!=77", "!=74", "7", "=38", "99!=7", "!=7;7", "!\nT:=7\nA:7"], ["7"] * 3 + ["3"] + ["7"] * 3)
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # the last: through the gateway's chat template


def test_openai_format_turns_parsed_calls_into_tool_calls_and_back():
    import json

    from rlpipe.agents.chat import ChatSession
    from rlpipe.agents.openai_format import FormatError, parse_messages, split_calls

    hermes = build_parser("hermes")
    text = 'sure <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    content, calls = split_calls(text, hermes, ["calculator"], "", "call_s_0")
    assert content == "sure" and [c["id"] for c in calls] == ["call_s_0_0"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "1+2"}
    assert split_calls(text, hermes, ["python"], "", "x") == (text, [])  # a tool the request did not list
    assert split_calls(text + "<tool_call>{bad</tool_call>", hermes, ["calculator"], "", "x")[1] == []
    # an assistant message sent back with the issued call id renders as the model's raw text
    session = ChatSession("s", tokenizer=None)
    session.remember_calls(calls, text)
    back = parse_messages({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "1+2?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{**calls[0]}]},
        {"role": "tool", "tool_call_id": "call_s_0_0", "content": "3"}]})
    assert session.canonical(back) == [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": text},
                                       {"role": "tool", "content": "3"}]
    foreign = parse_messages({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "mine", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]})
    assert session.canonical(foreign)[0]["content"] == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for bad, field in (({"messages": [{"role": "robot", "content": "x"}]}, "messages[0] needs a `role`"),
                       ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}]}, "tool_calls")):
        with pytest.raises(FormatError, match=re.escape(field)):
            parse_messages(bad)
