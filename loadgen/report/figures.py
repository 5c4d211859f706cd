"""Plotly figure specs (plain dicts, rendered by the embedded plotly.js) for one point and for sweeps.

Each builder returns ``None`` when it has no data, so that an absent optional series (no server-state
poller, no telemetry, no per-iteration record) leaves its chart out instead of drawing an empty one.

Size: every chart of the report, one builder each (the grids are ``plotly.subplots`` layouts; each server's
metric names are on its backend's profile, ``backends.profile``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from plotly.subplots import make_subplots

from backends.registry import server_profiles
from loadgen.report import series
from loadgen.report.load import PointData, Requests, RunData
from loadgen.results import leaves

Fig = dict[str, Any]
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]
GANTT_MAX_ROWS = 500  # denser than the panel's pixel rows already; SVG cost grows with it
MAX_STEPS_EXACT = 3000

# A server without a profile: names that end like these. (Each known server's names are on its profile.)
GENERIC = {"running": r"(requests_running|running_reqs|requests_processing)$",
           "waiting": r"(requests_waiting|queue_reqs|queue_size|requests_deferred)$",
           "kv": r"kv_cache_usage(_perc|_ratio)?$"}  # fmt: skip


def _line(x: Any, y: Any, name: str, color: str, **kw: Any) -> dict[str, Any]:
    """A line trace of a timeline row (its row's axes are set by :func:`_stack`)."""
    return {
        "type": "scatter",
        "mode": "lines",
        "x": x,
        "y": y,
        "name": name,
        "line": {"color": color, "width": 1.5, **kw.pop("line", {})},
        **kw,
    }


def _centers(edges: np.ndarray) -> np.ndarray:
    return (edges[:-1] + edges[1:]) / 2


def _pairs(pts: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    t, v = zip(*pts, strict=True)
    return np.array(t, dtype=float), np.array(v, dtype=float)


def _family(metrics: dict[str, Any], name: str) -> float | None:
    """Sum of a metric over its label sets (keys ``name`` or ``name{a=b,...}`` as the poller writes them)."""
    vals = [v for k, v in metrics.items() if k.split("{", 1)[0] == name and isinstance(v, (int, float))]
    return float(sum(vals)) if vals else None


def _server_series(point: PointData) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Role (running, waiting, kv %) -> (t, value) from the poller's ``server_state.jsonl`` samples
    (``{"t", "metrics": {"name{labels}": value}, "slots": [...]}``); failed scrapes are skipped.
    llama.cpp's busy ``/slots`` stand in for "running" when its metrics lack a running gauge."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rows = [r for r in point.server_state if isinstance(r.get("t"), (int, float))]
    with_metrics = [r for r in rows if isinstance(r.get("metrics"), dict)]
    present = sorted({k.split("{", 1)[0] for r in with_metrics[:1] for k in r["metrics"]})
    profiles = server_profiles()
    for role, attr in (("running", "running"), ("waiting", "waiting"), ("kv", "kv_usage")):
        names = list(dict.fromkeys(n for p in profiles for n in getattr(p, attr)))
        generic = [n for n in present if re.search(GENERIC[role], n) and n not in names]
        for name in (*names, *generic):
            pts = [(r["t"], v) for r in with_metrics if (v := _family(r["metrics"], name)) is not None]
            if pts:
                t, v = _pairs(pts)
                out[role] = (t, v * 100 if role == "kv" and np.nanmax(v) <= 1.0 else v)
                break
    for used, total in [p.kv_blocks for p in profiles if p.kv_blocks]:  # a server that counts KV blocks
        pts = [(r["t"], 100 * u / tot) for r in with_metrics
               if (u := _family(r["metrics"], used)) is not None and (tot := _family(r["metrics"], total))]  # fmt: skip
        if pts and "kv" not in out:
            out["kv"] = _pairs(pts)
    if "running" not in out:
        slots = [(r["t"], float(sum(1 for s in r["slots"] if s.get("busy")))) for r in rows if r.get("slots")]
        if slots:
            out["running"] = _pairs(slots)
    return out


# Per-iteration record fields of the reference server (GET /v1/iterations), with accepted aliases.
_ITER_FIELDS = {
    "prefill": ("prefill_tokens", "num_prefill_tokens"),
    "decode": ("decode_tokens", "num_decode_tokens"),
    "kv_used": ("kv_blocks_used", "blocks_used", "num_used_blocks"),
    "kv_total": ("kv_blocks_total", "blocks_total", "num_blocks"),
    "running": ("num_running",),
    "waiting": ("num_waiting",),
}


def _iteration_arrays(point: PointData, t0_unix: float | None) -> dict[str, np.ndarray] | None:
    """Per-step arrays on the run clock, at the step's end (when its tokens come out): the unix step end
    (``t_end_unix``) minus run.json's ``t0_unix``; without those, the run-clock ``t`` the poller adds."""
    rows = point.iterations
    if not rows:
        return None
    end_key = next((k for k in ("t_end_unix", "end") if k in rows[0]), None)
    if end_key is not None and t0_unix is not None:
        t = np.array([r.get(end_key, np.nan) for r in rows], dtype=float) - t0_unix
    elif "t" in rows[0]:
        t = np.array([r.get("t", np.nan) for r in rows], dtype=float)
    else:
        return None

    def get(names: tuple[str, ...]) -> np.ndarray:
        key = next((k for k in names if k in rows[0]), names[0])
        return np.array(
            [r[key] if isinstance(r.get(key), (int, float)) else np.nan for r in rows], dtype=float
        )

    out = {"t": t, **{role: get(names) for role, names in _ITER_FIELDS.items()}}
    ids = next((k for k in ("seq_ids", "request_ids", "requests") if k in rows[0]), None)
    out["seqs"] = np.array([len(r.get(ids) or []) if ids else np.nan for r in rows], dtype=float)
    out["preempted"] = np.array([len(r.get("preempted") or []) for r in rows], dtype=float)
    return out


def _telemetry_series(point: PointData) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Label -> (t, percent): host CPU (mean over cores), the server process, each GPU (telemetry.jsonl)."""
    rows = [r for r in point.telemetry if isinstance(r.get("t"), (int, float))]
    found: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        cores = r.get("cpu_pct")
        if isinstance(cores, list) and cores:
            found.setdefault("host CPU % (mean of cores)", []).append((r["t"], sum(cores) / len(cores)))
        if isinstance(r.get("server_cpu_pct"), (int, float)):
            found.setdefault("server process CPU % (100 = one core)", []).append(
                (r["t"], r["server_cpu_pct"])
            )
        for i, g in enumerate(r.get("gpus") or []):
            if isinstance(g, dict) and isinstance(g.get("util"), (int, float)):
                found.setdefault(f"GPU {g.get('index', i)} util %", []).append((r["t"], g["util"]))
    return {label: _pairs(pts) for label, pts in found.items()}


def missing_series(run: RunData, point: PointData) -> list[str]:
    """The optional series this point has no usable samples of (said on the page, not drawn empty)."""
    checks = (
        ("server state (/metrics)", bool(_server_series(point))),
        ("per-iteration record", _iteration_arrays(point, run.run.get("t0_unix")) is not None),
        ("telemetry", bool(_telemetry_series(point))),
    )
    return [name for name, present in checks if not present]


def timeline(run: RunData, point: PointData) -> Fig | None:
    """One figure, one shared x axis (linked zoom): a row per available series, Gantt at the bottom."""
    req = point.requests
    if len(req) == 0:
        return None
    lo = float(np.nanmin(np.concatenate([req.intended, req.sent])))
    hi = float(np.nanmax(req.end))
    edges = series.time_edges(lo, hi)
    x = _centers(edges)
    rows: list[tuple[str, list[dict[str, Any]], float]] = []  # (title, traces, relative height)

    first_or_end = np.where(np.isfinite(req.first), req.first, req.end)
    rows.append(
        (
            "requests (client)",
            [
                _line(
                    x,
                    series.mean_occupancy(req.sent, first_or_end, edges),
                    "waiting for 1st token",
                    PALETTE[3],
                    stackgroup="client",
                ),
                _line(
                    x,
                    series.mean_occupancy(req.first, req.end, edges),
                    "streaming",
                    PALETTE[0],
                    stackgroup="client",
                ),
                _line(
                    x,
                    series.mean_occupancy(req.intended, req.sent, edges),
                    "due, not yet sent",
                    PALETTE[1],
                    line={"dash": "dot"},
                ),
            ],
            1.0,
        )
    )

    srv = _server_series(point)
    it = _iteration_arrays(point, run.run.get("t0_unix"))
    if it is not None and not np.isfinite(it["t"]).any():
        it = None
    batch = [
        _line(*srv[role], f"{role} (/metrics)", c, line={"shape": "hv"})
        for role, c in (("running", PALETTE[2]), ("waiting", PALETTE[1]))
        if role in srv
    ]
    if it is not None:
        batch += [
            _line(x, series.binned_mean(it["t"], it[role], edges), f"{role} (engine steps, mean)", c,
                  line={"dash": "dot"})
            for role, c in (("running", PALETTE[2]), ("waiting", PALETTE[1]))
            if np.isfinite(it[role]).any()
        ]  # fmt: skip
    if batch:
        rows.append(("server batch: requests running / waiting", batch, 1.0))

    if it is not None:
        exact = len(it["t"]) <= MAX_STEPS_EXACT
        traces = [
            {"type": "bar", "x": it["t"], "y": it[k], "name": f"{k} tokens/step",
             "marker": {"color": c, "line": {"width": 0}}}
            if exact
            else _line(x, series.binned_mean(it["t"], it[k], edges), f"{k} tokens/step (mean)", c,
                       stackgroup="steps")
            for k, c in (("decode", PALETTE[0]), ("prefill", PALETTE[3]))
        ]  # fmt: skip
        traces.append(_line(x, series.binned_mean(it["t"], it["seqs"], edges), "sequences in batch (mean)", PALETTE[4],
                            line={"dash": "dot"}))  # fmt: skip
        pre = it["preempted"] > 0
        if pre.any():
            traces.append({"type": "scatter", "mode": "markers", "x": it["t"][pre], "y": (it["prefill"] + it["decode"])[pre],
                           "name": "preemption", "text": it["preempted"][pre],
                           "hovertemplate": "%{text} preempted<extra></extra>",
                           "marker": {"symbol": "triangle-down", "color": "#000", "size": 8}})  # fmt: skip
        title = (
            "tokens per engine step (exact)"
            if exact
            else f"tokens per engine step (mean per {edges[1] - edges[0]:g} s bin, {len(it['t']):,} steps)"
        )
        rows.append((title, traces, 1.0))

    kv: list[dict[str, Any]] = []
    if "kv" in srv:
        kv.append(_line(*srv["kv"], "KV cache % (/metrics)", PALETTE[4], line={"shape": "hv"}))
    if it is not None and np.isfinite(it["kv_total"]).any():
        kv.append(
            _line(
                x,
                series.binned_mean(it["t"], 100 * it["kv_used"] / it["kv_total"], edges),
                "KV blocks used % (per step)",
                PALETTE[5],
            )
        )
    if kv:
        rows.append(("KV cache usage %", kv, 0.8))

    tel = _telemetry_series(point)
    if tel:
        rows.append(
            (
                "utilisation %",
                [
                    _line(t, v, label, PALETTE[(i + 6) % len(PALETTE)])
                    for i, (label, (t, v)) in enumerate(tel.items())
                ],
                0.8,
            )
        )

    rows.append(
        (
            "output tokens/s (client)",
            [
                _line(
                    x,
                    series.binned_rate(req.event_t, req.event_tokens, edges),
                    "output tok/s",
                    PALETTE[2],
                    fill="tozeroy",
                )
            ],
            0.8,
        )
    )

    rows.append(_gantt(req))
    return _stack(rows, f"{point.point_id}: timeline (run clock, s)")


def _gantt(req: Requests) -> tuple[str, list[dict[str, Any]], float]:
    idx = series.gantt_sample(req, GANTT_MAX_ROWS)
    n = len(idx)
    y = np.arange(n, dtype=float)
    width = float(np.clip(300 / max(n, 1), 1, 6))

    def segments(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xs = np.column_stack([a[idx], b[idx], np.full(n, np.nan)]).ravel()
        ys = np.column_stack([y, y, np.full(n, np.nan)]).ravel()
        keep = np.repeat(np.isfinite(a[idx]) & np.isfinite(b[idx]) & (b[idx] > a[idx]), 3)
        return xs[keep], ys[keep]

    first_or_end = np.where(np.isfinite(req.first), req.first, req.end)
    traces = []
    for (a, b), name, color in (
        ((req.intended, req.sent), "queued (client)", PALETTE[1]),
        ((req.sent, first_or_end), "prefill / TTFT", PALETTE[3]),
        ((req.first, req.end), "decode", PALETTE[0]),
    ):
        xs, ys = segments(a, b)
        traces.append(
            _line(xs, ys, name, color, line={"width": width}, connectgaps=False, hoverinfo="x+name")
        )
    err = np.array([req.error[i] is not None for i in idx], dtype=bool)
    if err.any():
        # one tick per error as segments of a single path: one SVG element, not one per marker
        end, ye = req.end[idx][err], y[err]
        labels = [f"{req.ids[i]}: {req.error[i]}" for i in idx[err]]
        traces.append(
            _line(
                np.column_stack([end, end, np.full(len(end), np.nan)]).ravel(),
                np.column_stack([ye - 0.5, ye + 0.5, np.full(len(end), np.nan)]).ravel(),
                "error",
                "#000",
                line={"width": 2.5},
                text=[t for label in labels for t in (label, label, "")],
                hoverinfo="text+x",
            )
        )
    n_err = sum(e is not None for e in req.error)
    title = (
        "requests (Gantt)"
        if n == len(req)
        else f"requests (Gantt: {n:,} of {len(req):,} drawn, by send order; {int(err.sum()):,} of {n_err:,} errors)"
    )
    return title, traces, 2.5


# y-axis title (unit) of each timeline row, by the start of the row's title
_ROW_UNITS = (("requests (client)", "requests"), ("server batch", "requests"), ("tokens per engine step", "tokens"),
              ("KV cache", "percent of the pool"), ("utilisation", "percent busy"), ("output tokens/s", "tokens/s"))  # fmt: skip


def _axis(k: int) -> str:
    """The suffix of panel ``k``'s axes (row-major from 1) in a ``plotly.subplots`` grid: "", "2", ..."""
    return "" if k == 1 else str(k)


def _subplots(rows: int, cols: int, titles: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """The layout of a ``plotly.subplots`` grid as plain data: panel k on axes ``x{k}``/``y{k}`` (see
    :func:`_axis`) with their domains, and each title bold at its panel's top left. plotly.js's own look,
    as every chart of the report (the Python template is dropped)."""
    bold = [f"<b>{title}</b>" for title in titles] if titles else None
    layout: dict[str, Any] = make_subplots(rows=rows, cols=cols, subplot_titles=bold, **kw).to_plotly_json()["layout"]
    layout.pop("template", None)
    for k, ann in enumerate(layout.setdefault("annotations", []), 1):
        ann.update(x=layout[f"xaxis{_axis(k)}"]["domain"][0], xanchor="left", font={"size": 11})
    return layout


def _stack(rows: list[tuple[str, list[dict[str, Any]], float]], title: str) -> Fig:
    """Rows stacked on linked x axes (zooming one row zooms all): each row its own y axis and legend."""
    layout = _subplots(len(rows), 1, [t for t, _, _ in rows], shared_xaxes=True, vertical_spacing=0.035,
                       row_heights=[h for _, _, h in rows])  # fmt: skip
    layout.update(title={"text": title, "x": 0.01}, height=170 * sum(h for _, _, h in rows) + 120, hovermode="x",
                  margin={"l": 60, "r": 230, "t": 50, "b": 40}, barmode="stack", bargap=0)  # fmt: skip
    data: list[dict[str, Any]] = []
    for i, (row_title, traces, _) in enumerate(rows, 1):
        k = _axis(i)
        yaxis = layout[f"yaxis{k}"]
        yaxis.update(rangemode="tozero", automargin=True,
                     title={"text": next((u for start, u in _ROW_UNITS if row_title.startswith(start)), ""),
                            "font": {"size": 10}})  # fmt: skip
        # a legend beside each row, not one long list
        layout[f"legend{k}"] = {"x": 1.01, "xanchor": "left", "y": yaxis["domain"][1], "yanchor": "top",
                                "font": {"size": 10}, "tracegroupgap": 2}  # fmt: skip
        data += [{**t, "xaxis": f"x{k}", "yaxis": f"y{k}", "legend": f"legend{k}"} for t in traces]
    last = _axis(len(rows))
    layout[f"yaxis{last}"].update(autorange="reversed", title={"text": "request (send order)"})  # Gantt: first on top
    layout[f"xaxis{last}"]["title"] = {"text": "run clock (s)"}
    return {"data": data, "layout": layout}


def distributions(point: PointData) -> Fig | None:
    """CDFs of TTFT, ITL, TPOT and E2E in a 2x2 grid; one line per workload class when several."""
    req = point.requests
    lat = series.latencies(req)
    ok = lat["ok"]
    if not ok.any():
        return None
    classes = sorted(set(req.cls[ok]))
    groups = [("all", None)] + ([(c, c) for c in classes] if len(classes) > 1 else [])
    panels = [("time to first token, TTFT (s)", "ttft"), ("inter-token latency, ITL (s)", "itl"),
              ("time per output token, TPOT (s)", "tpot"), ("end-to-end latency (s)", "e2e")]  # fmt: skip
    data: list[dict[str, Any]] = []
    layout = _subplots(2, 2, horizontal_spacing=0.06, vertical_spacing=0.12)
    layout.update(title={"text": f"{point.point_id}: latency distributions (CDF)", "x": 0.01}, height=560,
                  margin={"l": 60, "r": 20, "t": 60, "b": 50}, hovermode="closest")  # fmt: skip
    for p, (label, key) in enumerate(panels):
        ax = _axis(p + 1)
        layout[f"xaxis{ax}"].update(title={"text": label}, rangemode="tozero")
        layout[f"yaxis{ax}"].update(range=[0, 1.02], title={"text": "fraction of requests" if p % 2 == 0 else ""})
        for g, (gname, cls) in enumerate(groups):
            if key == "itl":
                v = lat["itl"] if cls is None else lat["itl"][lat["itl_cls"] == cls]
            else:
                v = lat[key][ok if cls is None else ok & (req.cls == cls)]
            xs, ys = series.cdf(v)
            if xs.size:
                data.append(
                    {
                        "type": "scatter",
                        "mode": "lines",
                        "x": xs,
                        "y": ys,
                        "name": gname,
                        "legendgroup": gname,
                        "showlegend": p == 0,
                        "xaxis": f"x{ax}",
                        "yaxis": f"y{ax}",
                        "line": {
                            "color": PALETTE[g % len(PALETTE)],
                            "width": 2 if cls is None else 1.5,
                            "shape": "hv",
                        },
                    }
                )
    return {"data": data, "layout": layout} if data else None


# ---- sweep curves -------------------------------------------------------------------------------


def _find(flat: dict[str, Any], patterns: tuple[str, ...]) -> tuple[str, float] | None:
    """First key (by pattern order) whose full dotted name matches, with a numeric value."""
    for pat in patterns:
        rx = re.compile(pat)
        for k, v in flat.items():
            if rx.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
                return k, float(v)
    return None


# PointSummary keys (loadgen.metrics.summarize / loadgen.engine.run_point), most specific first.
LOAD_KEYS = (r"load\.concurrency", r"load\.rate", r"load\.speedup")
THROUGHPUT_KEYS = (r"throughput\.steady\.output_tok_per_s", r"throughput\.whole\.output_tok_per_s")
GOODPUT_KEYS = (r"goodput\.req_per_s", r"goodput\.req_per_s_whole")
LATENCY_KEYS = {q: (rf"latency\.e2e\.{q}", rf"latency\.ttft\.{q}") for q in ("p50", "p99")}


# The one place a summary key gets its axis title (words and unit); latencies are seconds in summary.json.
AXIS_TITLES = {
    "load.concurrency": "concurrency (requests in flight)",
    "load.rate": "offered load (requests/s)",
    "load.speedup": "trace replay speed-up (x)",
    "throughput.steady.output_tok_per_s": "output throughput, steady state (tokens/s)",
    "throughput.whole.output_tok_per_s": "output throughput, whole point (tokens/s)",
    "goodput.req_per_s": "goodput, steady state (requests/s within SLOs)",
    "goodput.req_per_s_whole": "goodput, whole point (requests/s within SLOs)",
    "latency.e2e": "end-to-end latency (s)",
    "latency.ttft": "time to first token (s)",
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
    layout = _subplots(1, len(used), [title for *_, title in used], horizontal_spacing=0.18 / len(used))
    layout.update(title={"text": "sweep", "x": 0.01}, height=440, margin={"l": 60, "r": 20, "t": 90, "b": 60},
                  hovermode="closest", legend={"title": {"text": f"colour: run / curve<br>{LINE_STYLES}"}})  # fmt: skip
    panel: dict[str, str] = {}
    for j, (xa, _ya, xt, yt, _title) in enumerate(used, 1):
        panel[xa] = _axis(j)
        layout[f"xaxis{_axis(j)}"].update(title={"text": xt or ""}, rangemode="tozero")
        layout[f"yaxis{_axis(j)}"].update(title={"text": yt or ""}, rangemode="tozero")
    for t in data:  # the traces were drawn for all three panels; renumber them onto the panels kept
        k = panel[t["xaxis"]]
        t["xaxis"], t["yaxis"] = f"x{k}", f"y{k}"
    return {"data": data, "layout": layout}
