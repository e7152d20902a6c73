"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

A page that needs a click before it shows what matters (the trace view's execution
timeline is a toggle, not a URL) cannot be checked with ``chromium --screenshot``. The
pipe protocol needs no driver binary and no websocket library: Chromium reads JSON
commands, each ended by a NUL byte, on its fd 3 and writes replies and events on its fd 4.
Just enough of it for the UI check: open a page, wait for a condition, click, screenshot,
read the page's text.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


class BrowserError(RuntimeError):
    """Chromium died, answered with an error, or a condition was not met in time."""


class Chromium:
    """One headless Chromium with one page (a session attached to it)."""

    def __init__(self, binary: str, width: int = 1600, height: int = 1000):
        self._profile = tempfile.mkdtemp(prefix="rlpipe-chromium-")
        to_chrome, self._out = os.pipe()  # our commands → its fd 3
        self._in, from_chrome = os.pipe()  # its fd 4 → replies and events
        # fds ≥ 10 in the child, so that moving them to 3 and 4 cannot overwrite one another
        child_fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome, from_chrome)]
        for fd in (to_chrome, from_chrome):
            os.close(fd)
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                f"--window-size={width},{height}", f"--user-data-dir={self._profile}", "--remote-debugging-pipe",
                "about:blank"]
        # bash moves the pipe ends to fds 3 and 4, then becomes Chromium (no preexec_fn in a threaded process)
        self.proc = subprocess.Popen(
            ["bash", "-c", 'exec 3<&"$1" 4>&"$2"; shift 2; exec "$@"', "bash", *map(str, child_fds), *args],
            pass_fds=child_fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        for fd in child_fds:
            os.close(fd)
        self._next_id = 0
        self._buffer = b""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, page=True)
        self.send("Page.enable", page=True)

    # -- protocol ---------------------------------------------------------------------------------

    def send(self, method: str, params: dict | None = None, page: bool = False, timeout: float = 60.0) -> dict:
        """Send one command (to the page's session when ``page``) and wait for its reply's result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if page:
            message["sessionId"] = self._session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") != self._next_id:
                continue  # an event, or the reply to an earlier command that timed out
            if "error" in reply:
                raise BrowserError(f"{method}: {reply['error']}")
            return reply.get("result", {})

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserError("Chromium did not answer in time")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited (code {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    # -- page ---------------------------------------------------------------------------------------

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                           page=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, page=True)

    def wait_for(self, expression: str, what: str, timeout: float = 90.0) -> None:
        """Poll ``expression`` until it is truthy (the UI renders asynchronously, slowly on a busy machine)."""
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {timeout:.0f} s for {what}; the page says: {self.text()[:600]!r}")
            time.sleep(0.5)

    def click_at(self, x: float, y: float) -> None:
        """A person's click at page coordinates (press and release, as the mouse sends them)."""
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent",
                      {"type": kind, "x": x, "y": y, "button": "left" if kind != "mouseMoved" else "none",
                       "clickCount": 1}, page=True)

    def text(self) -> str:
        """The page's visible text, whitespace collapsed."""
        return " ".join((self.evaluate("document.body ? document.body.innerText : ''") or "").split())

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"}, page=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=20)
        os.close(self._out)
        os.close(self._in)
        shutil.rmtree(self._profile, ignore_errors=True)
