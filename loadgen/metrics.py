"""Metrics as pure functions of request records (dicts as in ``requests.jsonl``); no HTTP here.

Formulas (docs/metrics.md has the full definitions and the mapping to vLLM/AIPerf/guidellm):

* TTFT = first content event − sent; E2E = end − sent; TPOT = (E2E − TTFT) / (output_tokens − 1).
* ITL (token-weighted): an event carrying k tokens after a gap g contributes k values g/k;
  ``chunk_gap`` is the raw gap between consecutive content events.
* ``*_from_intended``: the same latencies measured from the intended send time (coordinated omission).
* Steady-state window = [first measured send, last measured send]: the load is fully applied there.
* Goodput: successful requests meeting every given SLO, per second.

Entry point: :func:`summarize` → the metric part of a PointSummary, with ``per_class`` holding the
same metrics for every workload class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

Record = dict[str, Any]
PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "chunk_gap", "e2e", "ttft_from_intended", "e2e_from_intended")
SLO_KEYS = ("ttft", "tpot", "e2e")
LAG_WARN_S = 0.010  # schedule lag p99 above this: the client, not the server, is late
SHORTFALL = 0.95  # achieved below 95 % of requested rate/concurrency: client-limited


def stats(values: Iterable[float] | np.ndarray) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p95/p99 (linear interpolation, as numpy and vLLM), min, max."""
    arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=float)
    if arr.size == 0:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "min": None, "max": None}
    pct = np.percentile(arr, PERCENTILES)
    return {
        "count": int(arr.size), "mean": float(arr.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)},
        "min": float(arr.min()), "max": float(arr.max()),
    }  # fmt: skip


def ttft(r: Record) -> float | None:
    return r["events"][0][0] - r["sent"] if r["events"] else None


def e2e(r: Record) -> float:
    return r["end"] - r["sent"]


def tpot(r: Record) -> float | None:
    first, out = ttft(r), r.get("output_tokens") or 0
    return (e2e(r) - first) / (out - 1) if first is not None and out > 1 else None


def itl(r: Record) -> np.ndarray:
    """Token-weighted inter-token latencies; tokens that arrive with the first event have none."""
    ev = r["events"]
    if len(ev) < 2:
        return np.empty(0)
    gaps = np.diff(np.asarray([e[0] for e in ev], dtype=float))
    k = np.asarray([_tokens(e) for e in ev[1:]], dtype=int)
    keep = k > 0
    return np.repeat(gaps[keep] / k[keep], k[keep])


def _tokens(event: Sequence[float | None]) -> int:
    """An event's token delta; ``None`` (count not stated, not yet resolved from a total) counts as one."""
    k = event[1]
    return 1 if k is None else int(k)


