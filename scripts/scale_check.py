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
- **open_loop**: :func:`loadgen.calibrate.open_loop`, Poisson arrivals at ``--rate`` for ``--duration``
  seconds over ``--open-workers`` workers: achieved rate, schedule lag, errors.
- **scaling**: :func:`loadgen.calibrate.scaling`, ``bench calibrate``'s closed-loop ceiling (c =
  ``--concurrency`` streams of ``--events`` events) per ``--workers`` count, each point ending after
  ``--requests`` requests or ``--max-point-s`` seconds; beside each count, :func:`machine_speed`: how fast
  one core runs with that many busy (the ceiling of any client's efficiency on this machine).

Both load parts run against one :class:`loadgen.calibrate.NullTarget`: ``--servers`` null-server processes on
one port (default :func:`loadgen.calibrate.servers_for` the largest worker count); every point reports its
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
import contextlib
import csv
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from loadgen.calibrate import NullTarget, open_loop, scaling, servers_for
from loadgen.engine import run_async
from loadgen.sidecars.gpu import host_gpus

# Issue 38's acceptance: one home for its figures.
TARGET_WORKERS, TARGET_REQ_PER_S = 16, 10_000.0  # >= 10,000 req/s of 200-event streams with 16 workers
EFFICIENCY_WORKERS, EFFICIENCY_MIN = 8, 0.80  # scaling efficiency >= 80 % at 8 workers
OPEN_RATE, RATE_TOLERANCE, LAG_P99_MAX_MS = 10_000.0, 0.02, 5.0  # open loop 10,000/s within 2 %, lag p99 < 5 ms
NVML_TOLERANCE = 5.0  # NVML utilisation within 5 points of nvidia-smi's, every step

SIZES = {  # --full: the 16-core GPU machine, ~3.5 min in all; rehearsal: small counts for any machine
    "full": {"workers": "1,2,4,8,16", "requests": None, "max_point_s": 6.0, "concurrency": 512, "events": 200,
             "rate": OPEN_RATE, "duration": 6.0, "open_workers": 16, "step_s": 4.0, "budget": 200.0},
    "rehearsal": {"workers": "1,2", "requests": 2000, "max_point_s": 10.0, "concurrency": 64, "events": 200,
                  "rate": 200.0, "duration": 3.0, "open_workers": 2, "step_s": 2.0, "budget": 150.0},
}  # fmt: skip
DUTY = "0,0.25,0.5,0.75,1"  # duty-cycle steps of the GPU load
SETTLE_S = 1.0  # the start of each step left out of its means: NVML's utilisation averages over a window
SAMPLE_S = 0.1  # NVML sampler and nvidia-smi loop period
DUTY_PERIOD_S = 0.1  # the GPU load is busy for duty x this, then idle for the rest, over and over
MATMUL_N = 4096  # the load's square bf16 matmul (~0.2-0.3 ms on an H100: fine steps of busy time)
SMI_QUERY = "timestamp,utilization.gpu"
SMI_TIME = "%Y/%m/%d %H:%M:%S.%f"

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


# ---- the NVML part -------------------------------------------------------------------------------------


def parse_smi(text: str) -> list[tuple[float, float]]:
    """(Unix time, utilisation %) of each reading in ``nvidia-smi --query-gpu=timestamp,utilization.gpu
    --format=csv,noheader,nounits`` output (the timestamp is the machine's local time). Lines that are not a
    reading (a header, ``[N/A]``, a torn last line) are left out."""
    out = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        try:
            out.append((datetime.strptime(row[0], SMI_TIME).timestamp(), float(row[1])))
        except (IndexError, ValueError):
            continue
    return out


def compare_steps(
    steps: list[tuple[float, float, float]], nvml: list[tuple[float, float]], smi: list[tuple[float, float]],
    settle: float = SETTLE_S,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per duty-cycle step ``(duty, start, end)`` (Unix times): the mean utilisation of the NVML samples and
    of the nvidia-smi readings (``(time, %)``) in ``[start + settle, end]``, their difference (NVML minus
    nvidia-smi, points) and whether it is within :data:`NVML_TOLERANCE` (False when a side has no reading)."""
    rows = []
    for duty, start, end in steps:
        means = []
        for samples in (nvml, smi):
            got = [u for t, u in samples if start + settle <= t <= end]
            means.append((sum(got) / len(got) if got else None, len(got)))
        (a, na), (b, nb) = means
        diff = a - b if a is not None and b is not None else None
        rows.append({"duty": duty, "nvml_util": a, "smi_util": b, "diff": diff, "n_nvml": na, "n_smi": nb,
                     "within": diff is not None and abs(diff) <= NVML_TOLERANCE})  # fmt: skip
    return rows


def gpu_missing() -> str | None:
    """Why the NVML part cannot run here (no GPU through NVML, no nvidia-smi, no CUDA in torch), or None."""
    probes, line = host_gpus()
    if not probes:
        return line
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found on PATH"
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU load is a torch matmul loop)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


@contextlib.contextmanager
def _sampling(every: float, sample: Callable[[], float | None]) -> Iterator[list[tuple[float, float]]]:
    """``(time.time(), sample())`` every ``every`` seconds on a thread while the block runs (None: no reading)."""
    out: list[tuple[float, float]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            if (value := sample()) is not None:
                out.append((time.time(), value))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()


def _busy(duty: float, seconds: float) -> None:
    """GPU 0 busy for ``duty`` of every :data:`DUTY_PERIOD_S` (back-to-back matmuls), idle for the rest."""
    import torch

    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    end = time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        while time.perf_counter() < t + duty * DUTY_PERIOD_S:
            torch.mm(a, a, out=c)
            torch.cuda.synchronize()
        time.sleep(max(0.0, t + DUTY_PERIOD_S - time.perf_counter()))


@contextlib.contextmanager
def tty_output(argv: list[str]) -> Iterator[list[bytes]]:
    """Run ``argv`` with its output on a pseudo-terminal while the block runs, then stop it (SIGTERM); yields
    the list its output is appended to. On a terminal, C stdio writes each line as it ends; into a pipe the
    output would be block-buffered, and what is still buffered lost when the program is stopped."""
    ctl, tty = os.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=tty, stderr=tty)
    os.close(tty)
    chunks: list[bytes] = []

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the program has gone
            while chunk := os.read(ctl, 65536):
                chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield chunks
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
        os.close(ctl)


def nvml_part(duties: list[float], step_s: float, budget: Budget) -> dict[str, Any]:
    """The duty-cycle steps, sampled by the project's NVML module and by ``nvidia-smi`` (see the module
    docstring; ``nvidia-smi`` writes to a pseudo-terminal: :func:`tty_output`)."""
    missing = gpu_missing()
    if missing is not None:
        return {"status": "not run", "reason": missing}
    if (need := 1.0 + len(duties) * step_s) > budget.left():
        return {"status": "not run", "reason": f"its {need:.0f} s do not fit the {budget.left():.0f} s of budget left"}
    probe = host_gpus()[0][0]
    steps = []
    with tty_output(["nvidia-smi", "-i", str(probe.index), f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                     "-lms", str(int(SAMPLE_S * 1000))]) as chunks:  # fmt: skip
        _busy(1.0, 1.0)  # CUDA context, kernels and clocks up before the first step
        with _sampling(SAMPLE_S, lambda: probe.sample().get("util")) as nvml:
            for duty in duties:
                t0 = time.time()
                _busy(duty, step_s)
                steps.append((duty, t0, time.time()))
                log.info("nvml: duty %.0f%% for %.1f s", duty * 100, step_s)
    text = b"".join(chunks).decode(errors="replace")
    smi_readings = parse_smi(text)
    return {"status": "ok", "gpu": probe.name, "steps": compare_steps(steps, nvml, smi_readings),
            "smi_readings": len(smi_readings), "smi_first_line": text.splitlines()[0] if text else None}  # fmt: skip


# ---- the load parts --------------------------------------------------------------------------------------


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


# ---- verdicts, table, main --------------------------------------------------------------------------------


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
