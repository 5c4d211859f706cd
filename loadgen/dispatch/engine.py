"""A load point: :func:`run_point` runs one (closed or open loop) over its workers and records every request.

Library API (used by ``bench``, the sweep driver and other areas)::

    summary = await run_point(backend, workload, LoadSpec(process="poisson", rate=20, num_requests=500),
                              out_dir=Path("results/x/points/r020"), clock=RunClock(), sidecars=[...])

``run_point`` writes ``out_dir/requests.jsonl`` (one line per request, flushed as it ends) and
``out_dir/summary.json`` and returns the PointSummary dict: ``point_id``, ``load``, ``workload``,
``labels``, the metrics of :func:`loadgen.metrics.pointsummary.summarize` (``latency``, ``throughput``, ``errors``,
``goodput``, ``client``, ``per_class``...) and one key per sidecar with what its ``stop()`` returned.

Load: ``closed`` keeps ``concurrency`` sessions in flight (a slot's next session starts when the last
one ends; ``intended`` is that moment); ``constant``/``poisson``/``gamma`` send on a seeded schedule
regardless of responses (a recorded session's ``at`` aside), and ``trace`` sends each session at its
``at / speedup`` (trace replay). Multi-turn sessions send the next turn ``think`` seconds after the
previous response. The first ``warmup`` sessions are marked warm-up and run first, as their own phase
under the same load (closed: at most ``concurrency`` at once; open: on the arrival schedule), and all of
them end before measured dispatch starts (as vLLM's ``bench serve`` and AIPerf do): no measured request
shares the server with a warm-up, and the measured schedule starts afresh after them. Dispatch stops after
``num_requests`` measured requests and/or ``duration`` seconds; requests still in flight then get
``drain`` seconds to end before they are cancelled (recorded as ``cancelled``).

A point can end early, and its summary says how (``status``: ``complete``, ``aborted`` or
``interrupted``):

- **Server gone.** A request that fails to connect or loses its connection pauses dispatch while a
  health probe asks the server whether it is still there (:func:`loadgen.client.http.probe`). Consecutive
  failed probes with no answer between them (:data:`loadgen.dispatch.dispatcher.GONE_PROBES`) stop the point: no
  further request is sent, what is in flight is cancelled, and ``summary["aborted"]`` holds the reason and
  the time. So at most the requests in flight at the death are recorded after it.
- **SIGINT / SIGTERM** (under :func:`loadgen.dispatch.signals.run_async`): dispatch stops, the requests in flight
  are cancelled (recorded as ``cancelled``), and the summary is written with ``summary["interrupted"]``
  (the signal, the time, finished and cancelled counts). A second signal exits the process at once.

**Workers** (``fleet``, ``bench run --workers N`` / ``--ray``): one process drives ~2,000 req/s; beyond
that the point's load is split over workers (:class:`loadgen.dispatch.loadspec.Share`): the open-loop schedule is
drawn once for the seed and dealt out (session ``i`` to worker ``i mod N``, at its time in the one
schedule), closed-loop concurrency and the request count are partitioned, a session stays on its worker.
Each worker (:class:`loadgen.dispatch.worker.PointWorker`, in this process when there is one, else in a process or
Ray actor of :mod:`loadgen.dispatch.fleet`) has its own event loop, client and record file (:mod:`loadgen.dispatch.dispatcher`
sends its sessions); :func:`run_point` coordinates the phases (:mod:`loadgen.dispatch.coordinator`), merges the
records onto the run clock and computes the one summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import Backend
from loadgen.client.http import HttpClient
from loadgen.defaults import POINT_FILE, REQUESTS_FILE, SUMMARY_FILE
from loadgen.dispatch.coordinator import Coordinator
from loadgen.dispatch.fleet import ONE_PROCESS, Fleet
from loadgen.dispatch.gcpolicy import run_gc
from loadgen.dispatch.loadspec import LoadSpec, Share
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.worker import PointWorker
from loadgen.metrics import pointsummary
from loadgen.records.writer import write_json
from loadgen.timing.clock import RunClock, Sidecar
from workloads.base import Workload
from workloads.contracts import read_jsonl


@dataclass(frozen=True)
class PointOptions:
    """How a point is run and judged, the same for every point of a sweep: goodput's SLOs (``slo_from=
    "intended"`` judges their TTFT and E2E from the intended send time), the HTTP client and the workers."""

    slo: dict[str, float] | None = None
    slo_from: str = "sent"
    client_kind: str = "aiohttp"
    fleet: Fleet = ONE_PROCESS


DEFAULT_OPTIONS = PointOptions()  # no SLOs, the aiohttp client, one process


async def run_point(
    backend: Backend, workload: Workload, load: LoadSpec, out_dir: Path, clock: RunClock,
    sidecars: Sequence[Sidecar] = (), *, point_id: str | None = None, labels: dict[str, Any] | None = None,
    client: HttpClient | None = None, progress: Progress | None = None,
    options: PointOptions = DEFAULT_OPTIONS,
) -> dict[str, Any]:
    """Run one load point into ``out_dir``; returns its PointSummary (also written to summary.json).

    ``options.fleet``: the point's load is split over ``fleet.workers`` workers (:class:`Share`; processes
    on this machine, or Ray actors), each streaming its records to ``workers/w<k>.jsonl``; every warm-up
    ends before the measured phase starts on all of them at one instant, and their records are merged
    (sorted by end, on this run clock) into ``requests.jsonl``, from which the one summary is computed. A
    worker that dies is reported under ``summary["workers"]["lost"]`` and its records up to its death are
    kept."""
    slo, slo_from, client_kind, fleet = options.slo, options.slo_from, options.client_kind, options.fleet
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = progress or Progress()
    pid = point_id or load.point_id()
    plan = {"point_id": pid, "load": load.describe(), "workload": workload.describe(), "labels": labels or {}}
    write_json(out_dir / POINT_FILE, plan)  # a killed point's summary needs it
    n = load.workers(fleet.workers)
    single = n == 1 and fleet.ray is None
    workers = [
        PointWorker(backend, workload, load.part(sh), sh, out_dir / (REQUESTS_FILE if single else f"workers/w{k}.jsonl"),
                    clock, client_kind, client=client if single else None, progress=progress if single else None)
        for k, sh in enumerate(Share(k, n) for k in range(n))
    ]  # fmt: skip
    for sc in sidecars:
        sc.start(clock, out_dir)
    t0 = progress.t_start = clock.now()
    coord = Coordinator(fleet.start(workers), progress, clock, None if single else out_dir / REQUESTS_FILE,
                        [w.path for w in workers])  # fmt: skip
    try:
        t_measured, results = await coord.run()
    finally:
        with run_gc():  # records are many small acyclic containers: no GC pass needs to walk them as they load
            merged = await coord.close()
    if merged is None:
        with run_gc():
            merged = read_jsonl(out_dir / REQUESTS_FILE)
    records = merged
    summary: dict[str, Any] = {
        **plan, "t_start": t0, "t_measured": t_measured, "t_end": clock.now(), "status": "complete",
    }  # fmt: skip
    ran = [r for r in results if r is not None and "wall_s" in r]
    cpu = max((r["cpu_s"] / r["wall_s"] for r in ran), default=None)
    waits = [r["wait_s"] / r["wall_s"] for r in ran if r["wait_s"] is not None]
    summary.update(pointsummary.summarize(records, load.describe(), slo, client_cpu=cpu, client_wait=max(waits, default=None),
                                     slo_from=slo_from))  # fmt: skip
    summary["workers"] = coord.describe(results, fleet)
    early = next((r["early"] for key in ("interrupted", "aborted") for r in ran if key in (r["early"] or {})), None)
    if early is not None:
        summary.update(early)
        summary["status"] = next(iter(early))
        if "interrupted" in early:
            cancelled = sum(1 for r in records if (r["error"] or {}).get("kind") == "cancelled")
            early["interrupted"].update(finished=len(records) - cancelled, cancelled=cancelled)
    window = (summary["window"][0], summary["window"][1])
    for sc in sidecars:
        try:
            summary[sc.name] = sc.stop(window)
        except Exception as exc:  # a broken sidecar must not lose the point's results
            summary[sc.name] = {"error": f"{type(exc).__name__}: {exc}"}
    pointsummary.add_energy_per_token(summary)
    pointsummary.add_prefix_cache(summary, workload.shares_prefix())
    write_json(out_dir / SUMMARY_FILE, summary)
    return summary