def spec_decode(records: Sequence[Record]) -> dict[str, Any] | None:
    """Speculative-decoding acceptance over successful requests whose server reported counts."""
    counts = [c for r in records if r["error"] is None and (c := r.get("extra", {}).get("spec_decode"))]
    if not counts:
        return None
    drafted, accepted = sum(c["drafted"] for c in counts), sum(c["accepted"] for c in counts)
    return {"requests": len(counts), "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None}  # fmt: skip


def chunk_gaps(r: Record) -> np.ndarray:
    ev = r["events"]
    return np.diff(np.asarray([e[0] for e in ev], dtype=float)) if len(ev) > 1 else np.empty(0)


def meets_slo(r: Record, slo: dict[str, float]) -> bool:
    if r["error"] is not None:
        return False
    values = {"ttft": ttft(r), "tpot": tpot(r), "e2e": e2e(r)}
    for key, limit in slo.items():
        v = values[key]
        if key == "tpot" and v is None:
            continue  # a one-token answer has no TPOT and cannot violate it
        if v is None or v > limit:
            return False
    return True


def steady_window(records: Sequence[Record]) -> tuple[float, float]:
    """[first send, last send] of measured requests, starting instead when the last warm-up request ended
    if that falls in the first half of it: a warm-up request still in flight holds a slot (closed loop)
    or batch seat whose tokens the window would not count. (Warm-ups that end later, as in a short run of
    one wave, would leave too short a window; it is kept whole.) The whole run span when the window is
    degenerate."""
    measured = [r for r in records if not r["warmup"]]
    if not measured:
        return (0.0, 0.0)
    a, b = min(r["sent"] for r in measured), max(r["sent"] for r in measured)
    warm_end = max((r["end"] for r in records if r["warmup"]), default=a)
    if a < warm_end <= (a + b) / 2:
        a = warm_end
    if b - a <= 1e-3:
        b = max(r["end"] for r in measured)
    return (a, b)


def summarize(
    records: Sequence[Record], load: dict[str, Any] | None = None, slo: dict[str, float] | None = None,
    client_cpu: float | None = None, client_wait: float | None = None,
) -> dict[str, Any]:
    """Metrics of one load point; ``load`` (requested rate/concurrency) feeds the client-health part."""
    window = steady_window(records)
    out = _core(records, window, slo)
    out["window"] = list(window)
    out["client"] = client_health(records, window, load or {}, client_cpu, client_wait)
    classes = sorted({r["cls"] for r in records if not r["warmup"]})
    out["per_class"] = {c: _core([r for r in records if r["cls"] == c], window, slo) for c in classes}
    return out


def _core(records: Sequence[Record], window: tuple[float, float], slo: dict[str, float] | None) -> dict[str, Any]:
    measured = [r for r in records if not r["warmup"]]
    ok = [r for r in measured if r["error"] is None]
    n, a, b = len(measured), window[0], window[1]
    wlen = b - a
    span = (max(r["end"] for r in measured) - min(r["sent"] for r in measured)) if measured else 0.0
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    with_events = [r for r in ok if r["events"]]
    lat = {
        "ttft": stats(ttft(r) for r in with_events),  # type: ignore[misc]
        "tpot": stats(v for r in ok if (v := tpot(r)) is not None),
        "itl": stats(np.concatenate([itl(r) for r in ok]) if ok else np.empty(0)),
        "chunk_gap": stats(np.concatenate([chunk_gaps(r) for r in ok]) if ok else np.empty(0)),
        "e2e": stats(e2e(r) for r in ok),
        "ttft_from_intended": stats(r["events"][0][0] - r["intended"] for r in with_events),
        "e2e_from_intended": stats(r["end"] - r["intended"] for r in ok),
    }
    steady_out = sum(_tokens(e) for r in ok for e in r["events"] if a <= e[0] <= b)
    steady_in = sum(r["prompt_tokens"] or 0 for r in ok if a <= r["sent"] <= b)
    steady_done = sum(1 for r in ok if a <= r["end"] <= b)
    thr = {
        "whole": _rates(len(ok), out_tokens, in_tokens, span),
        "steady": _rates(steady_done, steady_out, steady_in, wlen),
    }
    kinds = Counter(r["error"]["kind"] for r in measured if r["error"] is not None)
    res: dict[str, Any] = {
        "counts": {
            "requests": n, "ok": len(ok), "errors": n - len(ok), "warmup": len(records) - n,
            "output_tokens": out_tokens, "prompt_tokens": in_tokens,
            "output_tokens_sources": dict(Counter(r["output_tokens_source"] for r in ok)),
        },  # fmt: skip
        "latency": lat,
        "throughput": thr,
        "errors": {"rate": (n - len(ok)) / n if n else 0.0, "by_kind": dict(sorted(kinds.items()))},
    }
    if (spec := spec_decode(measured)) is not None:
        res["spec_decode"] = spec
    if slo:
        good = [r for r in ok if meets_slo(r, slo)]
        res["goodput"] = {
            "slo": slo, "good": len(good), "fraction": len(good) / n if n else 0.0,
            "req_per_s": sum(1 for r in good if a <= r["end"] <= b) / wlen if wlen > 0 else None,
            "req_per_s_whole": len(good) / span if span > 0 else None,
        }  # fmt: skip
    return res


def _rates(requests: int, out_tokens: int, in_tokens: int, seconds: float) -> dict[str, float | None]:
    if seconds <= 0:
        return {"seconds": seconds, "req_per_s": None, "output_tok_per_s": None, "total_tok_per_s": None}
    return {
        "seconds": seconds, "req_per_s": requests / seconds, "output_tok_per_s": out_tokens / seconds,
        "total_tok_per_s": (out_tokens + in_tokens) / seconds,
    }  # fmt: skip


def client_health(
    records: Sequence[Record], window: tuple[float, float], load: dict[str, Any], client_cpu: float | None = None,
    client_wait: float | None = None,
) -> dict[str, Any]:
    """Is the client keeping its schedule? Schedule lag, achieved vs requested load, warnings."""
    measured = sorted((r for r in records if not r["warmup"]), key=lambda r: r["sent"])
    lag = stats(r["sent"] - r["intended"] for r in measured)
    a, b = window
    wlen = b - a
    inflight = sum(max(0.0, min(r["end"], b) - max(r["sent"], a)) for r in records)
    out: dict[str, Any] = {
        "schedule_lag": lag,
        "achieved_concurrency": inflight / wlen if wlen > 0 else None,
        "requested_concurrency": load.get("concurrency") if load.get("process") == "closed" else None,
        "achieved_rate": None, "scheduled_rate": None, "requested_rate": load.get("rate"),
        "cpu": client_cpu, "cpu_wait": client_wait, "limited": False, "warnings": [],
    }  # fmt: skip
    if len(measured) > 1:
        sent_span = measured[-1]["sent"] - measured[0]["sent"]
        intended = sorted(r["intended"] for r in measured)
        if sent_span > 0:
            out["achieved_rate"] = (len(measured) - 1) / sent_span
        if intended[-1] > intended[0]:
            out["scheduled_rate"] = (len(measured) - 1) / (intended[-1] - intended[0])
    warnings: list[str] = out["warnings"]
    open_loop = load.get("process") not in (None, "closed")
    if open_loop and lag["p99"] is not None and lag["p99"] > LAG_WARN_S:
        warnings.append(f"client schedule lag p99 {lag['p99'] * 1e3:.1f} ms > {LAG_WARN_S * 1e3:.0f} ms")
    if open_loop and out["achieved_rate"] and out["scheduled_rate"]:
        if out["achieved_rate"] < SHORTFALL * out["scheduled_rate"]:
            warnings.append(f"achieved {out['achieved_rate']:.1f} req/s of {out['scheduled_rate']:.1f} scheduled")
    req_c, got_c = out["requested_concurrency"], out["achieved_concurrency"]
    if req_c and got_c is not None and got_c < SHORTFALL * req_c and not load.get("think_time"):
        warnings.append(f"achieved concurrency {got_c:.1f} of {req_c} requested")
    if client_cpu is not None and client_cpu > 0.9:
        warnings.append(f"client process used {client_cpu:.0%} of a CPU core")
    if client_wait is not None and client_wait > 0.2:
        warnings.append(f"client waited for a free CPU {client_wait:.0%} of the time: the machine is overloaded")
    out["limited"] = bool(warnings)
    return out
