"""Numeric transforms behind the charts: binned time series, per-request latencies, CDFs, the knee.

Everything here aggregates, so a 10,000-request point stays a few hundred numbers per series.
"""

from __future__ import annotations

import math

import numpy as np

from loadgen.report.load import Requests


def time_edges(t_lo: float, t_hi: float, max_bins: int = 400) -> np.ndarray:
    """Bin edges of a 1-2-5 width giving at most ``max_bins`` bins over [t_lo, t_hi]."""
    span = max(t_hi - t_lo, 1e-3)
    raw = span / max_bins
    mag = 10 ** math.floor(math.log10(raw))
    width = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    lo = math.floor(t_lo / width) * width
    n = max(1, math.ceil((t_hi - lo) / width))
    return lo + width * np.arange(n + 1)


def mean_occupancy(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Time-averaged number of open intervals [start, end) in each bin (exact, O(n log n)).

    F(t) = sum_i clip(t - s_i, 0, e_i - s_i) is the integral of the count up to t; the bin mean is
    the difference of F at the bin's edges over its width.
    """
    ok = np.isfinite(starts) & np.isfinite(ends) & (ends >= starts)
    s = np.sort(starts[ok])
    e = np.sort(ends[ok])

    def integral(t: np.ndarray) -> np.ndarray:
        ns = np.searchsorted(s, t)
        ne = np.searchsorted(e, t)
        cs = np.concatenate([[0.0], np.cumsum(s)])
        ce = np.concatenate([[0.0], np.cumsum(e)])
        return (ns * t - cs[ns]) - (ne * t - ce[ne])

    f = integral(edges)
    return np.diff(f) / np.diff(edges)


def binned_rate(times: np.ndarray, weights: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Sum of ``weights`` per bin divided by the bin width (e.g. output tokens/s)."""
    ok = np.isfinite(times) & np.isfinite(weights)
    sums, _ = np.histogram(times[ok], bins=edges, weights=weights[ok])
    return sums / np.diff(edges)


def binned_mean(times: np.ndarray, values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of the samples falling in each bin; NaN where a bin has none."""
    ok = np.isfinite(times) & np.isfinite(values)
    sums, _ = np.histogram(times[ok], bins=edges, weights=values[ok])
    counts, _ = np.histogram(times[ok], bins=edges)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def latencies(req: Requests) -> dict[str, np.ndarray]:
    """Per-request TTFT, E2E and TPOT of the successful requests, and their token-weighted ITL samples:
    the values :mod:`loadgen.metrics.definitions` computed when the records were read (one definition everywhere)."""
    ok = np.array([k is None for k in req.error], dtype=bool) & np.isfinite(req.first)
    keep = ok[req.itl_req] if req.itl_req.size else np.zeros(0, dtype=bool)
    return {
        "ok": ok,
        "ttft": req.ttft,
        "e2e": req.e2e,
        "tpot": req.tpot,
        "itl": req.itl[keep],
        "itl_cls": req.cls[req.itl_req[keep]],
    }


def cdf(values: np.ndarray, max_points: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """An empirical CDF evaluated at up to ``max_points`` quantiles (exact ends kept)."""
    v = np.sort(values[np.isfinite(values)])
    if v.size == 0:
        return v, v
    p = (np.arange(v.size) + 1) / v.size
    if v.size > max_points:
        idx = np.unique(np.linspace(0, v.size - 1, max_points).round().astype(np.int64))
        v, p = v[idx], p[idx]
    return v, p


def knee_index(x: list[float], y: list[float]) -> int | None:
    """Kneedle: the point farthest above the chord from the first to the last point, both axes scaled
    to [0, 1]. For latency (y) vs throughput (x) that is where latency starts to climb faster than
    throughput. None for fewer than three points or no convex bend."""
    if len(x) < 3:
        return None
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if not (np.all(np.isfinite(xa)) and np.all(np.isfinite(ya))):
        return None
    xs = (xa - xa.min()) / (np.ptp(xa) or 1.0)
    ys = (ya - ya.min()) / (np.ptp(ya) or 1.0)
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    chord = ys[0] + (ys[-1] - ys[0]) * (xs - xs[0]) / ((xs[-1] - xs[0]) or 1.0)
    dist = chord - ys  # below the chord = latency still flat relative to throughput gained
    i = int(np.argmax(dist))
    return int(order[i]) if dist[i] > 1e-9 else None


def gantt_sample(req: Requests, max_rows: int) -> np.ndarray:
    """Indices of the requests to draw, by send order: all when few, else every k-th plus the errors
    (at most half of ``max_rows``, the first ones)."""
    order = np.argsort(np.where(np.isfinite(req.sent), req.sent, np.inf), kind="stable")
    if len(order) <= max_rows:
        return order
    err = np.array([e is not None for e in req.error], dtype=bool)
    err_idx = order[err[order]][: max_rows // 2]
    step = math.ceil(len(order) / (max_rows - len(err_idx)))
    picked = np.union1d(order[::step], err_idx)
    return picked[np.argsort(req.sent[picked], kind="stable")]
