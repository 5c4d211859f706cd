"""How steady this host's speed is: the same float32 work timed again and again, nothing else running.

Two working sets alternate every ``--slice`` seconds so that both meet the same host conditions: ``cache``
(weights that stay in L2: the cores' own speed) and ``memory`` (64 MiB of weights streamed from RAM per pass, as
a float32 decode step streams its model). A load test on this host places a latency no better than these swing::

    python scripts/host_speed.py --seconds 300 --out /tmp/host_speed.json
    python scripts/host_speed.py --replay /tmp/host_speed.json     # the summary of a stored run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {"cache": (256, 256), "memory": (2048, 8192)}  # weight (in, out): 256 KiB and 64 MiB of float32
Series = dict[str, list[tuple[float, float]]]  # working set -> (wall time, microseconds per pass)


def timed(weight: torch.Tensor, rows: torch.Tensor, seconds: float) -> float:
    """Microseconds per pass of ``rows @ weight`` over ``seconds``."""
    start, passes = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        rows @ weight
        passes += 1
    return (time.perf_counter() - start) / passes * 1e6


def measure(seconds: float, slice_s: float) -> Series:
    work = {name: (torch.randn(n_in, n_out), torch.randn(10, n_in)) for name, (n_in, n_out) in SHAPES.items()}
    series: Series = {name: [] for name in work}
    end = time.time() + seconds
    while time.time() < end:
        for name, (weight, rows) in work.items():
            series[name].append((time.time(), timed(weight, rows, slice_s)))
    return series


def summary(series: Series) -> list[str]:
    """Per working set: the spread of its timings, of its minutes' medians, and how fast a swing fades."""
    lines, logs = [], {}
    for name, points in series.items():
        us = np.array([v for _, v in points])
        logs[name] = np.log(us)
        t0 = points[0][0]
        minutes = [statistics.median(v for t, v in points if int((t - t0) // 60) == m)
                   for m in range(int((points[-1][0] - t0) // 60) + 1)]  # fmt: skip
        step = (points[-1][0] - t0) / max(1, len(points) - 1)
        lag = next((k for k in range(1, len(us) // 2) if np.corrcoef(logs[name][:-k], logs[name][k:])[0, 1] < 0.2),
                   None)  # fmt: skip
        p = np.percentile(us, [0, 50, 90, 100])
        lines.append(f"{name:6s} {len(us)} timings, us per pass: min {p[0]:.0f} median {p[1]:.0f} p90 {p[2]:.0f} "
                     f"max {p[3]:.0f} (sd of log {logs[name].std(ddof=1):.3f}); minutes' medians "
                     f"{min(minutes):.0f}-{max(minutes):.0f}; swings last "
                     f"{'?' if lag is None else f'{lag * step:.0f}'} s (lag autocorrelation < 0.2)")
    if len(logs) == 2:
        a, b = logs.values()
        n = min(a.size, b.size)
        lines.append(f"correlation of the two working sets' log timings: {np.corrcoef(a[:n], b[:n])[0, 1]:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to measure")
    parser.add_argument("--slice", type=float, default=2.0, help="seconds per timing of one working set")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, help="write every timing here (JSON)")
    parser.add_argument("--replay", type=Path, help="summarise a stored run instead of measuring")
    args = parser.parse_args()
    if args.replay:
        series = {k: [tuple(p) for p in v] for k, v in json.loads(args.replay.read_text())["series"].items()}
    else:
        torch.set_num_threads(args.threads)
        series = measure(args.seconds, args.slice)
        if args.out:
            args.out.write_text(json.dumps({"threads": args.threads, "slice_s": args.slice, "series": series}))
    print("\n".join(summary(series)))


if __name__ == "__main__":
    main()
