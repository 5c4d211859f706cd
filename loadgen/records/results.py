"""The results directory (layout in docs/architecture.md), fingerprints and the sweep table.

``ResultsDir(root / run_id)`` owns ``run.json``, ``summary.json``, ``sweep.csv``/``sweep.parquet`` and
``points/<point_id>/``. A run killed before it wrote its summary still has its records:
:func:`read_summary` recomputes the summary from them. The environment fingerprint says what machine and software produced a run; the
config fingerprint is a hash of everything that changes the traffic or the target, so two runs with the
same hash are comparable.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from loadgen.defaults import POINT_FILE, REQUESTS_FILE, RUN_FILE, SUMMARY_FILE
from loadgen.metrics import pointsummary
from loadgen.records.writer import write_json
from workloads.contracts import read_jsonl

PACKAGES = ("servelab", "torch", "httpx", "aiohttp", "uvloop", "numpy", "pandas", "transformers")
_SECRET_KEY = re.compile(r"(api[_-]?key|authorization|token(?!izer)|secret|password)", re.I)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def fingerprint(obj: Any) -> str:
    """sha256 (first 16 hex) of the canonical JSON of ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def scrub(obj: Any) -> Any:
    """``obj`` with any value under a secret-looking key replaced (defence in depth for configs)."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if _SECRET_KEY.search(str(k)) and v else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [scrub(v) for v in obj]
    return obj


def environment() -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python, package versions, GPUs (through NVML, when present)."""
    env: dict[str, Any] = {
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": sys.version.split()[0], "hostname_hash": fingerprint(platform.node()),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }  # fmt: skip
    try:
        import psutil

        env["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    env["packages"] = versions
    from loadgen.sidecars.gpu import gpu_inventory  # here, not at the top: pynvml only for a run's header

    env["gpus"] = gpu_inventory()
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def sweep_row(summary: dict[str, Any]) -> dict[str, Any]:
    """One sweep-table row: load params, labels and metrics as flat columns (no per-class, no lists)."""
    row: dict[str, Any] = {"point_id": summary["point_id"]}
    load = summary.get("load", {})
    for key in ("process", "concurrency", "rate", "burstiness", "num_requests", "duration", "seed"):
        row[key] = load.get(key)
    row["workload"] = (summary.get("workload") or {}).get("name")
    for k, v in (summary.get("labels") or {}).items():
        row[k] = v
    row.update(leaves(summary.get("counts", {}), "n", "_", keep_lists=False))
    for name, st in summary.get("latency", {}).items():
        row.update(leaves(st, name, "_", keep_lists=False))
    for scope, thr in summary.get("throughput", {}).items():
        row.update(leaves(thr, scope, "_", keep_lists=False))
    row["error_rate"] = summary.get("errors", {}).get("rate")
    for kind, n in summary.get("errors", {}).get("by_kind", {}).items():
        row[f"errors_{kind}"] = n
    if "goodput" in summary:
        row.update(leaves({k: v for k, v in summary["goodput"].items() if k != "slo"}, "goodput", "_", keep_lists=False))
    client = summary.get("client", {})
    row.update(leaves({k: v for k, v in client.items() if k != "warnings"}, "client", "_", keep_lists=False))
    return row


def leaves(d: Any, prefix: str = "", sep: str = ".", keep_lists: bool = True) -> dict[str, Any]:
    """The one flattener of results: nested dicts -> ``{"a.b.c": value}`` (names joined with ``sep``, after
    ``prefix`` when given); a list is one value, or left out without ``keep_lists``."""
    if not isinstance(d, dict):
        return {prefix: d} if keep_lists or not isinstance(d, list) else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(leaves(v, f"{prefix}{sep}{k}" if prefix else str(k), sep, keep_lists))
    return out


def lookup(d: Any, path: Sequence[str]) -> Any:
    """The value at ``path`` (keys from the top) in nested dicts, or None where the path ends early."""
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


class ResultsDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    @property
    def run_id(self) -> str:
        return self.path.name

    def point_dir(self, point_id: str) -> Path:
        d = self.path / "points" / point_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def write_run(self, config: dict[str, Any], t0_unix: float, point_ids: list[str],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        config, extra = scrub(config), scrub(extra or {})
        run = {
            "run_id": self.run_id, "config": config, "environment": environment(),
            # what makes runs comparable: the config plus the workload specs it resolved to (not the
            # embedded server's random port)
            "fingerprint": fingerprint({"config": config, "workloads": extra.get("workloads")}),
            "t0_unix": t0_unix, "points": point_ids,
            **extra,
        }  # fmt: skip
        write_json(self.path / RUN_FILE, run)
        return run

    def write_summary(self, run: dict[str, Any], points: list[dict[str, Any]]) -> None:
        """Top summary.json plus sweep.csv/.parquet; called after every point so a crash keeps them."""
        top = {k: run[k] for k in ("run_id", "config", "environment", "fingerprint")} | {"points": points}
        write_json(self.path / SUMMARY_FILE, top)
        df = pd.DataFrame([sweep_row(p) for p in points])
        df.to_csv(self.path / "sweep.csv", index=False)
        df.to_parquet(self.path / "sweep.parquet", index=False)


def read_summary(run_dir: Path) -> tuple[dict[str, Any], bool]:
    """A run's top summary and whether it had to be recomputed.

    ``summary.json`` when there is one; else (a run killed before it wrote it) one PointSummary per
    ``points/**/requests.jsonl``: the point's own ``summary.json`` when it has one, else the metrics
    recomputed from its records, with the load from the ``point.json`` written when the point started
    and ``status`` ``interrupted``. Raises FileNotFoundError when there are no records either."""
    top = run_dir / SUMMARY_FILE
    if top.is_file():
        return json.loads(top.read_text(encoding="utf-8")), False
    files = sorted((run_dir / "points").rglob(REQUESTS_FILE)) if (run_dir / "points").is_dir() else []
    if not files:
        raise FileNotFoundError(f"{run_dir}: neither summary.json nor points/*/requests.jsonl: not a results directory")
    run = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8")) if (run_dir / RUN_FILE).is_file() else {}
    order = {pid: i for i, pid in enumerate(run.get("points") or [])}
    points = [_point_summary(f.parent, f.parent.relative_to(run_dir / "points").as_posix()) for f in files]
    points.sort(key=lambda p: (order.get(p["point_id"], len(order)), p["point_id"]))
    top_doc = {k: run.get(k) for k in ("run_id", "config", "environment", "fingerprint")}
    top_doc["run_id"] = top_doc["run_id"] or run_dir.name
    return top_doc | {"points": points, "recomputed": "from requests.jsonl (the run wrote no summary.json)"}, True


def _point_summary(point_dir: Path, point_id: str) -> dict[str, Any]:
    if (point_dir / SUMMARY_FILE).is_file():
        return dict(json.loads((point_dir / SUMMARY_FILE).read_text(encoding="utf-8")))
    plan = json.loads((point_dir / POINT_FILE).read_text()) if (point_dir / POINT_FILE).is_file() else {}
    records = read_jsonl(point_dir / REQUESTS_FILE)
    cancelled = sum(1 for r in records if (r["error"] or {}).get("kind") == "cancelled")
    summary: dict[str, Any] = {
        "point_id": plan.get("point_id", point_id), "load": plan.get("load", {}), "workload": plan.get("workload", {}),
        "labels": plan.get("labels", {}), "t_start": plan.get("t_start"), "status": "interrupted",
        "interrupted": {"signal": None, "finished": len(records) - cancelled, "cancelled": cancelled,
                        "t_rel": None, "note": "recomputed from requests.jsonl: the run ended without a summary"},
    }  # fmt: skip
    summary.update(pointsummary.summarize(records, plan.get("load")))
    return summary
