"""``make scale-check``'s record: issue 38's acceptance figures and verdicts, ``scale_check.json`` as the run
goes, the time budget, the log and the table printed last."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

# Issue 38's acceptance: one home for its figures.
TARGET_WORKERS, TARGET_REQ_PER_S = 16, 10_000.0  # >= 10,000 req/s of 200-event streams with 16 workers
EFFICIENCY_WORKERS, EFFICIENCY_MIN = 8, 0.80  # scaling efficiency >= 80 % at 8 workers
OPEN_RATE, RATE_TOLERANCE, LAG_P99_MAX_MS = 10_000.0, 0.02, 5.0  # open loop 10,000/s within 2 %, lag p99 < 5 ms
NVML_TOLERANCE = 5.0  # NVML utilisation within 5 points of nvidia-smi's, every step

log = logging.getLogger("scale_check")


class Budget:
    """The run's time budget: ``left()`` seconds until its end."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """``scale_check.json``, rewritten as each part ends (verdicts included), so that a run stopped from
    outside keeps the parts it finished; parts not yet run say ``pending``."""

    def __init__(self, path: Path, machine: dict[str, Any], config: dict[str, Any]) -> None:
        self.path, self.t0 = path, time.monotonic()
        self.res: dict[str, Any] = {"machine": machine, "config": config,
                                    "parts": {name: {"status": "pending"} for name in ("nvml", "open_loop", "scaling")}}  # fmt: skip
        self.write()

    def part(self, name: str, result: dict[str, Any]) -> None:
        self.res["parts"][name] = result
        self.write()

    def write(self) -> None:
        self.res["verdicts"] = verdicts(self.res["parts"])
        self.res["accepted"] = all(v["pass"] is True for v in self.res["verdicts"].values())
        self.res["seconds"] = time.monotonic() - self.t0
        self.path.write_text(json.dumps(self.res, indent=1, default=str))


def _row(parts: dict[str, Any], workers: int) -> dict[str, Any] | None:
    rows = parts["scaling"].get("rows", [])
    return next((r for r in rows if r["workers"] == workers), None)


def verdicts(parts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 38's acceptance, each as ``{"target", "measured", "pass"}``; ``pass`` is None where its point
    was not run at its scale here (fewer workers, a lower rate, no GPU)."""
    out: dict[str, dict[str, Any]] = {}
    top = _row(parts, TARGET_WORKERS)
    got = top["req_per_s"] if top else None
    out["req_per_s_16_workers"] = {"target": f">= {TARGET_REQ_PER_S:,.0f} req/s with {TARGET_WORKERS} workers",
                                   "measured": got, "pass": None if got is None else got >= TARGET_REQ_PER_S}  # fmt: skip
    mid = _row(parts, EFFICIENCY_WORKERS)
    eff = mid["efficiency"] if mid else None
    out["efficiency_8_workers"] = {"target": f">= {EFFICIENCY_MIN:.0%} scaling efficiency at {EFFICIENCY_WORKERS} workers",
                                   "measured": eff, "pass": None if eff is None else eff >= EFFICIENCY_MIN}  # fmt: skip
    op = parts["open_loop"].get("result")
    at_scale = op is not None and op["requested_rate"] >= OPEN_RATE
    rate_err = op["achieved_rate"] / op["requested_rate"] - 1 if op and op["achieved_rate"] else None
    out["open_loop_rate"] = {"target": f"{OPEN_RATE:,.0f} req/s achieved within {RATE_TOLERANCE:.0%}",
                             "measured": rate_err,
                             "pass": (rate_err is not None and abs(rate_err) <= RATE_TOLERANCE) if at_scale else None}  # fmt: skip
    lag = op["lag_p99_ms"] if op else None
    out["open_loop_lag_p99"] = {"target": f"schedule lag p99 < {LAG_P99_MAX_MS:g} ms at {OPEN_RATE:,.0f} req/s",
                                "measured": lag, "pass": (lag is not None and lag < LAG_P99_MAX_MS) if at_scale else None}  # fmt: skip
    loads = [*parts["scaling"].get("rows", []), *([op] if op else [])]
    errors = sum(r["errors"] for r in loads) if loads else None
    out["errors"] = {"target": "0 errors", "measured": errors, "pass": None if errors is None else errors == 0}
    busiest = max((r["server_cpu_max"] for r in loads), default=None)
    out["servers_not_limit"] = {"target": "no null-server process above half a core in any point",
                                "measured": busiest, "pass": None if busiest is None else not any(r["servers_limit"] for r in loads)}  # fmt: skip
    nv = parts["nvml"]
    steps = nv.get("steps")
    worst = max((abs(s["diff"]) for s in steps if s["diff"] is not None), default=None) if steps else None
    out["nvml_vs_smi"] = {"target": f"NVML utilisation within {NVML_TOLERANCE:g} points of nvidia-smi, every step",
                          "measured": worst, "pass": all(s["within"] for s in steps) if steps else None}  # fmt: skip
    return out


def _fmt(v: Any, spec: str = ",.4g") -> str:
    return "-" if v is None else format(v, spec)


def table(res: dict[str, Any]) -> str:
    """The short plain-text table printed last: each part's status and headline, then the verdicts."""
    p = res["parts"]
    lines = [f"scale check on {res['machine']['cores']} cores, {res['seconds']:.0f} s ({res['machine']['gpu']})"]
    for r in p["scaling"].get("rows", []):
        lines.append(f"  scaling  {r['workers']:>2} workers  {r['req_per_s']:>9,.0f} req/s  efficiency "
                     f"{_fmt(r['efficiency'], '.0%')} (machine's own {_fmt(r.get('machine_speed'), '.0%')})  "
                     f"CPU/request {r['cpu_ms_per_request']:.3f} ms  errors {r['errors']}  busiest server {r['server_cpu_max']:.0%}  "
                     f"cores busy {r['cores_busy']:.1f}  point {r['point_s']:.1f} s (load {r['load_s']:.1f} s)")  # fmt: skip
    if skipped := p["scaling"].get("skipped"):
        lines.append(f"  scaling  not run (time budget): {', '.join(map(str, skipped))} workers")
    if (op := p["open_loop"].get("result")) is not None:
        lines.append(f"  open     {op['workers']:>2} workers  {_fmt(op['achieved_rate'], ',.0f')} of "
                     f"{op['requested_rate']:,.0f} req/s  lag p99 {_fmt(op['lag_p99_ms'], '.2f')} ms  errors {op['errors']}  "
                     f"busiest server {op['server_cpu_max']:.0%}  point {op['point_s']:.1f} s (load {op['load_s']:.1f} s)")  # fmt: skip
    for s in p["nvml"].get("steps", []):
        lines.append(f"  nvml     duty {s['duty']:>4.0%}  NVML {_fmt(s['nvml_util'], '.1f')} %  nvidia-smi "
                     f"{_fmt(s['smi_util'], '.1f')} %  diff {_fmt(s['diff'], '+.1f')} points")  # fmt: skip
    for name, part in p.items():
        if part["status"] != "ok":
            lines.append(f"  {name}: {part['status']}: {part.get('error') or part.get('reason')}")
    for name, v in res["verdicts"].items():
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[v["pass"]]
        lines.append(f"  {mark} {name}: {_fmt(v['measured'])} ({v['target']})")
    return "\n".join(lines)
