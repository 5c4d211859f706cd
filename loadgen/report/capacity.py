"""The capacity report section: ``capacity.html`` next to ``capacity.json`` (self-contained, plotly inlined).

Per server configuration: for each SLO, its percentile at every probe against load (with the percentile's
order-statistic interval), the SLO line, the feasible region shaded up to the capacity, the capacity and the
knee marked, every probe labelled with the order it ran in; then the search path (load per probe in run
order) and the probe table.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from loadgen.defaults import CAPACITY_FILE
from loadgen.metrics import definitions as metrics
from loadgen.metrics.slo import metric_of
from loadgen.report.builder import jsonable, plotly_js

_COLOURS = {"pass": "#2ca02c", "fail": "#d62728"}


def slo_figure(entry: dict[str, Any], key: str) -> dict[str, Any]:
    probes = [p for p in entry["probes"] if p["phase"] == "search"]
    unit = "concurrency" if entry["mode"] == "concurrency" else "rate (req/s)"
    m = metric_of(key)
    ms = m.scale
    traces: list[dict[str, Any]] = []
    limit = None
    for verdict in ("pass", "fail"):
        xs, ys, lo, hi, text = [], [], [], [], []
        for p in probes:
            c = next(c for c in p["checks"] if c["key"] == key)
            limit = c["limit"]
            if p["verdict"] != verdict:
                continue
            v = c["value"]
            xs.append(p["load"])
            ys.append(None if v is None else v * ms)
            lo.append(None if v is None or c["value_lo"] is None else (v - c["value_lo"]) * ms)
            hi.append(None if v is None or c["value_hi"] is None else (c["value_hi"] - v) * ms)
            text.append(f"#{p['index']}" + ("" if p["confident"] else "?"))
        if xs and any(y is not None for y in ys):
            traces.append({
                "type": "scatter", "mode": "markers+text", "name": f"{verdict}", "x": xs, "y": ys, "text": text,
                "textposition": "top center", "marker": {"color": _COLOURS[verdict], "size": 10},
                "error_y": {"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
            })  # fmt: skip
    loads = [p["load"] for p in probes] or [0.0, 1.0]
    if limit is not None:
        traces.append({"type": "scatter", "mode": "lines", "name": f"SLO {key}", "x": [0, max(loads) * 1.05],
                       "y": [limit * ms] * 2, "line": {"dash": "dash", "color": "#555"}})  # fmt: skip
    shapes, notes = [], []
    cap, hi_fail = entry.get("capacity"), (entry.get("interval") or [None, None])[1]
    if cap is not None:
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": 0, "x1": cap, "y0": 0, "y1": 1,
                       "fillcolor": "rgba(44,160,44,0.10)", "line": {"width": 0}, "layer": "below"})  # fmt: skip
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": cap, "x1": cap, "y0": 0, "y1": 1,
                       "line": {"color": "#2ca02c", "width": 2}})  # fmt: skip
        notes.append({"x": cap, "y": 1, "xref": "x", "yref": "paper", "text": f"capacity {cap:.3g}",
                      "showarrow": False, "yanchor": "bottom"})  # fmt: skip
    if hi_fail is not None:
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": hi_fail, "x1": hi_fail, "y0": 0, "y1": 1,
                       "line": {"color": "#d62728", "width": 1, "dash": "dot"}})  # fmt: skip
    if entry.get("knee") is not None:
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": entry["knee"], "x1": entry["knee"],
                       "y0": 0, "y1": 1, "line": {"color": "#ff7f0e", "width": 1, "dash": "dash"}})  # fmt: skip
        notes.append({"x": entry["knee"], "y": 0.92, "xref": "x", "yref": "paper", "text": "knee",
                      "showarrow": False})  # fmt: skip
    yname = f"{key} ({m.shown or m.unit_words})"
    return {"data": traces, "layout": {
        "title": {"text": f"{key} against load (the shaded region meets every SLO)"},
        "xaxis": {"title": {"text": unit}, "rangemode": "tozero"}, "yaxis": {"title": {"text": yname}, "rangemode": "tozero"},
        "shapes": shapes, "annotations": notes, "height": 420, "margin": {"t": 60},
    }}  # fmt: skip


def path_figure(entry: dict[str, Any]) -> dict[str, Any]:
    probes = entry["probes"]
    traces = []
    for phase in ("pilot", "search"):
        ps = [p for p in probes if p["phase"] == phase]
        if ps:
            traces.append({
                "type": "scatter", "mode": "lines+markers", "name": phase + (" (closed loop)" if phase == "pilot" else ""),
                "x": [p["index"] for p in ps], "y": [p["load"] for p in ps],
                "marker": {"color": [_COLOURS[p["verdict"]] for p in ps], "size": 9},
                "text": [f"{p['verdict']}{'' if p['confident'] else '?'} {p['seconds']:.1f}s" for p in ps],
            })  # fmt: skip
    return {"data": traces, "layout": {
        "title": {"text": "search path: load of each probe in the order it ran (green pass, red fail)"},
        "xaxis": {"title": {"text": "probe #"}}, "yaxis": {"title": {"text": "load"}}, "height": 320,
    }}  # fmt: skip


def _probe_rows(entry: dict[str, Any]) -> str:
    keys = [c["key"] for c in entry["probes"][0]["checks"]] if entry["probes"] else []
    head = "".join(f"<th>{h}</th>" for h in ["#", "phase", "load", "requests", "errors", *keys, "verdict", "seconds"])
    rows = []
    for p in entry["probes"]:
        cells = [str(p["index"]), p["phase"], f"{p['load']:.4g}", str(p["requests"]), str(p["errors"])]
        for c in p["checks"]:
            if (m := metric_of(c["key"])) is metrics.ERROR_RATE:
                cells.append(f"{c['misses']}/{c['n']}")
            else:
                cells.append(f"{_shown(m, c['value'])} [{_shown(m, c['value_lo'])}, {_shown(m, c['value_hi'])}]")
        cells += [html.escape(f"{p['verdict']}{'' if p['confident'] else '?'} ({p['reason']})"), f"{p['seconds']:.1f}"]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _shown(m: metrics.Metric, v: float | None) -> str:
    return "∞" if v is None else f"{v * m.scale:.1f}"


def write_report(out: Path) -> Path:
    """``out/capacity.html`` from ``out/capacity.json``; returns its path."""
    doc = json.loads((out / CAPACITY_FILE).read_text())
    figs: dict[str, Any] = {}
    parts = []
    for i, e in enumerate(c for c in doc["configs"] if "status" in c):
        # the SLO charts plot the search probes against load; a search stopped before its first one (budget,
        # interruption) has only the pilot's, which the search path shows
        searched = any(p["phase"] == "search" for p in e["probes"])
        keys = [c["key"] for c in e["probes"][0]["checks"]] if searched else []
        for key in keys:
            figs[f"c{i}-{key}"] = slo_figure(e, key)
        if e["probes"]:
            figs[f"c{i}-path"] = path_figure(e)
        charts = "".join(f'<div class="chart" data-fig="{html.escape(k)}"></div>' for k in figs if k.startswith(f"c{i}-"))
        lo, hi = e["interval"]
        parts.append(
            f"<h2>{html.escape(e['point_id'])} {html.escape(json.dumps(e['labels']) if e.get('labels') else '')}</h2>"
            f"<p><b>{html.escape(e['message'])}</b><br>interval [{lo}, {hi}] ({e['mode']}), SLOs "
            f"{html.escape(', '.join(e['slos']))}; each verdict at {e['confidence']:.0%} confidence (? = undecided at "
            f"its cap, judged on the point estimate); goodput at capacity {_num(e['goodput'])} req/s; "
            f"{e['probe_seconds']:.0f} of {e['budget_s']:.0f} probe-seconds"
            f"{'' if searched else '; no search probe ran, so no SLO chart'}</p>{charts}{_probe_rows(e)}"
        )  # fmt: skip
    failed = [c for c in doc["configs"] if "failed" in c]
    for c in failed:
        parts.append(f"<h2>{html.escape(c['point_id'])}</h2><p>failed: {html.escape(c['failed']['message'])}</p>")
    data = json.dumps(jsonable(figs)).replace("</", "<\\/")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>servelab capacity</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1300px}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}.chart{{margin:1em 0}}</style>
<script>{plotly_js()}</script></head><body><h1>Capacity under SLOs</h1>{"".join(parts)}
<script id="figs" type="application/json">{data}</script>
<script>
const FIGS = JSON.parse(document.getElementById('figs').textContent);
Promise.all(Array.from(document.querySelectorAll('div.chart[data-fig]')).map(
  div => Plotly.newPlot(div, FIGS[div.dataset.fig].data, FIGS[div.dataset.fig].layout, {{responsive: true}})
)).then(() => performance.mark('charts-drawn'));
</script></body></html>"""
    path = out / "capacity.html"
    path.write_text(page)
    return path
