"""Defaults that several commands and layers share, in one place; this module imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

REQUEST_TIMEOUT_S = 600.0  # a request's whole response (--timeout)
STALL_TIMEOUT_S = 60.0  # the longest silence within a response (--stall-timeout)
RESULTS_ROOT = Path("results")  # where runs go (--output-dir)

# the files of a results directory (their contents: docs/architecture.md)
RUN_FILE = "run.json"  # the run's configuration, environment and fingerprint
SUMMARY_FILE = "summary.json"  # the run's (or a point's) summary
POINT_FILE = "point.json"  # a point's plan, written as it starts
REQUESTS_FILE = "requests.jsonl"  # a point's per-request records
REPORT_FILE = "report.html"
CAPACITY_FILE = "capacity.json"  # a `bench capacity` result (its report: capacity.html)
