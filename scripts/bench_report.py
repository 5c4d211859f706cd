"""Benchmark the HTML report on a 10,000-request point: build time, file size, load time in Chromium.

    .venv/bin/python scripts/bench_report.py [--requests 10000] [--out results/bench_report]

Writes a synthetic results directory (tests/support/synthetic.py: a simulated continuous-batching server
under closed-loop load, with server-state, per-iteration and telemetry series), builds its report, opens
it in headless Chromium and writes ``bench_report.json`` beside it. Targets: load event < 5 s, < 20 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from loadgen.report import write_report
from loadgen.report.builder import plotly_js
from loadgen.report.load import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the report's test fixtures
from support.browser import inspect_report_sync  # noqa: E402
from support.synthetic import SimConfig, write_synthetic_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000, help="requests per point")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--loads", type=int, default=5, help="page loads to time")
    ap.add_argument("--out", type=Path, default=Path("results/bench_report"))
    args = ap.parse_args()

    cfg = SimConfig(concurrencies=tuple(args.concurrency), requests_per_point=args.requests, max_num_seqs=32)
    run = write_synthetic_results(args.out, "synthetic-10k", cfg)
    n_req = sum(len(read_jsonl(p)) for p in (run / "points").rglob("requests.jsonl"))
    t = time.perf_counter()
    html = write_report([run], run / "report.html")
    build_s = time.perf_counter() - t
    loads = [
        inspect_report_sync(html, args.out / "bench_report.png" if i == 0 else None)
        for i in range(args.loads)
    ]
    # the floor on this machine at this moment: a page holding nothing but plotly.js and one tiny chart
    floor_html = args.out / "plotly_only.html"
    floor_html.write_text(
        f"<!DOCTYPE html><html><body><div id=a></div><script>{plotly_js()}</script>"
        "<script>Plotly.newPlot('a', [{x: [1, 2], y: [1, 2]}])</script></body></html>"
    )
    floor = [inspect_report_sync(floor_html).load_s for _ in range(args.loads)]
    first = loads[0]
    result = {
        "command": "python scripts/bench_report.py " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
        "requests_total": n_req,
        "requests_per_point": args.requests,
        "points": len(args.concurrency),
        "report_bytes": html.stat().st_size,
        "report_mb": round(html.stat().st_size / 1e6, 2),
        "build_s": round(build_s, 2),
        "load_event_s": [round(r.load_s, 3) for r in loads],
        "load_event_s_max": round(max(r.load_s for r in loads), 3),
        "load_event_s_median": round(statistics.median(r.load_s for r in loads), 3),
        "plotly_only_page_load_s": [round(x, 3) for x in floor],
        "page_marks_ms": [{k: round(v) for k, v in r.marks.items()} for r in loads],
        "console_errors": first.console_errors,
        "network_requests": first.network_requests,
        "charts": len(first.charts),
        "charts_without_data": [
            c["fig"] for c in first.charts if not c["drawn"] or c["empty_traces"] or not c["values"]
        ],
        "host": {
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
    }
    (args.out / "bench_report.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
