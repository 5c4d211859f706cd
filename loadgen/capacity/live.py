"""The live prober: probes a server with :func:`loadgen.dispatch.engine.run_point`, judging the probe's records as
they are written."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.capacity.probe import Probe, ProbeJudge, SearchStopped, probe_requests, probe_result
from loadgen.capacity.sequential import Decision, Sequential
from loadgen.capacity.stats import Samples
from loadgen.defaults import REQUEST_TIMEOUT_S, REQUESTS_FILE
from loadgen.dispatch.engine import PointOptions, run_point
from loadgen.dispatch.fleet import ONE_PROCESS, Fleet
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.progress import Progress
from loadgen.metrics import definitions as metrics
from loadgen.metrics.slo import SLO
from loadgen.timing.clock import RunClock
from workloads.contracts import read_jsonl


def _load_label(mode: str, load: float) -> str:
    return f"c{int(load):03d}" if mode == "concurrency" else f"r{load:07.2f}"


class LiveProber:
    """Probes a server with :func:`loadgen.dispatch.engine.run_point`: rate mode with ``process`` arrivals (Poisson by
    default), concurrency mode closed loop. The probe's records are read as they are written (with
    ``fleet``'s workers, as the coordinator receives them); the probe is stopped (in-flight requests
    cancelled) as soon as it is decided."""

    def __init__(
        self, backend: Any, workload: Any, slos: Sequence[SLO], out_dir: Path, clock: RunClock | None = None,
        process: str = "poisson", seed: int = 0, tick: float = 0.25, timeout: float = REQUEST_TIMEOUT_S,
        client_kind: str = "aiohttp", fleet: Fleet = ONE_PROCESS,
    ) -> None:  # fmt: skip
        self.backend, self.workload, self.slos, self.out_dir = backend, workload, list(slos), out_dir
        self.clock = clock or RunClock()
        self.process, self.seed, self.tick, self.timeout, self.client_kind = process, seed, tick, timeout, client_kind
        self.fleet = fleet

    async def probe(self, mode: str, load: float, seq: Sequential | None, max_seconds: float, index: int,
                    phase: str) -> Probe:  # fmt: skip
        cap, sends = probe_requests(seq, load)
        if mode == "concurrency" or phase == "pilot":
            # no warm-up phase: it would run a wave to its end, the probe's time not counting it, and then send the
            # measured sessions at once into the idle server again; the judge leaves that first wave out instead
            # (:meth:`Samples.steady`)
            c = int(load)
            spec = LoadSpec("closed", concurrency=c, num_requests=sends, warmup=0, seed=self.seed + index,
                            duration=max_seconds, drain=0.0, timeout=self.timeout)  # fmt: skip
        else:
            spec = LoadSpec(self.process, concurrency=None, rate=load, num_requests=cap, seed=self.seed + index,
                            warmup=min(50, math.ceil(load * 0.5)), duration=max_seconds, drain=0.0,
                            timeout=self.timeout)  # fmt: skip
        out = self.out_dir / "probes" / f"{index:02d}-{phase}-{_load_label(mode if phase != 'pilot' else 'concurrency', load)}"
        progress = Progress()
        task = asyncio.ensure_future(run_point(self.backend, self.workload, spec, out, self.clock,
                                               progress=progress,
                                               options=PointOptions(client_kind=self.client_kind, fleet=self.fleet)))  # fmt: skip
        judge = ProbeJudge(self.slos, seq, cap, load, spec.process == "closed", spec.process not in ("closed", "constant"))
        decision: Decision | None = None
        t0 = self.clock.now()
        starts: list[tuple[float, int]] = []  # (run-clock time, requests started by then)
        path = out / REQUESTS_FILE
        measured: list[dict[str, Any]] = []
        while decision is None:
            done, _ = await asyncio.wait({task}, timeout=self.tick)
            now = self.clock.now()
            starts.append((now if progress.counted_at is None else progress.counted_at, progress.started))
            recs = read_jsonl(path) if path.exists() else []
            cohort = _cohort(recs, None if done else starts)
            measured = [r for r in cohort if not r["warmup"]]
            decision = judge.look(len(measured), partial(_samples, measured), bool(done), now - t0, progress.inflight)
        samples = judge.samples
        seconds = self.clock.now() - t0
        warnings: list[str] = []
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif task.exception() is None:
            summary = task.result()
            warnings = list(summary["client"]["warnings"])
            if "interrupted" in summary:
                raise SearchStopped("interrupted", f"interrupted by {summary['interrupted']['signal']}")
            if "aborted" in summary:
                raise SearchStopped("server_gone", summary["aborted"]["reason"])
        span = _span(read_jsonl(path) if path.exists() else [])
        p = probe_result(index, phase, mode, load, samples, seq, self.slos, decision, seconds, span)
        lag = [r["sent"] - r["intended"] for r in measured]
        if not warnings and lag and spec.process != "closed" and (p99 := float(np.percentile(lag, 99))) > metrics.LAG_WARN_S:
            warnings.append(f"client schedule lag p99 {p99 * 1e3:.1f} ms: the client, not the server, may limit this probe")
        p.warnings, p.dir = warnings, str(out)
        return p


def _samples(records: list[dict[str, Any]]) -> Samples:
    samples = Samples()
    for r in records:
        samples.add_record(r)
    return samples


def _cohort(records: list[dict[str, Any]], starts: list[tuple[float, int]] | None) -> list[dict[str, Any]]:
    """The records of every request sent up to the latest moment by which all requests sent had ended
    (sorted by send time): judging only finished requests of a still-running probe would favour the fast
    ones. ``starts``: (time, requests started by then) samples of the engine's progress counter; None when
    the probe is over. Requests the probe itself cancelled at its end count as unfinished."""
    cut = min((r["sent"] for r in records if (r["error"] or {}).get("kind") == "cancelled"), default=math.inf)
    by_sent = sorted((r for r in records if r["sent"] < cut), key=lambda r: r["sent"])
    if starts is None:
        return by_sent
    sent = np.asarray([r["sent"] for r in by_sent])
    for t, started in reversed(starts):
        k = int(np.searchsorted(sent, t, side="right"))
        if k >= started:
            return by_sent[:k]
    return []


def _span(records: list[dict[str, Any]]) -> float | None:
    measured = [r for r in records if not r["warmup"] and r["error"] is None]
    if len(measured) < 2:
        return None
    return max(r["end"] for r in measured) - min(r["sent"] for r in measured)
