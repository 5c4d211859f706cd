"""``bench trace``: one run's requests, engine steps and server/host series on one zoomable timeline.

Writes the Chrome JSON Trace Event Format (the format both ui.perfetto.dev and chrome://tracing open; a
``.json.gz`` name is gzipped). Everything is on the run clock (``ts`` = run-clock seconds x 1e6, µs), so
points follow each other as they ran. Per point, one trace process with:

* client slot tracks ``slot N``: one ``request`` slice per request (intended send -> end) holding
  ``queued`` (intended -> sent, open loop only), ``waiting for first token`` (sent -> first content) and
  ``streaming`` (first content -> end) slices, and one ``tokens`` instant per streamed chunk whose args
  carry the chunk's token count and the running total; requests are packed onto the fewest slots;
* an ``engine steps`` track from ``iterations.jsonl`` (the reference server's ``/v1/iterations``): one
  slice per step with batch size, prefill/decode tokens, preemptions, KV blocks;
* counter tracks: client in-flight; KV blocks used and running/waiting (engine steps); every gauge the
  server's ``/metrics`` exported (``server_state.jsonl``) and busy ``/slots`` (llama.cpp); host CPU and
  memory, server process CPU/RSS and per-GPU utilisation, memory and power (``telemetry.jsonl``).

:func:`check` enforces the rules a JSON trace importer relies on (phases, fields, slices nested per track).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from loadgen.defaults import REQUESTS_FILE, RUN_FILE
from workloads.contracts import read_jsonl

US = 1e6  # trace timestamps are microseconds
_SLICE_COLORS = {"queued": "grey", "waiting for first token": "yellow", "streaming": "good"}
_COUNTER_SUFFIXES = ("_total", "_sum", "_count", "_created")  # monotonic: left out of the gauge tracks
_GAUGE_TELEMETRY = {"server_cpu_pct": "server process CPU %", "client_cpu_pct": "client process CPU %"}


def _us(t: float) -> float:
    return round(t * US, 3)


class _Builder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def meta(self, pid: int, name: str, tid: int | None = None, sort: int | None = None) -> None:
        kind = "process" if tid is None else "thread"
        ids = {"pid": pid} | ({} if tid is None else {"tid": tid})
        self.events.append({"ph": "M", "name": f"{kind}_name", **ids, "args": {"name": name}})
        if sort is not None:
            self.events.append({"ph": "M", "name": f"{kind}_sort_index", **ids, "args": {"sort_index": sort}})

    def slice(self, pid: int, tid: int, name: str, t0: float, t1: float, args: dict[str, Any] | None = None,
              cat: str = "request") -> None:  # fmt: skip
        ev: dict[str, Any] = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": _us(t0),
                              "dur": max(0.0, round(_us(t1) - _us(t0), 3))}  # fmt: skip
        if args:
            ev["args"] = args
        if name in _SLICE_COLORS:
            ev["cname"] = _SLICE_COLORS[name]
        self.events.append(ev)

    def instant(self, pid: int, tid: int, name: str, t: float, args: dict[str, Any]) -> None:
        self.events.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": name, "cat": "token",
                            "ts": _us(t), "args": args})  # fmt: skip

    def counter(self, pid: int, name: str, t: float, values: dict[str, float]) -> None:
        self.events.append({"ph": "C", "pid": pid, "name": name, "ts": _us(t), "args": values})


def _lanes(records: list[dict[str, Any]]) -> list[int]:
    """A slot per request: the lowest slot free at its start (fewest tracks, no overlap on one track)."""
    free_at: list[float] = []
    out = []
    for r in records:
        start = min(r["intended"] or r["sent"], r["sent"])
        lane = next((i for i, t in enumerate(free_at) if t <= start), len(free_at))
        if lane == len(free_at):
            free_at.append(0.0)
        free_at[lane] = r["end"]
        out.append(lane)
    return out


def _requests(b: _Builder, pid: int, records: list[dict[str, Any]], tokens: bool) -> dict[str, int]:
    records = sorted(records, key=lambda r: (min(r["intended"] or r["sent"], r["sent"]), r["sent"]))
    lanes = _lanes(records)
    for lane in sorted(set(lanes)):
        b.meta(pid, f"slot {lane}", tid=10 + lane, sort=10 + lane)
    counts = {"requests": 0, "tokens": 0}
    edges: list[tuple[float, int]] = []
    for r, lane in zip(records, lanes, strict=True):
        tid = 10 + lane
        start = min(r["intended"] or r["sent"], r["sent"])
        err = r.get("error")
        name = "request" if err is None else f"request ({err['kind']})"
        args = {"id": r["id"], "class": r["cls"], "warmup": r["warmup"], "prompt_tokens": r["prompt_tokens"],
                "output_tokens": r["output_tokens"], "finish_reason": r["finish_reason"], "status": r["status"]}  # fmt: skip
        if err is not None:
            args["error"] = f"{err['kind']}: {err['message']}"
        b.slice(pid, tid, name, start, r["end"], args)
        counts["requests"] += 1
        edges += [(start, 1), (r["end"], -1)]
        events = [e for e in r["events"] if e[0] is not None]
        first = events[0][0] if events else None
        if r["sent"] > start:
            b.slice(pid, tid, "queued", start, r["sent"], {"schedule lag ms": round((r["sent"] - start) * 1e3, 3)})
        b.slice(pid, tid, "waiting for first token", r["sent"], first if first is not None else r["end"])
        if first is not None:
            b.slice(pid, tid, "streaming", first, r["end"], {"chunks": len(events)})
        total = 0
        for t, n in events if tokens else ():
            total += int(n or 0)
            b.instant(pid, tid, "tokens", t, {"tokens": n, "total": total})
            counts["tokens"] += 1
    inflight = 0
    for t, d in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts at equal times
        inflight += d
        b.counter(pid, "client in-flight", t, {"requests": inflight})
    return counts


def _iterations(b: _Builder, pid: int, its: list[dict[str, Any]]) -> int:
    if its:
        b.meta(pid, "engine steps", tid=1, sort=1)
    for r in its:
        t0 = r["t"]
        t1 = t0 + max(0.0, r.get("t_end_unix", r["t_unix"]) - r["t_unix"])
        kind = "prefill+decode" if r["prefill_tokens"] and r["decode_tokens"] else (
            "prefill" if r["prefill_tokens"] else "decode")  # fmt: skip
        args = {"step": r["i"], "batch size": len(r["seq_ids"]), "prefill tokens": r["prefill_tokens"],
                "decode tokens": r["decode_tokens"], "preempted": len(r["preempted"]),
                "kv blocks used": r["kv_blocks_used"], "padding tokens": r.get("padding_tokens", 0)}  # fmt: skip
        args |= {k: v for k, v in r.items() if k.startswith("spec") and isinstance(v, (int, float))}
        b.slice(pid, 1, kind, t0, t1, args, cat="engine")
        b.counter(pid, "KV blocks used", t0, {"used": r["kv_blocks_used"], "total": r["kv_blocks_total"]})
        b.counter(pid, "engine requests", t0, {"running": r["num_running"], "waiting": r["num_waiting"]})
    return len(its)


def _server_state(b: _Builder, pid: int, samples: list[dict[str, Any]]) -> int:
    n = 0
    for s in samples:
        for key, value in (s.get("metrics") or {}).items():
            if not key.split("{")[0].endswith(_COUNTER_SUFFIXES):
                b.counter(pid, f"server {key}", s["t"], {"value": value})
                n += 1
        if "slots" in s:
            b.counter(pid, "server /slots busy", s["t"], {"busy": sum(1 for x in s["slots"] if x.get("busy"))})
            n += 1
    return n


def _telemetry(b: _Builder, pid: int, samples: list[dict[str, Any]]) -> int:
    n = 0
    for s in samples:
        t = s["t"]
        if s.get("cpu_pct"):
            b.counter(pid, "host CPU %", t, {"mean of cores": round(sum(s["cpu_pct"]) / len(s["cpu_pct"]), 2)})
            n += 1
        if "mem_used_b" in s:
            b.counter(pid, "host memory GiB", t, {"used": round(s["mem_used_b"] / 2**30, 3)})
            n += 1
        if "server_rss_b" in s:
            b.counter(pid, "server process RSS GiB", t, {"rss": round(s["server_rss_b"] / 2**30, 3)})
            n += 1
        for key, name in _GAUGE_TELEMETRY.items():
            if s.get(key) is not None:
                b.counter(pid, name, t, {"value": s[key]})
                n += 1
        for g in s.get("gpus") or []:
            for key, label in (("util", "util %"), ("mem_used_b", "memory GiB"), ("power_w", "power W")):
                if g.get(key) is not None:
                    v = g[key] / 2**30 if key == "mem_used_b" else g[key]
                    b.counter(pid, f"GPU {g.get('index', 0)} {label}", t, {"value": round(v, 3)})
                    n += 1
    return n


def build_trace(
    results_dir: Path, points: list[str] | None = None, tokens: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The trace of a results directory (all points, or those named) and per-point counts of what is in it;
    ``tokens=False`` leaves out the per-chunk instants (the bulk of a long run's trace)."""
    root = results_dir / "points"
    if not root.is_dir():
        raise FileNotFoundError(f"{results_dir} has no points/ directory (is it a bench run/sweep results dir?)")
    found = {p.parent.relative_to(root).as_posix() for p in root.rglob(REQUESTS_FILE)}
    run = results_dir / RUN_FILE
    listed = json.loads(run.read_text()).get("points", []) if run.exists() else []
    ids = [i for i in listed if i in found] + sorted(found - set(listed))  # in run order
    dirs = [root / i for i in ids]
    if points:
        missing = sorted(set(points) - set(ids))
        if missing:
            raise KeyError(f"no such point(s): {', '.join(missing)}; points here: {', '.join(ids)}")
    b = _Builder()
    counts: dict[str, Any] = {}
    for pid, (point_id, d) in enumerate(zip(ids, dirs, strict=True), start=1):
        if points and point_id not in points:
            continue
        b.meta(pid, f"point {point_id}", sort=pid)
        c = _requests(b, pid, read_jsonl(d / REQUESTS_FILE), tokens)
        c["engine_steps"] = _iterations(b, pid, read_jsonl(d / "iterations.jsonl", missing_ok=True))
        c["server_samples"] = _server_state(b, pid, read_jsonl(d / "server_state.jsonl", missing_ok=True))
        c["telemetry_samples"] = _telemetry(b, pid, read_jsonl(d / "telemetry.jsonl", missing_ok=True))
        counts[point_id] = c
    meta = {"source": "servelab bench trace", "results_dir": str(results_dir), "clock": "run clock, µs",
            "points": list(counts)}  # fmt: skip
    return {"traceEvents": b.events, "displayTimeUnit": "ms", "metadata": meta}, counts


