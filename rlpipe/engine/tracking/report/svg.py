"""The report's plots as inline SVG, built as strings: a worker timeline, line charts, a scatter.

Plain SVG rather than matplotlib figures: each mark is an element with a class and a ``<title>`` (a tooltip in
the browser, a handle for the browser test), the file stays small and opens offline, and drawing costs
milliseconds where a matplotlib figure costs ~0.2 s of the tracking process's CPU (figures.py).
"""

from __future__ import annotations

import math
from html import escape

from rlpipe.engine.tracking.report.data import Mismatch, Series, Timeline

NODE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
                "#bab0ac")
"""Node colours on the timeline, in the order nodes first ran (Tableau 10)."""
SERIES_COLOURS = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b")
"""Line colours of a chart's series, in order."""


def fmt_s(seconds: float) -> str:
    """A duration, in ms below a second."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _num(x: float) -> str:
    return f"{x:.4g}"


def ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def timeline_svg(tl: Timeline, width: int = 1100) -> str:
    """One row per worker, a bar per node execution coloured by node, a line where each step starts."""
    label_w, row_h, top, legend_h = 130, 26, 22, 28
    plot_w = width - label_w - 40  # room for the last tick label
    height = top + row_h * len(tl.workers) + 24 + legend_h
    colour = {n: NODE_COLOURS[i % len(NODE_COLOURS)] for i, n in enumerate(tl.nodes)}
    scale = plot_w / tl.span_s if tl.span_s > 0 else 0.0
    out = [f'<svg id="timeline" class="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="worker timeline">']
    for i, worker in enumerate(tl.workers):
        y = top + i * row_h
        out.append(f'<rect class="lane" x="{label_w}" y="{y}" width="{plot_w}" height="{row_h}" '
                   f'fill="{"#f6f6f6" if i % 2 else "#ffffff"}"/>')
        # a long name ('task in rollout×1@…') is cut to fit the label column, whole in its tooltip
        label = escape(worker) if len(worker) <= 20 else f"<title>{escape(worker)}</title>{escape(worker[:19])}…"
        out.append(f'<text class="worker" x="{label_w - 6}" y="{y + row_h / 2 + 4}" text-anchor="end">{label}</text>')
    lanes_bottom = top + row_h * len(tl.workers)
    for step, start in tl.step_starts:
        x = label_w + start * scale
        out.append(f'<line class="step-line" x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{lanes_bottom}" '
                   'stroke="#999" stroke-dasharray="3,3"/>')
        out.append(f'<text class="step-label" x="{x + 2:.1f}" y="{top - 8}">step {step}</text>')
    row = {w: i for i, w in enumerate(tl.workers)}
    for b in tl.bars:
        y = top + row[b.worker] * row_h + 3
        x, w = label_w + b.start_s * scale, max(b.duration_s * scale, 1.0)
        stroke = ' stroke="#c00" stroke-width="2"' if b.error else ""
        out.append(f'<rect class="bar" data-node="{escape(b.node)}" data-step="{b.step}" x="{x:.2f}" y="{y}" '
                   f'width="{w:.2f}" height="{row_h - 6}" fill="{colour[b.node]}"{stroke}><title>{escape(b.node)}, '
                   f'step {b.step}, {escape(b.worker)}: {fmt_s(b.duration_s)}'
                   f'{" (error)" if b.error else ""}</title></rect>')
    axis_y = lanes_bottom + 16
    for t in ticks(0.0, tl.span_s, 6):
        out.append(f'<text class="tick" x="{label_w + t * scale:.1f}" y="{axis_y}" text-anchor="middle">'
                   f'{fmt_s(t) if t else "0"}</text>')
    x = label_w
    for n in tl.nodes:
        out.append(f'<rect x="{x}" y="{axis_y + 10}" width="12" height="12" fill="{colour[n]}"/>'
                   f'<text class="legend" x="{x + 16}" y="{axis_y + 20}">{escape(n)}</text>')
        x += 24 + 7 * len(n)
    out.append("</svg>")
    return "".join(out)


def line_chart_svg(chart_id: str, title: str, curves: list[Series], width: int = 360, height: int = 220) -> str:
    """Step on x, the curves' values on y (a shared axis), a dot per point when there are few."""
    left, right, top, bottom = 52, 12, 26 + 14 * (len(curves) > 1), 34
    pts = [p for c in curves for p in c.points]
    out = [f'<svg id="{chart_id}" class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f'<text class="chart-title" x="{left}" y="16">{escape(title)}</text>']
    if not pts:
        out.append(f'<text class="empty" x="{width / 2}" y="{height / 2}" text-anchor="middle">not recorded</text>'
                   "</svg>")
        return "".join(out)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(min(ys), 0.0), max(ys)
    if y1 <= y0:
        y1 = y0 + 1.0
    y1 += (y1 - y0) * 0.05
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (pw * (x - x0) / (x1 - x0) if x1 > x0 else pw / 2)

    def py(y: float) -> float:
        return top + ph * (1 - (y - y0) / (y1 - y0))

    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>')
    for t in ticks(y0, y1, 4):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>'
                   f'<text class="tick" x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{_num(t)}</text>')
    for t in ticks(x0, x1, 5):
        if float(t).is_integer():
            out.append(f'<text class="tick" x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<text class="tick" x="{left + pw / 2}" y="{height - 4}" text-anchor="middle">step</text>')
    for i, c in enumerate(curves):
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in c.points)
        dash = ' stroke-dasharray="6,3"' if i else ""  # a later curve over an equal earlier one stays visible
        out.append(f'<polyline class="line" data-series="{escape(c.name)}" points="{coords}" fill="none" '
                   f'stroke="{colour}" stroke-width="2"{dash}/>')
        if len(c.points) <= 60:
            for x, y in c.points:
                out.append(f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}">'
                           f'<title>{escape(c.name)}, step {x}: {_num(y)}</title></circle>')
    if len(curves) > 1:  # a legend line under the title; a later curve is drawn over an equal earlier one
        out.append(f'<text class="legend" x="{left}" y="30">' + " ".join(
            f'<tspan fill="{SERIES_COLOURS[i % len(SERIES_COLOURS)]}">━ {escape(c.name)}</tspan>'
            for i, c in enumerate(curves)) + "</text>")
    out.append("</svg>")
    return "".join(out)


