"""What every chart of the report shares: the palette, a line trace, ``plotly.subplots`` grids as plain data.

Figures are plain dicts (plotly figure specs) rendered by the embedded plotly.js.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from plotly.subplots import make_subplots

Fig = dict[str, Any]
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"]


def line(x: Any, y: Any, name: str, color: str, **kw: Any) -> dict[str, Any]:
    """A line trace of a timeline row (its row's axes are set by :func:`loadgen.report.timeline._stack`)."""
    return {
        "type": "scatter",
        "mode": "lines",
        "x": x,
        "y": y,
        "name": name,
        "line": {"color": color, "width": 1.5, **kw.pop("line", {})},
        **kw,
    }


def centers(edges: np.ndarray) -> np.ndarray:
    return (edges[:-1] + edges[1:]) / 2


def pairs(pts: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    t, v = zip(*pts, strict=True)
    return np.array(t, dtype=float), np.array(v, dtype=float)


def axis(k: int) -> str:
    """The suffix of panel ``k``'s axes (row-major from 1) in a ``plotly.subplots`` grid: "", "2", ..."""
    return "" if k == 1 else str(k)


def subplots(rows: int, cols: int, titles: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    """The layout of a ``plotly.subplots`` grid as plain data: panel k on axes ``x{k}``/``y{k}`` (see
    :func:`axis`) with their domains, and each title bold at its panel's top left. plotly.js's own look,
    as every chart of the report (the Python template is dropped)."""
    bold = [f"<b>{title}</b>" for title in titles] if titles else None
    layout: dict[str, Any] = make_subplots(rows=rows, cols=cols, subplot_titles=bold, **kw).to_plotly_json()["layout"]
    layout.pop("template", None)
    for k, ann in enumerate(layout.setdefault("annotations", []), 1):
        ann.update(x=layout[f"xaxis{axis(k)}"]["domain"][0], xanchor="left", font={"size": 11})
    return layout