def check(trace: dict[str, Any]) -> None:
    """Raise ValueError unless ``trace`` follows the JSON Trace Event Format as importers read it: known
    phases with their fields, numeric non-negative times, numeric counter values, and complete slices on
    one (pid, tid) track nested (a slice that starts inside another ends inside it)."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("traceEvents is not a list")
    stacks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for i, ev in enumerate(events):
        ph = ev.get("ph")
        need = {"M": ("name", "pid", "args"), "X": ("name", "pid", "tid", "ts", "dur"),
                "i": ("name", "pid", "tid", "ts", "s"), "C": ("name", "pid", "ts", "args")}.get(ph)  # fmt: skip
        if need is None:
            raise ValueError(f"event {i}: unexpected phase {ph!r}")
        if missing := [k for k in need if k not in ev]:
            raise ValueError(f"event {i} ({ph}): missing {missing}")
        if not isinstance(ev["pid"], int) or ("tid" in ev and not isinstance(ev["tid"], int)):
            raise ValueError(f"event {i}: pid/tid must be integers")
        for k in ("ts", "dur"):
            if k in ev and (not isinstance(ev[k], (int, float)) or ev[k] < 0):
                raise ValueError(f"event {i}: {k} must be a number >= 0, got {ev[k]!r}")
        if ph == "C" and not all(isinstance(v, (int, float)) for v in ev["args"].values()):
            raise ValueError(f"event {i}: counter values must be numbers: {ev['args']}")
        if ph == "X":
            stacks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for track, slices in stacks.items():
        open_: list[dict[str, Any]] = []
        for ev in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while open_ and ev["ts"] >= open_[-1]["ts"] + open_[-1]["dur"] - 1e-3:  # ends touch: siblings
                open_.pop()
            if open_ and ev["ts"] + ev["dur"] > open_[-1]["ts"] + open_[-1]["dur"] + 1e-3:
                raise ValueError(f"track {track}: {ev['name']} at {ev['ts']} overlaps {open_[-1]['name']} "
                                 "without nesting in it")  # fmt: skip
            open_.append(ev)


def write_trace(trace: dict[str, Any], out: Path) -> None:
    data = json.dumps(trace, separators=(",", ":")).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(data) if out.name.endswith(".gz") else data)
