"""The latency distributions of one point: CDFs of TTFT, ITL, TPOT and E2E in a 2x2 grid."""

from __future__ import annotations

from typing import Any

from loadgen.metrics.definitions import E2E, ITL, TPOT, TTFT
from loadgen.report import series
from loadgen.report.load import PointData
from loadgen.report.plot import PALETTE, Fig, axis, subplots


def distributions(point: PointData) -> Fig | None:
    """CDFs of TTFT, ITL, TPOT and E2E in a 2x2 grid; one line per workload class when several."""
    req = point.requests
    lat = series.latencies(req)
    ok = lat["ok"]
    if not ok.any():
        return None
    classes = sorted(set(req.cls[ok]))
    groups = [("all", None)] + ([(c, c) for c in classes] if len(classes) > 1 else [])
    panels = [(m.title(), m.tag) for m in (TTFT, ITL, TPOT, E2E)]
    data: list[dict[str, Any]] = []
    layout = subplots(2, 2, horizontal_spacing=0.06, vertical_spacing=0.12)
    layout.update(title={"text": f"{point.point_id}: latency distributions (CDF)", "x": 0.01}, height=560,
                  margin={"l": 60, "r": 20, "t": 60, "b": 50}, hovermode="closest")  # fmt: skip
    for p, (label, key) in enumerate(panels):
        ax = axis(p + 1)
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
