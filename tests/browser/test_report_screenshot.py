"""The run report (``report.html``, logged at the end of the shared inline run) in headless Chromium: the worker
timeline, the version-coloured tokens and the log-prob mismatch view are drawn — found in the DOM with non-empty
boxes, and their colours found at those boxes in a screenshot of the whole page.

Browser tier (``make ui-check``); the screenshot lands in $RLPIPE_SCREENSHOTS (default: a temporary folder).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image

from chromium import Chromium
from rlpipe.engine.tracking import runs

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report(inline_run, tmp_path_factory) -> Path:
    """The report the run logged at its end, downloaded from MLflow."""
    folder = tmp_path_factory.mktemp("report")
    return Path(runs.client(inline_run.tracking_uri).download_artifacts(inline_run.run_id, "report.html", str(folder)))


@pytest.fixture(scope="module")
def page(report, tmp_path_factory):
    """Chromium on the report; yields (browser, screenshot of the whole page)."""
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium: `make ui-check` installs it (apt-get install chromium)")
    browser = Chromium(CHROMIUM, width=1200, height=900)
    try:
        browser.open(report.as_uri())
        browser.wait_for("document.readyState === 'complete' && document.querySelector('#mismatch-scatter') !== null",
                         "the report to load", timeout=30)
        w, h = browser.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        shot = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                       "clip": {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}},
                            page=True)["data"]
        png = base64.b64decode(shot)
        folder = Path(os.environ.get("RLPIPE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.png").write_bytes(png)
        yield browser, Image.open(io.BytesIO(png)).convert("RGB")
    finally:
        browser.close()


def boxes(browser: Chromium, selector: str, colour: str) -> list[dict]:
    """Page-coordinate boxes of the elements ``selector`` finds, with their computed ``colour`` property."""
    return browser.evaluate(f"""Array.from(document.querySelectorAll({selector!r})).map(e => {{
        const r = e.getBoundingClientRect();
        return {{x: r.x + window.scrollX, y: r.y + window.scrollY, w: r.width, h: r.height,
                 colour: getComputedStyle(e)[{colour!r}], cls: e.getAttribute('class')}}; }})""")


def rgb(css: str) -> tuple[int, int, int]:
    """``rgb(r, g, b)`` → (r, g, b)."""
    return tuple(int(float(v)) for v in css[css.index("(") + 1: css.index(")")].split(",")[:3])


def pixels(img: Image.Image, box: dict, inset: int = 1) -> list[tuple[int, int, int]]:
    x0, y0 = int(box["x"]) + inset, int(box["y"]) + inset
    x1, y1 = max(x0 + 1, int(box["x"] + box["w"]) - inset), max(y0 + 1, int(box["y"] + box["h"]) - inset)
    return list(img.crop((x0, y0, x1, y1)).getdata())


def share(img: Image.Image, box: dict, colour: tuple[int, int, int], tol: int = 10) -> float:
    """The share of the box's pixels within ``tol`` of ``colour`` in every channel."""
    px = pixels(img, box)
    return sum(all(abs(a - b) <= tol for a, b in zip(p, colour)) for p in px) / len(px)


def test_the_timeline_is_drawn(page):
    browser, img = page
    bars = boxes(browser, "#timeline rect.bar", "fill")
    assert len(bars) == 3 * 7  # steps 1..3 (step 0, the warm-up, left out), the quickstart's seven nodes
    assert all(b["w"] >= 1 and b["h"] > 10 for b in bars)
    lanes = browser.evaluate("Array.from(document.querySelectorAll('#timeline text.worker')).map(t => t.textContent)")
    assert {"rollout×1", "task", "actor×1", "driver"} <= set(lanes)
    widest: dict[str, dict] = {}
    for b in bars:  # per node colour, its widest bar: painted in that colour in the screenshot
        if b["w"] > widest.get(b["colour"], {"w": 0})["w"]:
            widest[b["colour"]] = b
    assert len(widest) == 7
    wide = {colour: b for colour, b in widest.items() if b["w"] >= 4}  # a 1-px bar is mostly antialiased edge
    assert len(wide) >= 4
    for colour, b in wide.items():
        assert share(img, b, rgb(colour)) > 0.6, (colour, b)


def test_tokens_are_coloured_by_policy_version(page):
    browser, img = page
    tokens = boxes(browser, ".tokens .tok", "backgroundColor")
    assert len(tokens) >= 16 and all(t["w"] > 0 and t["h"] > 0 for t in tokens)
    by_class: dict[str, dict] = {}
    for t in tokens:
        by_class.setdefault(t["cls"].split()[1], t)
    assert set(by_class) == {"ver-0", "ver-1", "ver-2", "ver-3"}  # the run's steps 0..3 pushed versions 0..3
    colours = {rgb(t["colour"]) for t in by_class.values()}
    assert len(colours) == 4  # four versions, four backgrounds
    for cls, t in by_class.items():  # the background is on screen behind the glyph
        assert share(img, t, rgb(t["colour"]), tol=6) > 0.3, cls
    legend = browser.evaluate("Array.from(document.querySelectorAll('.legend .swatch')).map(s => s.textContent)")
    assert legend[:4] == ["v0", "v1", "v2", "v3"]


def test_the_mismatch_view_is_drawn(page):
    browser, img = page
    (scatter,) = boxes(browser, "#mismatch-scatter", "fill")
    assert scatter["w"] >= 300 and scatter["h"] >= 300
    points = boxes(browser, "#mismatch-scatter circle.mm-point", "fill")
    assert len(points) >= 16 and all(p["w"] > 0 for p in points)
    inside = [p for p in points if scatter["x"] <= p["x"] and p["x"] + p["w"] <= scatter["x"] + scatter["w"]
              and scatter["y"] <= p["y"] and p["y"] + p["h"] <= scatter["y"] + scatter["h"]]
    assert len(inside) == len(points)
    red = sum(r - g > 50 and r - b > 50 for r, g, b in pixels(img, scatter))  # the points' red over white
    assert red >= 30
    assert "tokens compared" in browser.text()