def scatter_svg(m: Mismatch, width: int = 380, height: int = 380) -> str:
    """Engine log-prob (x) against the trainer's (y) per token, the diagonal where they agree."""
    left, right, top, bottom = 52, 12, 26, 40
    pw, ph = width - left - right, height - top - bottom
    vals = [v for p in m.points for v in p]
    lo, hi = (min(vals), max(vals)) if vals else (-1.0, 0.0)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    pad = (hi - lo) * 0.04
    lo, hi = lo - pad, hi + pad

    def px(v: float) -> float:
        return left + pw * (v - lo) / (hi - lo)

    def py(v: float) -> float:
        return top + ph * (1 - (v - lo) / (hi - lo))

    out = [f'<svg id="mismatch-scatter" class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="log-prob mismatch">',
           f'<text class="chart-title" x="{left}" y="16">per-token log-prob: engine vs trainer</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for t in ticks(lo, hi, 4):
        out.append(f'<text class="tick" x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{_num(t)}</text>'
                   f'<text class="tick" x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="middle">{_num(t)}</text>')
    out.append(f'<line class="diagonal" x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" '
               'stroke="#999" stroke-dasharray="4,3"/>')
    for e, t in m.points:
        out.append(f'<circle class="mm-point" cx="{px(e):.1f}" cy="{py(t):.1f}" r="3" fill="#e15759" '
                   f'fill-opacity="0.6"><title>engine {e:.4f}, trainer {t:.4f}, Δ {t - e:+.2e}</title></circle>')
    out.append(f'<text class="tick" x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">engine log-prob '
               '(rollout_logprobs)</text>')
    out.append(f'<text class="tick" transform="translate(12,{top + ph / 2}) rotate(-90)" text-anchor="middle">'
               'trainer log-prob (old_logprobs)</text>')
    out.append("</svg>")
    return "".join(out)
