"""The sidecars' series of one point for its timeline: server gauges (``server_state.jsonl``), engine steps
(``iterations.jsonl``) and telemetry (``telemetry.jsonl``), each a (t, value) pair of arrays on the run clock.

Each server's metric names are on its backend's profile (``backends.profile``); a server without one is
read by the generic name endings below.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from backends.registry import server_profiles
from loadgen.report.load import PointData, RunData
from loadgen.report.plot import pairs

# A server without a profile: names that end like these. (Each known server's names are on its profile.)
GENERIC = {"running": r"(requests_running|running_reqs|requests_processing)$",
           "waiting": r"(requests_waiting|queue_reqs|queue_size|requests_deferred)$",
           "kv": r"kv_cache_usage(_perc|_ratio)?$"}  # fmt: skip


def _family(metrics: dict[str, Any], name: str) -> float | None:
    """Sum of a metric over its label sets (keys ``name`` or ``name{a=b,...}`` as the poller writes them)."""
    vals = [v for k, v in metrics.items() if k.split("{", 1)[0] == name and isinstance(v, (int, float))]
    return float(sum(vals)) if vals else None


def server_series(point: PointData) -> dict[str, tuple[np.ndarray, np.ndarray]]:
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
                t, v = pairs(pts)
                out[role] = (t, v * 100 if role == "kv" and np.nanmax(v) <= 1.0 else v)
                break
    for used, total in [p.kv_blocks for p in profiles if p.kv_blocks]:  # a server that counts KV blocks
        pts = [(r["t"], 100 * u / tot) for r in with_metrics
               if (u := _family(r["metrics"], used)) is not None and (tot := _family(r["metrics"], total))]  # fmt: skip
        if pts and "kv" not in out:
            out["kv"] = pairs(pts)
    if "running" not in out:
        slots = [(r["t"], float(sum(1 for s in r["slots"] if s.get("busy")))) for r in rows if r.get("slots")]
        if slots:
            out["running"] = pairs(slots)
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


def iteration_arrays(point: PointData, t0_unix: float | None) -> dict[str, np.ndarray] | None:
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


def telemetry_series(point: PointData) -> dict[str, tuple[np.ndarray, np.ndarray]]:
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
    return {label: pairs(pts) for label, pts in found.items()}


GPU_ROWS = (("mem_used_b", "GPU memory used, GiB", 2.0**-30), ("power_w", "GPU power, W", 1.0),
            ("sm_clock_mhz", "GPU SM clock, MHz", 1.0))
"""NVML fields drawn as rows of their own (their units differ from a percentage): field, row title, scale."""


def gpu_series(point: PointData) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Row title -> {"GPU i": (t, value)} for each of :data:`GPU_ROWS` that some GPU sample carries."""
    found: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in point.telemetry:
        if not isinstance(r.get("t"), (int, float)):
            continue
        for i, g in enumerate(r.get("gpus") or []):
            for key, title, scale in GPU_ROWS:
                if isinstance(g, dict) and isinstance(g.get(key), (int, float)):
                    found.setdefault(title, {}).setdefault(f"GPU {g.get('index', i)}", []).append((r["t"], g[key] * scale))
    return {title: {label: pairs(pts) for label, pts in per.items()} for title, per in found.items()}


def missing_series(run: RunData, point: PointData) -> list[str]:
    """The optional series this point has no usable samples of (said on the page, not drawn empty)."""
    checks = (
        ("server state (/metrics)", bool(server_series(point))),
        ("per-iteration record", iteration_arrays(point, run.run.get("t0_unix")) is not None),
        ("telemetry", bool(telemetry_series(point))),
    )
    return [name for name, present in checks if not present]
