"""The sweep driver: a list of load points (loads × workloads × trials) into one results directory.

    plans = plan_points([workload], loads_from(concurrency=[1, 4, 16], base=LoadSpec(num_requests=200)))
    summaries = await run_sweep(backend, plans, ResultsDir(Path("results/r1")), RunClock(), config={...})

After every point the top ``summary.json`` and ``sweep.csv``/``sweep.parquet`` are rewritten, so an
interrupted sweep keeps what it finished. A point that ends ``interrupted`` ends the sweep; one that ends
``aborted`` (the server went away) ends it too, unless ``wait_for_server`` seconds are given: then the
sweep waits up to that long for the server to answer again and goes on with the next point. ``sidecars`` is a list used for every point or a function
``plan -> list`` (fresh sidecar objects per point).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from backends.base import Backend
from loadgen.client.http import probe
from loadgen.dispatch.engine import DEFAULT_OPTIONS, PointOptions, run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.signals import interrupted_by
from loadgen.records.results import ResultsDir
from loadgen.timing.clock import RunClock, Sidecar
from workloads.base import Workload

RESET_TIMEOUT_S = 30.0  # a prefix-cache reset's answer (vLLM and SGLang empty it in the engine first)


async def reset_cache(backend: Backend, path: str) -> dict[str, Any]:
    """Empty the server's prefix cache before a point; what happened, for the point's summary."""
    try:
        async with httpx.AsyncClient(timeout=RESET_TIMEOUT_S, trust_env=False, headers=backend.auth_headers()) as client:
            status = (await client.post(backend.base_url + path)).status_code
    except httpx.HTTPError as exc:
        return {"path": path, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"path": path, "ok": 200 <= status < 300, "status": status}


@dataclass
class PointPlan:
    point_id: str
    workload: Workload
    load: LoadSpec
    trial: int = 0
    labels: dict[str, Any] = field(default_factory=dict)


def loads_from(
    base: LoadSpec, concurrency: Sequence[int] = (), rate: Sequence[float] = (), process: str = "poisson",
) -> list[LoadSpec]:
    """Closed-loop points for each concurrency, then open-loop (``process``) points for each rate."""
    out = [replace(base, process="closed", concurrency=c, rate=None) for c in concurrency]
    out += [replace(base, process=process, rate=r, concurrency=None) for r in rate]
    return out


def point_seed(seed: int, workload: str, point: str, trial: int) -> int:
    """The seed of one point's prompts and arrivals: the run's seed mixed with the workload, the load and the
    trial, so no point re-sends another's prompts (a server's prefix cache would answer them: with one seed
    for all, the reference server's cache served 5,024 of 5,331 prompt tokens from c = 4 on and TTFT fell as
    the load rose). A prefix the workload shares on purpose is still shared within each point. The server
    configuration is left out: the configurations of a server grid, each on a fresh server, get the same
    prompts (a paired comparison)."""
    return zlib.crc32(f"{seed}/{workload}/{point}/{trial}".encode())


def run_seed(run_id: str) -> int:
    """A run's default seed, from its id: runs send fresh prompts, and the id alone gives them again."""
    return zlib.crc32(run_id.encode())


def plan_points(
    workloads: Sequence[Workload], loads: Sequence[LoadSpec], repeat: int = 1, prefix: str | None = None,
) -> list[PointPlan]:
    """Point ids ``[prefix/][workload/]<load>[/t<trial>]``: workload shown when there are several,
    trial when ``repeat > 1``. Each point and trial gets its own seed (:func:`point_seed`)."""
    plans = []
    for wl in workloads:
        for load in loads:
            for trial in range(repeat):
                parts = [prefix] if prefix else []
                if len(workloads) > 1:
                    parts.append(wl.name)
                parts.append(load.point_id())
                if repeat > 1:
                    parts.append(f"t{trial}")
                labels = {"trial": trial} if repeat > 1 else {}
                seed = point_seed(load.seed, wl.name, load.point_id(), trial)
                plans.append(PointPlan("/".join(parts), wl, replace(load, seed=seed), trial, labels))
    return plans


async def run_sweep(
    backend: Backend, plans: Sequence[PointPlan], results: ResultsDir, clock: RunClock, config: dict[str, Any],
    sidecars: Sequence[Sidecar] | Callable[[PointPlan], Sequence[Sidecar]] = (), *,
    options: PointOptions = DEFAULT_OPTIONS,
    live: Callable[[PointPlan, Progress], AbstractContextManager[Any]] | None = None,
    run_extra: dict[str, Any] | None = None, previous: Sequence[dict[str, Any]] = (),
    wait_for_server: float = 0.0, reset_path: str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``plans`` in order, each point with ``options``; returns the PointSummaries (also in summary.json /
    sweep.csv).

    ``previous``: summaries already in this results directory (earlier server grid points), kept in
    summary.json / sweep.csv ahead of the new ones. ``reset_path``: the server's prefix cache is emptied
    (``POST``) before each point, and the summary's ``cache_reset`` says how that went."""
    ids = [*(s["point_id"] for s in previous), *(p.point_id for p in plans)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate point ids in the sweep: {ids}")
    extra = {"backend": backend.describe(), "workloads": _workloads(plans), **(run_extra or {})}
    run = results.write_run(config, clock.t0_unix, ids, extra)
    summaries: list[dict[str, Any]] = list(previous)
    for plan in plans:
        if interrupted_by() is not None:
            break
        progress = Progress()
        reset = await reset_cache(backend, reset_path) if reset_path else None
        scs = sidecars(plan) if callable(sidecars) else sidecars
        with live(plan, progress) if live else contextlib.nullcontext():
            s = await run_point(
                backend, plan.workload, plan.load, results.point_dir(plan.point_id), clock, scs,
                point_id=plan.point_id, labels=plan.labels, progress=progress, options=options,
            )  # fmt: skip
        s["trial"] = plan.trial
        if reset is not None:
            s["cache_reset"] = reset
        summaries.append(s)
        results.write_summary(run, summaries)
        if s["status"] == "interrupted":
            break
        if s["status"] == "aborted" and not await _server_back(backend.base_url, wait_for_server):
            break
    return summaries[len(previous):]


async def _server_back(base_url: str, wait: float) -> bool:
    """Poll the server's health for up to ``wait`` seconds; True once it answers."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and interrupted_by() is None:
        if await probe(base_url):
            return True
        await asyncio.sleep(1.0)
    return False


def _workloads(plans: Sequence[PointPlan]) -> list[dict[str, object]]:
    seen: dict[str, dict[str, object]] = {}
    for p in plans:
        seen.setdefault(p.workload.name, p.workload.describe())
    return list(seen.values())
