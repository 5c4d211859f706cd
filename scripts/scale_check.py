"""The load generator at a many-core machine's scale, and the NVML sampler against ``nvidia-smi`` (issue 38).

    PYTHONPATH=. python scripts/scale_check.py --full --out DIR     # the 16-core GPU machine (~3.5 min)
    PYTHONPATH=. python scripts/scale_check.py --out DIR            # rehearsal sizes (any machine)
    make scale-check OUT=DIR [SCALE=--full] [PY=python3]          # scripts/gpu_run.sh: the carried wheels first

Three parts, each isolated (a part that fails is recorded with its error and the others still run), in
this order, under one time budget (``--budget``; a part that would start past it is recorded as not run):

- **nvml**: a torch CUDA matmul loop keeps GPU 0 busy at set duty cycles (``--duty``, ``--step-s`` seconds
  each) while the project's NVML module (:mod:`loadgen.sidecars.gpu`) samples it at 10 Hz and
  ``nvidia-smi --query-gpu=timestamp,utilization.gpu -lms 100`` reads it beside; per step, the mean
  utilisation of each over the step (its first second left out: the counter averages over a window) and
  their difference. Without a GPU, ``nvidia-smi`` or CUDA it is recorded as not run, with the reason.
- **open_loop**: :func:`loadgen.experiments.calibrate.open_loop`, Poisson arrivals at ``--rate`` for ``--duration``
  seconds over ``--open-workers`` workers: achieved rate, schedule lag, errors.
- **scaling**: :func:`loadgen.experiments.calibrate.scaling`, ``bench calibrate``'s closed-loop ceiling (c =
  ``--concurrency`` streams of ``--events`` events) per ``--workers`` count, each point ending after
  ``--requests`` requests or ``--max-point-s`` seconds; beside each count, :func:`machine_speed`: how fast
  one core runs with that many busy (the ceiling of any client's efficiency on this machine).

Both load parts run against one :class:`loadgen.experiments.calibrate.NullTarget`: ``--servers`` null-server processes on
one port (default :func:`loadgen.experiments.calibrate.servers_for` the largest worker count); every point reports its
busiest server process, and the ``servers_not_limit`` verdict says none passed half a core.

Writes ``DIR/scale_check.json`` (machine, configuration, each part's result, the acceptance verdicts of
issue 38; rewritten as each part ends, so a run stopped from outside keeps what it finished) and
``DIR/scale_check.log``, and prints a short table last. The load points' own results (records,
summaries) go to a temporary directory that is removed at the end (``--keep-points DIR`` keeps them).
Exit 0 when every part ran, 1 when a part failed (an unmet verdict is not a failure of the script).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from scale_check_nvml import DUTY, nvml_part
from scale_check_report import OPEN_RATE, Budget, Report, log, table

from loadgen.dispatch.signals import run_async
from loadgen.experiments.calibrate import NullTarget, open_loop, scaling, servers_for
from loadgen.sidecars.gpu import host_gpus

SIZES = {  # --full: the 16-core GPU machine, ~3.5 min in all; rehearsal: small counts for any machine
    "full": {"workers": "1,2,4,8,16", "requests": None, "max_point_s": 6.0, "concurrency": 512, "events": 200,
             "rate": OPEN_RATE, "duration": 6.0, "open_workers": 16, "step_s": 4.0, "budget": 200.0},
    "rehearsal": {"workers": "1,2", "requests": 2000, "max_point_s": 10.0, "concurrency": 64, "events": 200,
                  "rate": 200.0, "duration": 3.0, "open_workers": 2, "step_s": 2.0, "budget": 150.0},
}  # fmt: skip


async def _part(name: str, budget: Budget, make: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Run one part: its result with ``status`` and ``seconds``; an error (or the budget running out) is
    recorded, not raised."""
    if budget.left() <= 0:
        return {"status": "not run", "reason": "the time budget was spent before it"}
    t = time.monotonic()
    log.info("%s: start (%.0f s of budget left)", name, budget.left())
    try:
        res = {"status": "ok", **await asyncio.wait_for(make(), budget.left())}
    except asyncio.TimeoutError:
        res = {"status": "error", "error": "stopped: the time budget ran out"}
    except Exception as exc:
        log.error("%s failed:\n%s", name, traceback.format_exc())
        res = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    res["seconds"] = time.monotonic() - t
    log.info("%s: %s in %.1f s", name, res["status"], res["seconds"])
    return res


async def load_parts(a: argparse.Namespace, workers: list[int], points: Path, budget: Budget, report: Report) -> None:
    """The open-loop and scaling parts against one set of null-server processes, into ``report``."""
    servers = a.servers or servers_for(max(*workers, a.open_workers))
    try:
        with NullTarget(a.events, "aiohttp", servers) as target:  # each part records its own errors
            report.part("open_loop", {**await _part("open_loop", budget, lambda: _open(target, a, points)),
                                      "servers": servers})  # fmt: skip
            report.part("scaling", {**await _part("scaling", budget, lambda: _scaling(target, a, workers, points, budget)),
                                    "servers": servers})  # fmt: skip
    except Exception as exc:
        log.error("null servers failed:\n%s", traceback.format_exc())
        for name in ("open_loop", "scaling"):
            if report.res["parts"][name]["status"] == "pending":
                report.part(name, {"status": "error", "error": f"null servers: {type(exc).__name__}: {exc}",
                                   "servers": servers})  # fmt: skip


