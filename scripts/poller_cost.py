"""Measure what the server-state poller costs a server under load: its decode steps with the poller on vs off.

    bench run --url URL --workload chat-short --concurrency 3 --duration 500 --poll-hz 0 --telemetry-hz 0 &
    .venv/bin/python scripts/poller_cost.py --url URL --hz 2 [--window 20] [--seconds 440] [-o FILE]

Beside a load that runs no sidecars of its own, the real poller (:class:`ServerStatePoller`) runs in every
other window of ``--window`` seconds. The server's own iteration log (``/v1/iterations``: the reference
server) gives the time of every decode step; each window's median step at the batch size most steps ran
is compared with the mean of its neighbouring windows of the other kind, so a drift of the host over minutes
cancels. Also reports the poller's CPU per scrape in this process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from backends.profile import DEFAULT_PROFILE
from loadgen.sidecars.poller import ServerStatePoller, iteration_records
from loadgen.timing.clock import RunClock


def windows(url: str, hz: float, window_s: float, seconds: float) -> tuple[list[dict[str, Any]], float]:
    """Alternate poller-on and poller-off windows; their unix bounds, and the poller's CPU per scrape."""
    profile = dataclasses.replace(DEFAULT_PROFILE, iterations_path=None)  # no log fetch inside a window
    out: list[dict[str, Any]] = []
    cpu, scrapes, on, t_end = 0.0, 0, True, time.time() + seconds
    with tempfile.TemporaryDirectory() as tmp:
        while time.time() < t_end:
            a, c0 = time.time(), time.process_time()
            if on:
                poller = ServerStatePoller(url, profile, hz)
                poller.start(RunClock(), Path(tmp))
                time.sleep(window_s)
                poller.stop(None)
                cpu, scrapes = cpu + time.process_time() - c0, scrapes + len(poller.records)
            else:
                time.sleep(window_s)
            out.append({"on": on, "a": a, "b": time.time()})
            on = not on
    return out, cpu / max(scrapes, 1)


def compare(wins: list[dict[str, Any]], recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each window's median decode step (ms) at the usual batch size; on vs the neighbouring off windows."""
    decode = [r for r in recs if r["prefill_tokens"] == 0 and r["num_running"] > 0]
    if not decode:
        raise SystemExit("no decode steps in the server's iteration log: is a load running against it?")
    batch = Counter(r["num_running"] for r in decode).most_common(1)[0][0]
    for w in wins:  # the first second of a window still holds the other kind's last scrape
        steps = [r["t_end_unix"] - r["t_unix"] for r in decode
                 if r["num_running"] == batch and w["a"] + 1 <= r["t_unix"] < w["b"]]  # fmt: skip
        w["steps"], w["median_ms"] = len(steps), 1e3 * statistics.median(steps) if steps else None
    rel = []
    for i, w in enumerate(wins):
        near = [wins[j]["median_ms"] for j in (i - 1, i + 1) if 0 <= j < len(wins) and wins[j]["on"]]
        if not w["on"] and w["median_ms"] and near and None not in near:
            rel.append(statistics.fmean(near) / w["median_ms"] - 1)
    if len(rel) < 2:
        raise SystemExit(f"{len(rel)} off windows with steps at batch {batch} on both sides: run longer (--seconds)")
    return {"batch": batch, "windows": wins, "slowdown_pct": 100 * statistics.fmean(rel),
            "slowdown_se_pct": 100 * statistics.stdev(rel) / len(rel) ** 0.5, "pairs": len(rel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--hz", type=float, default=2.0)
    ap.add_argument("--window", type=float, default=20.0, help="seconds per on or off window")
    ap.add_argument("--seconds", type=float, default=440.0)
    ap.add_argument("-o", "--out", type=Path, default=Path("results/poller_cost.json"))
    args = ap.parse_args()
    wins, cpu_per_scrape = windows(args.url, args.hz, args.window, args.seconds)
    with httpx.Client(base_url=args.url, timeout=30) as client:
        log = iteration_records(client, DEFAULT_PROFILE.iterations_path or "")
    result = {"url": args.url, "hz": args.hz, "window_s": args.window, "client_cpu_ms_per_scrape":
              1e3 * cpu_per_scrape, **compare(wins, log)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.hz:g} Hz: decode step at batch {result['batch']} {result['slowdown_pct']:+.1f} % "
          f"(se {result['slowdown_se_pct']:.1f} %, {result['pairs']} off windows) with the poller on; "
          f"client CPU {result['client_cpu_ms_per_scrape']:.2f} ms per scrape -> {args.out}")


if __name__ == "__main__":
    main()
