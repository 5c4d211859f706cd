"""The sweep chart: throughput vs load, p50/p99 latency vs throughput (knee marked), goodput vs load, a line
per run and curve; and the rows it draws from (one per point, with the summary key each value came from)."""

from __future__ import annotations

import re
from typing import Any

from loadgen.metrics.definitions import E2E, GOODPUT, INPUTS_S, OUTPUT_TOK_S, TTFT
from loadgen.records.results import leaves
from loadgen.report import series
from loadgen.report.load import RunData
from loadgen.report.plot import PALETTE, Fig, axis, subplots


def _find(flat: dict[str, Any], patterns: tuple[str, ...]) -> tuple[str, float] | None:
    """First key (by pattern order) whose full dotted name matches, with a numeric value."""
    for pat in patterns:
        rx = re.compile(pat)
        for k, v in flat.items():
            if rx.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
                return k, float(v)
    return None


def _key(path: tuple[str, ...]) -> str:
    return ".".join(path)


# PointSummary keys (loadgen.metrics.pointsummary.summarize / loadgen.dispatch.engine.run_point), most specific first.
LOAD_KEYS = (r"load\.concurrency", r"load\.rate", r"load\.speedup")
# a pooling run's (embeddings, rerank) inputs/s first: only its points have it, and their output tok/s is 0
THROUGHPUT_KEYS = tuple(re.escape(_key(p)) for m in (INPUTS_S, OUTPUT_TOK_S) for p in (m.path, m.whole()))
GOODPUT_KEYS = tuple(re.escape(_key(p)) for p in (GOODPUT.path, GOODPUT.whole()))
LATENCY_KEYS = {q: tuple(re.escape(_key((*m.path, q))) for m in (E2E, TTFT)) for q in ("p50", "p99")}


# The one place a summary key gets its axis title (words and unit: the registry's); latencies are seconds in
# summary.json.
AXIS_TITLES = {
    "load.concurrency": "concurrency (requests in flight)",
    "load.rate": "offered load (requests/s)",
    "load.speedup": "trace replay speed-up (x)",
    **{_key(m.path): m.title("steady state") for m in (INPUTS_S, OUTPUT_TOK_S, GOODPUT)},
    **{_key(m.whole()): m.title("whole point") for m in (INPUTS_S, OUTPUT_TOK_S, GOODPUT)},
    **{_key(m.path): m.title() for m in (E2E, TTFT)},
}
LINE_STYLES = "solid line: p50 · dashed line: p99"


def axis_title(key: str | None) -> str:
    """Words with a unit for a summary key; several keys on one axis (mixed load kinds) joined by " / "."""
    if not key:
        return ""
    return " / ".join(AXIS_TITLES.get(k, k.replace("_", " ").replace(".", " ")) for k in key.split(" / "))


def sweep_rows(run: RunData) -> list[dict[str, Any]]:
    """Per point: load, throughput, goodput, p50/p99 latency, with the summary key each came from."""
    rows = []
    for p in run.summary.get("points") or []:
        flat = leaves(p)
        row: dict[str, Any] = {"point_id": str(p.get("point_id", p.get("id", "")))}
        for name, pats in (
            ("load", LOAD_KEYS),
            ("throughput", THROUGHPUT_KEYS),
            ("goodput", GOODPUT_KEYS),
            ("p50", LATENCY_KEYS["p50"]),
            ("p99", LATENCY_KEYS["p99"]),
        ):
            hit = _find(flat, pats)
            row[name], row[name + "_key"] = (hit[1], hit[0]) if hit else (None, None)
        # one curve per workload, server grid point, load kind and trial
        parts = [
            (p.get("workload") or {}).get("name"),
            *(f"{k}={v}" for k, v in (p.get("labels") or {}).items()),
        ]
        parts += [(row["load_key"] or "").rsplit(".", 1)[-1], f"t{p['trial']}" if p.get("trial") else None]
        row["curve"] = tuple(str(x) for x in parts if x)
        rows.append(row)
    return rows


