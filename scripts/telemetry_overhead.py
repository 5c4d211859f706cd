"""Measure the telemetry sampler's cost: CPU share of the client process with the sampler on vs off.

    .venv/bin/python scripts/telemetry_overhead.py [--hz 10] [--seconds 20] [-o results/telemetry_overhead.json]

The process does nothing else while measuring, so its CPU time is the sampler's (plus the idle baseline,
measured the same way with the sampler off). A busy child process stands in for the server so the
per-process queries run too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from loadgen.sidecars.telemetry import TelemetrySampler
from loadgen.timing.clock import RunClock


def cpu_share(seconds: float, hz: float | None, server_pid: int) -> dict[str, float]:
    me = psutil.Process()
    sampler = TelemetrySampler(rate_hz=hz, server_pid=server_pid) if hz else None
    with tempfile.TemporaryDirectory() as tmp:
        c0, w0 = sum(me.cpu_times()[:2]), time.perf_counter()
        if sampler:
            sampler.start(RunClock(), Path(tmp))
        time.sleep(seconds)
        if sampler:
            sampler.stop(None)
        cpu, wall = sum(me.cpu_times()[:2]) - c0, time.perf_counter() - w0
    out = {"cpu_s": cpu, "wall_s": wall, "cpu_share_pct": 100 * cpu / wall}
    if sampler:
        out["samples"] = len(sampler.records)
        out["achieved_hz"] = (len(sampler.records) - 1) / (sampler.records[-1]["t"] - sampler.records[0]["t"])
        out["cpu_ms_per_sample"] = 1000 * cpu / len(sampler.records)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("-o", "--out", type=Path, default=Path("results/telemetry_overhead.json"))
    args = ap.parse_args()
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        off = cpu_share(args.seconds, None, child.pid)
        on = cpu_share(args.seconds, args.hz, child.pid)
    finally:
        child.kill()
        child.wait()
    result = {
        "hz": args.hz, "seconds": args.seconds, "cpu_model": _cpu(), "cpu_count": psutil.cpu_count(),
        "off": off, "on": on, "overhead_pct_of_one_core": on["cpu_share_pct"] - off["cpu_share_pct"],
        "gpu_header": TelemetrySampler(rate_hz=args.hz).header,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
