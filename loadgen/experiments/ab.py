"""Interleaved A/B trials: two servers started side by side, trials alternating between them.

Alternation follows an ABBA pattern (A B B A A B B A ...), so a drift in the machine's speed that is
linear over a pair of pairs hits both sides alike. Each side gets an ordinary results directory
(``<out>/<run_id>-baseline`` and ``-candidate``, points ``<load>/t<k>``) marked ``ab_paired``, so the
gate pairs trial k of one side with trial k of the other.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from backends.base import Backend
from backends.launcher import ServerProcess, free_port, render_command
from loadgen.dispatch.engine import run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.records.results import ResultsDir
from loadgen.timing.clock import RunClock
from workloads.base import Workload

SIDES = ("baseline", "candidate")


def abba(trials: int) -> list[tuple[int, str]]:
    """``[(trial, side), ...]``: pair k runs baseline first when k is even, candidate first when odd."""
    order = []
    for k in range(trials):
        first, second = SIDES if k % 2 == 0 else SIDES[::-1]
        order += [(k, first), (k, second)]
    return order


def run_ab(
    templates: dict[str, str],
    make_backend: Callable[[str], Backend],
    workload: Workload,
    load: LoadSpec,
    trials: int,
    out_root: Path,
    run_id: str,
    config: dict[str, Any],
    on_trial: Callable[[int, str, dict[str, Any]], None] | None = None,
) -> dict[str, Path]:
    """Start both servers, run ``trials`` interleaved trials of ``load`` on each; returns the two result
    directories. ``templates`` maps side -> server command template (``{port}``, ``{model}``)."""
    dirs = {side: ResultsDir(out_root / f"{run_id}-{side}") for side in SIDES}
    servers = {}
    for side in SIDES:
        port = free_port()
        servers[side] = ServerProcess(
            render_command(templates[side], {}, port), port, dirs[side].path / "server.log"
        )
    try:
        with ThreadPoolExecutor(len(SIDES)) as pool:  # both load their models at the same time
            for started in [pool.submit(srv.start) for srv in servers.values()]:
                started.result()
        backends = {side: make_backend(servers[side].base_url) for side in SIDES}
        clock = RunClock()
        ids = [f"{load.point_id()}/t{k}" for k in range(trials)]
        runs = {
            side: dirs[side].write_run(
                config,
                clock.t0_unix,
                ids,
                {
                    "backend": backends[side].describe(),
                    "server_argv": servers[side].argv,
                    "ab_paired": True,
                    "ab_side": side,
                    "workloads": [workload.describe()],
                },
            )  # fmt: skip
            for side in SIDES
        }
        summaries: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for k, side in abba(trials):
            pid = ids[k]
            s = run_async(
                run_point(
                    backends[side],
                    workload,
                    replace(load, seed=load.seed + k),
                    dirs[side].point_dir(pid),
                    clock,
                    point_id=pid,
                    labels={"trial": k, "ab_side": side},
                )  # fmt: skip
            )
            s["trial"] = k
            summaries[side].append(s)
            dirs[side].write_summary(runs[side], summaries[side])
            if on_trial:
                on_trial(k, side, s)
    finally:
        for srv in servers.values():
            srv.stop()
    return {side: dirs[side].path for side in SIDES}