async def _open(target: NullTarget, a: argparse.Namespace, points: Path) -> dict[str, Any]:
    return {"result": await open_loop(target, points / "open", a.rate, a.duration, a.open_workers)}


async def _scaling(target: NullTarget, a: argparse.Namespace, workers: list[int], points: Path,
                   budget: Budget) -> dict[str, Any]:  # fmt: skip
    until = budget.end - 2 * a.max_point_s  # a count starts only with time to finish
    rows = await scaling(target, points, a.concurrency, a.requests, workers, max_s=a.max_point_s, until=until)
    speed = machine_speed([r["workers"] for r in rows])
    for r in rows:  # the client's efficiency beside what the machine itself gives n busy processes
        r["machine_speed"] = speed[r["workers"]] / speed[rows[0]["workers"]]
        r["efficiency_vs_machine"] = r["efficiency"] / r["machine_speed"] if r["efficiency"] is not None else None
    ran = {r["workers"] for r in rows}
    return {"rows": rows, "skipped": [n for n in workers if n not in ran]}


SPIN = """import sys, time
start, end = float(sys.argv[1]), float(sys.argv[2])
while time.time() < start:
    pass
n = 0
while time.time() < end:
    for _ in range(1000):
        n += 1
print(n)"""


def machine_speed(counts: list[int], seconds: float = 1.0) -> dict[int, float]:
    """Pure-Python loop iterations per second per process with ``n`` processes spinning at once, for each
    ``n`` in ``counts``: a many-core machine runs each core slower when many are busy (turbo frequency,
    shared caches, a VM's host), which bounds any client's scaling efficiency there."""
    out = {}
    for n in counts:
        start = time.time() + 0.5  # all start together, after their interpreters are up
        procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(start), str(start + seconds)], stdout=subprocess.PIPE)
                 for _ in range(n)]  # fmt: skip
        rates = [int(p.communicate()[0]) / seconds for p in procs]
        out[n] = sum(rates) / n
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/scale_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for scale_check.json and scale_check.log")
    ap.add_argument("--full", action="store_true", help="the 16-core GPU machine's sizes (default: rehearsal)")
    ap.add_argument("--workers", help="closed-loop worker counts, e.g. 1,2,4,8,16")
    ap.add_argument("--requests", type=int, help="closed-loop measured requests per worker count (--full: none, each "
                    "point runs --max-point-s: a request count split over the workers ends them at different times)")
    ap.add_argument("--max-point-s", type=float, help="closed-loop point's longest measured phase, s")
    ap.add_argument("--concurrency", type=int, help="closed-loop concurrency (streams in flight)")
    ap.add_argument("--events", type=int, help="stream events per response")
    ap.add_argument("--rate", type=float, help="open-loop Poisson rate, req/s")
    ap.add_argument("--duration", type=float, help="open-loop seconds")
    ap.add_argument("--open-workers", type=int, help="open-loop workers")
    ap.add_argument("--servers", type=int, help="null-server processes (default: one per worker)")
    ap.add_argument("--duty", default=DUTY, help="GPU duty-cycle steps, fractions")
    ap.add_argument("--step-s", type=float, help="seconds per duty-cycle step")
    ap.add_argument("--budget", type=float, help="time budget for all parts, s")
    ap.add_argument("--keep-points", type=Path, help="keep the load points' results (records, summaries) here")
    a = ap.parse_args(argv)
    for key, value in SIZES["full" if a.full else "rehearsal"].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def _cgroup_cpu() -> str | None:
    """The cgroup v2 CPU quota (``cpu.max``: "max 100000" when none), or None where there is no such file: a
    container may be given fewer cores than ``os.cpu_count()`` shows."""
    try:
        return Path("/sys/fs/cgroup/cpu.max").read_text().strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    workers = [int(x) for x in a.workers.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(a.out / "scale_check.log", mode="w"), logging.StreamHandler()])  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the null servers' health checks
    budget = Budget(a.budget)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    log.info("configuration: %s", config)
    machine = {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cgroup_cpu_max": _cgroup_cpu(),
               "python": platform.python_version(), "host": platform.node(), "load_average_start": os.getloadavg(),
               "gpu": host_gpus()[1]}  # fmt: skip
    report = Report(a.out / "scale_check.json", machine, config)
    t = time.monotonic()
    try:
        nvml = nvml_part([float(x) for x in a.duty.split(",")], a.step_s, budget)
    except Exception as exc:
        log.error("nvml failed:\n%s", traceback.format_exc())
        nvml = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    nvml["seconds"] = time.monotonic() - t
    log.info("nvml: %s (%s)", nvml["status"], nvml.get("reason") or nvml.get("error") or f"{nvml['seconds']:.1f} s")
    report.part("nvml", nvml)
    points = a.keep_points or Path(tempfile.mkdtemp(prefix="scale-check-"))
    try:
        run_async(load_parts(a, workers, points, budget, report))
    finally:
        if a.keep_points is None:
            shutil.rmtree(points, ignore_errors=True)
    machine["load_average_end"] = os.getloadavg()
    report.write()
    log.info("wrote %s", report.path)
    print(table(report.res), flush=True)
    return 1 if any(p["status"] == "error" for p in report.res["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
