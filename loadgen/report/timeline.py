"""The timeline of one point: a row per available series on linked x axes, the requests' Gantt at the bottom."""

from __future__ import annotations

from typing import Any

import numpy as np

from loadgen.report import series
from loadgen.report.load import PointData, Requests, RunData
from loadgen.report.plot import PALETTE, Fig, axis, centers, line, subplots
from loadgen.report.server_series import gpu_series, iteration_arrays, server_series, telemetry_series

GANTT_MAX_ROWS = 500  # denser than the panel's pixel rows already; SVG cost grows with it
MAX_STEPS_EXACT = 3000


def timeline(run: RunData, point: PointData) -> Fig | None:
    """One figure, one shared x axis (linked zoom): a row per available series, Gantt at the bottom."""
    req = point.requests
    if len(req) == 0:
        return None
    lo = float(np.nanmin(np.concatenate([req.intended, req.sent])))
    hi = float(np.nanmax(req.end))
    edges = series.time_edges(lo, hi)
    x = centers(edges)
    rows: list[tuple[str, list[dict[str, Any]], float]] = []  # (title, traces, relative height)

    first_or_end = np.where(np.isfinite(req.first), req.first, req.end)
    rows.append(
        (
            "requests (client)",
            [
                line(
                    x,
                    series.mean_occupancy(req.sent, first_or_end, edges),
                    "waiting for 1st token",
                    PALETTE[3],
                    stackgroup="client",
                ),
                line(
                    x,
                    series.mean_occupancy(req.first, req.end, edges),
                    "streaming",
                    PALETTE[0],
                    stackgroup="client",
                ),
                line(
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

    srv = server_series(point)
    it = iteration_arrays(point, run.run.get("t0_unix"))
    if it is not None and not np.isfinite(it["t"]).any():
        it = None
    batch = [
        line(*srv[role], f"{role} (/metrics)", c, line={"shape": "hv"})
        for role, c in (("running", PALETTE[2]), ("waiting", PALETTE[1]))
        if role in srv
    ]
    if it is not None:
        batch += [
            line(x, series.binned_mean(it["t"], it[role], edges), f"{role} (engine steps, mean)", c,
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
            else line(x, series.binned_mean(it["t"], it[k], edges), f"{k} tokens/step (mean)", c,
                       stackgroup="steps")
            for k, c in (("decode", PALETTE[0]), ("prefill", PALETTE[3]))
        ]  # fmt: skip
        traces.append(line(x, series.binned_mean(it["t"], it["seqs"], edges), "sequences in batch (mean)", PALETTE[4],
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
        kv.append(line(*srv["kv"], "KV cache % (/metrics)", PALETTE[4], line={"shape": "hv"}))
    if it is not None and np.isfinite(it["kv_total"]).any():
        kv.append(
            line(
                x,
                series.binned_mean(it["t"], 100 * it["kv_used"] / it["kv_total"], edges),
                "KV blocks used % (per step)",
                PALETTE[5],
            )
        )
    if kv:
        rows.append(("KV cache usage %", kv, 0.8))

    tel = telemetry_series(point)
    if tel:
        rows.append(
            (
                "utilisation %",
                [
                    line(t, v, label, PALETTE[(i + 6) % len(PALETTE)])
                    for i, (label, (t, v)) in enumerate(tel.items())
                ],
                0.8,
            )
        )
    for title, per_gpu in gpu_series(point).items():
        rows.append((title, [line(t, v, label, PALETTE[(i + 6) % len(PALETTE)])
                             for i, (label, (t, v)) in enumerate(per_gpu.items())], 0.6))  # fmt: skip

    rows.append(
        (
            "output tokens/s (client)",
            [
                line(
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
            line(xs, ys, name, color, line={"width": width}, connectgaps=False, hoverinfo="x+name")
        )
    err = np.array([req.error[i] is not None for i in idx], dtype=bool)
    if err.any():
        # one tick per error as segments of a single path: one SVG element, not one per marker
        end, ye = req.end[idx][err], y[err]
        labels = [f"{req.ids[i]}: {req.error[i]}" for i in idx[err]]
        traces.append(
            line(
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


def _stack(rows: list[tuple[str, list[dict[str, Any]], float]], title: str) -> Fig:
    """Rows stacked on linked x axes (zooming one row zooms all): each row its own y axis and legend."""
    layout = subplots(len(rows), 1, [t for t, _, _ in rows], shared_xaxes=True, vertical_spacing=0.035,
                       row_heights=[h for _, _, h in rows])  # fmt: skip
    layout.update(title={"text": title, "x": 0.01}, height=170 * sum(h for _, _, h in rows) + 120, hovermode="x",
                  margin={"l": 60, "r": 230, "t": 50, "b": 40}, barmode="stack", bargap=0)  # fmt: skip
    data: list[dict[str, Any]] = []
    for i, (row_title, traces, _) in enumerate(rows, 1):
        k = axis(i)
        yaxis = layout[f"yaxis{k}"]
        yaxis.update(rangemode="tozero", automargin=True,
                     title={"text": next((u for start, u in _ROW_UNITS if row_title.startswith(start)), ""),
                            "font": {"size": 10}})  # fmt: skip
        # a legend beside each row, not one long list
        layout[f"legend{k}"] = {"x": 1.01, "xanchor": "left", "y": yaxis["domain"][1], "yanchor": "top",
                                "font": {"size": 10}, "tracegroupgap": 2}  # fmt: skip
        data += [{**t, "xaxis": f"x{k}", "yaxis": f"y{k}", "legend": f"legend{k}"} for t in traces]
    last = axis(len(rows))
    layout[f"yaxis{last}"].update(autorange="reversed", title={"text": "request (send order)"})  # Gantt: first on top
    layout[f"xaxis{last}"]["title"] = {"text": "run clock (s)"}
    return {"data": data, "layout": layout}
