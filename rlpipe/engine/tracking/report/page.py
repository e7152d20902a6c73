"""The run report as one self-contained HTML page: inline CSS and SVG, no script, no external file.

Sections: the run, the worker timeline, reward / response length / staleness per step, the sampled
trajectories with each token coloured by the policy version that produced it (masked spans marked), the
per-token log-prob mismatch between the rollout engine and the trainer, and ``rlpipe simulate``'s prediction
beside what the run measured.
"""

from __future__ import annotations

import time
from html import escape

from rlpipe.engine.tracking.report import svg
from rlpipe.engine.tracking.report.data import ReportData, SampledTrajectory, Token, version_class

VERSION_COLOURS = ("#9ecae9", "#ffbe7d", "#8cd17d", "#ff9d9a", "#86bcb6", "#f1ce63", "#d4a6c8", "#fabfd2")
"""Token backgrounds of ``ver-0`` .. ``ver-7`` (the sample's versions in order)."""

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1160px; }
h1 { font-size: 22px; margin: 0 0 8px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
table.meta td, table.fig td, table.fig th { padding: 2px 10px 2px 0; text-align: left; }
table.fig td.num { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #666; font-size: 13px; } .charts { display: flex; flex-wrap: wrap; gap: 12px; }
svg text { font: 11px system-ui, sans-serif; fill: #333; } svg .chart-title { font-weight: 600; font-size: 12px; }
.traj { margin: 6px 0 10px; } .traj .head { font-size: 12px; color: #444; }
.tokens { font: 13px/2 ui-monospace, monospace; }
.tok { white-space: pre; padding: 2px 1px; margin: 0 1px; border-radius: 2px; }
.masked-span { outline: 2px dashed #555; outline-offset: 1px; }
.masked-span .tok { background-image: repeating-linear-gradient(45deg, transparent 0 3px, #fff8 3px 6px); color: #555; }
.swatch { display: inline-block; padding: 0 6px; margin-right: 6px; border-radius: 2px; font-size: 12px; }
.mismatch { display: flex; gap: 24px; align-items: flex-start; } .mismatch svg { flex: none; }
""" + "".join(f".ver-{i} {{ background: {c}; }}\n" for i, c in enumerate(VERSION_COLOURS)) + \
    ".ver-none { background: #e0e0e0; }\n"


def render(report: ReportData) -> str:
    """The whole page."""
    title = f"rlpipe run report: {report.run_name or report.run_id}"
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{escape(title)}</h1>", _meta(report),
             _timeline(report), _curves(report), _trajectories(report), _mismatch(report), _prediction(report)]
    if report.notes:
        parts.append("<h2>Notes</h2><ul class=\"notes\">" + "".join(f"<li>{escape(n)}</li>" for n in report.notes)
                     + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _meta(r: ReportData) -> str:
    rows = [("run id", r.run_id), ("status", r.status), ("mode", r.mode or "-"), ("steps recorded", str(r.steps)),
            ("report written", time.strftime("%Y-%m-%d %H:%M:%S %Z"))]
    return "<table class=\"meta\">" + "".join(f"<tr><td>{k}</td><td><b>{escape(v)}</b></td></tr>" for k, v in rows) \
        + "</table>"


def _timeline(r: ReportData) -> str:
    tl = r.timeline
    head = "<h2 id=\"timeline-section\">Worker timeline</h2>"
    if not tl.bars:
        return head + f"<p class=\"note\">{escape(tl.note or 'nothing recorded')}</p>"
    note = "one row per worker, one bar per node execution (hover for node, step, duration)"
    if tl.note:
        note += f"; {tl.note}"
    return head + f"<p class=\"note\">{escape(note)}</p>" + svg.timeline_svg(tl)


def _curves(r: ReportData) -> str:
    by_name = {s.name: s for s in r.series}
    stale = [s for name, s in by_name.items() if name.startswith("staleness")]
    charts = [svg.line_chart_svg("reward-chart", "reward/mean", [by_name["reward/mean"]] if "reward/mean" in by_name
                                 else []),
              svg.line_chart_svg("length-chart", "response length (tokens, mean)",
                                 [s for n, s in by_name.items() if n.startswith("response length")]),
              svg.line_chart_svg("staleness-chart", "staleness (consuming − prompt step + 1)", stale)]
    return "<h2>Over the steps</h2><div class=\"charts\">" + "".join(charts) + "</div>"


def _token(tok: Token, versions: list[int]) -> str:
    tip = [f"v{tok.version}" if tok.version is not None else "version not stamped"]
    if tok.masked:
        tip.append("masked (not trained on)")
    if tok.engine_logprob is not None:
        tip.append(f"engine {tok.engine_logprob:.4f}")
    if tok.trainer_logprob is not None:
        tip.append(f"trainer {tok.trainer_logprob:.4f}")
    if tok.engine_logprob is not None and tok.trainer_logprob is not None and not tok.masked:
        tip.append(f"Δ {tok.trainer_logprob - tok.engine_logprob:+.2e}")
    text = tok.text.replace("\n", "↵\n") or "∅"
    version = "" if tok.version is None else f' data-version="{tok.version}"'
    return (f'<span class="tok {version_class(tok.version, versions)}"{version} title="{escape(" · ".join(tip))}">'
            f"{escape(text)}</span>")


def _tokens(t: SampledTrajectory, versions: list[int]) -> str:
    """The tokens, each run of masked ones wrapped in one marked span."""
    out, run = [], []
    for tok in t.tokens:
        if tok.masked:
            run.append(_token(tok, versions))
            continue
        if run:
            out.append('<span class="masked-span" title="masked: not trained on">' + "".join(run) + "</span>")
            run = []
        out.append(_token(tok, versions))
    if run:
        out.append('<span class="masked-span" title="masked: not trained on">' + "".join(run) + "</span>")
    if t.tokens_left_out:
        out.append(f' <span class="note">… {t.tokens_left_out} more tokens</span>')
    return "".join(out)


def _trajectories(r: ReportData) -> str:
    head = "<h2 id=\"trajectories-section\">Sampled trajectories</h2>"
    if not r.trajectories:
        return head + "<p class=\"note\">no sampled trajectories in this run</p>"
    legend = "".join(f'<span class="swatch {version_class(v, r.versions)}">v{v}</span>' for v in r.versions)
    legend += '<span class="swatch masked-span">masked</span>'
    items = []
    for t in r.trajectories:
        reward = "-" if t.reward is None else f"{t.reward:.3f}"
        sample = "" if t.sample_index is None else f" #{t.sample_index}"
        items.append(f'<div class="traj"><div class="head">step {t.step} · {escape(t.uid)}{sample} · reward {reward}'
                     f' · {escape(t.status or "-")} · prompt <code>{escape(t.prompt)}</code></div>'
                     f'<div class="tokens">{_tokens(t, versions=r.versions)}</div></div>')
    return (head + f"<p class=\"note\">{len(r.trajectories)} trajectories; each response token coloured by the "
            "policy version that produced it (hover for its log-probs)</p>"
            f"<p class=\"legend\">{legend}</p>" + "".join(items))


def _mismatch(r: ReportData) -> str:
    head = "<h2 id=\"mismatch-section\">Log-prob mismatch: rollout engine vs trainer</h2>"
    m = r.mismatch
    if m is None:
        return head + "<p class=\"note\">not recorded: the sampled trajectories lack rollout_logprobs or " \
                      "old_logprobs</p>"
    rows = [("tokens compared (trained-on, both recorded)", f"{m.tokens:,}"), ("mean |Δ|", f"{m.mean_abs:.3e}"),
            ("max |Δ|", f"{m.max_abs:.3e}"), ("mean Δ (trainer − engine)", f"{m.mean:+.3e}")]
    table = "<table class=\"fig\">" + "".join(f"<tr><td>{k}</td><td class=\"num\">{v}</td></tr>" for k, v in rows) \
        + "</table>"
    return head + f"<div class=\"mismatch\">{svg.scatter_svg(m)}<div>{table}<p class=\"note\">Δ = old_logprobs − " \
                  "rollout_logprobs per token of the sampled trajectories. Off the diagonal: the engine sampled " \
                  "from a different distribution than the trainer scores (precision, kernels, a stale weight " \
                  "push), what rollout correction weighs.</p></div></div>"


def _prediction(r: ReportData) -> str:
    head = "<h2 id=\"prediction-section\">Predicted by rlpipe simulate, beside what was measured</h2>"
    p = r.prediction
    if p is None:
        return head + f"<p class=\"note\">not in this report: <code>rlpipe report {escape(r.run_id[:8])}</code> " \
                      "adds it (rlpipe simulate on the run's own config)</p>"
    rows = "".join(f"<tr><td>{escape(row.figure)}</td><td class=\"num\">{escape(row.predicted)}</td>"
                   f"<td class=\"num\">{escape(row.recorded)}</td></tr>" for row in p.rows)
    notes = "".join(f"<li>{escape(n)}</li>" for n in p.notes)
    return (head + f"<p class=\"note\">{escape(p.title)}</p><table class=\"fig\" id=\"prediction\"><tr><th>figure"
            f"</th><th>predicted</th><th>recorded run</th></tr>{rows}</table><p>verdict: <b>{escape(p.verdict)}</b>"
            f"</p><ul class=\"note\">{notes}</ul>")