def _curves(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Rows split into curves, each named by what distinguishes it from the others ("" when alone)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for x in rows:
        groups.setdefault(x["curve"], []).append(x)
    keys = list(groups)
    varying = [
        i
        for i in range(max(map(len, keys), default=0))
        if len({k[i] if i < len(k) else "" for k in keys}) > 1
    ]
    return [
        (" ".join(k[i] for i in varying if i < len(k)), sorted(g, key=lambda x: x["load"]))
        for k, g in groups.items()
    ]


def sweep(runs: list[RunData]) -> Fig | None:
    """Throughput vs load, p50/p99 latency vs throughput (knee marked), goodput vs load; a line per run."""
    data: list[dict[str, Any]] = []
    labels: dict[str, str] = {}
    curves: list[tuple[RunData, str, list[dict[str, Any]]]] = []
    for run in runs:
        all_rows = [x for x in sweep_rows(run) if x["load"] is not None]
        if len(runs) > 1 or len(all_rows) >= 2:
            curves += [(run, curve, rows) for curve, rows in _curves(all_rows)]
    labels["load"] = " / ".join(sorted({rows[0]["load_key"] for _, _, rows in curves}))  # mixed kinds share x
    for n, (run, curve, rows) in enumerate(curves):
        color = PALETTE[n % len(PALETTE)]
        name = f"{run.run_id} {curve}".strip()
        load = [x["load"] for x in rows]
        text = [x["point_id"] for x in rows]
        common = {"type": "scatter", "mode": "lines+markers", "legendgroup": name, "text": text}
        for key, ax in (("throughput", ""), ("goodput", "3")):  # vs load; the legend on the first panel
            if any(x[key] is not None for x in rows):
                labels.setdefault(key, rows[0][f"{key}_key"] or key)
                data.append({**common, "x": load, "y": [x[key] for x in rows], "name": name, "xaxis": f"x{ax}",
                             "yaxis": f"y{ax}", "showlegend": key == "throughput", "line": {"color": color}})  # fmt: skip
        for q, dash in (("p50", "solid"), ("p99", "dash")):
            pts = [x for x in rows if x["throughput"] is not None and x[q] is not None]
            if not pts:
                continue
            labels.setdefault("latency", (pts[0][q + "_key"] or "latency").rsplit(".", 1)[0])
            data.append(
                {
                    **common,
                    "x": [x["throughput"] for x in pts],
                    "y": [x[q] for x in pts],
                    "text": [x["point_id"] for x in pts],
                    "name": f"{name} {q}",
                    "xaxis": "x2",
                    "yaxis": "y2",
                    "showlegend": False,
                    "line": {"color": color, "dash": dash},
                }
            )
            if q == "p99":
                k = series.knee_index([x["throughput"] for x in pts], [x[q] for x in pts])
                if k is not None:
                    data.append(
                        {
                            "type": "scatter",
                            "mode": "markers+text",
                            "x": [pts[k]["throughput"]],
                            "y": [pts[k][q]],
                            "text": ["knee"],
                            "textposition": "top left",
                            "name": f"{name} knee",
                            "xaxis": "x2",
                            "yaxis": "y2",
                            "showlegend": False,
                            "marker": {
                                "symbol": "star",
                                "size": 14,
                                "color": color,
                                "line": {"color": "#000", "width": 1},
                            },
                        }
                    )
    if not data:
        return None
    load_t, thr_t = axis_title(labels.get("load")), axis_title(labels.get("throughput"))
    axes = [
        ("x", "y", load_t, thr_t, "throughput vs load"),
        ("x2", "y2", thr_t, axis_title(labels.get("latency") or "latency.e2e"),
         f"latency vs throughput ({LINE_STYLES})"),
        ("x3", "y3", load_t, axis_title(labels.get("goodput")), "goodput vs load"),
    ]  # fmt: skip
    used = [a for a in axes if any(t["xaxis"] == a[0] for t in data)]  # no empty panel (e.g. no --slo)
    layout = subplots(1, len(used), [title for *_, title in used], horizontal_spacing=0.18 / len(used))
    layout.update(title={"text": "sweep", "x": 0.01}, height=440, margin={"l": 60, "r": 20, "t": 90, "b": 60},
                  hovermode="closest", legend={"title": {"text": f"colour: run / curve<br>{LINE_STYLES}"}})  # fmt: skip
    panel: dict[str, str] = {}
    for j, (xa, _ya, xt, yt, _title) in enumerate(used, 1):
        panel[xa] = axis(j)
        layout[f"xaxis{axis(j)}"].update(title={"text": xt or ""}, rangemode="tozero")
        layout[f"yaxis{axis(j)}"].update(title={"text": yt or ""}, rangemode="tozero")
    for t in data:  # the traces were drawn for all three panels; renumber them onto the panels kept
        k = panel[t["xaxis"]]
        t["xaxis"], t["yaxis"] = f"x{k}", f"y{k}"
    return {"data": data, "layout": layout}
