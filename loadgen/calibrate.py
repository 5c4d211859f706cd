"""``bench calibrate``: the client's own ceiling on this machine, measured against the null server.

The null server runs in a separate process (its own event loop and core), so the figures are what one
client process can drive: closed loop (req/s and events/s at a concurrency, achieved concurrency) and
open loop (achieved vs requested rate, schedule lag).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.base import GenRequest
from backends.openai import OpenAIBackend
from loadgen.clock import RunClock
from loadgen.engine import LoadSpec, run_point
from loadgen.nullserver import NullServerProcess
from workloads.base import ArrivalSpec, Session, SingleShot, Workload


@dataclass
class FixedWorkload(Workload):
    """Identical requests (``extra_bodies`` cycle per request, e.g. null-server faults); for calibration
    and tests, where the prompt content does not matter."""

    max_tokens: int = 16
    prompt: str = "Say something."
    cls: str = "fixed"
    extra_bodies: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    name: str = "fixed"
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)

    def sessions(self, seed: int) -> Iterator[Session]:
        for i, extra in zip(itertools.count(), itertools.cycle(self.extra_bodies)):
            yield SingleShot(GenRequest(f"r{i}", self.prompt, self.max_tokens, self.cls, extra_body=extra, seed=seed))

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "max_tokens": self.max_tokens, "extra_bodies": self.extra_bodies}


async def calibrate(
    out_dir: Path, concurrency: int = 512, events: int = 200, num_requests: int = 20000, rate: float = 300.0,
    duration: float = 30.0, client_kind: str = "aiohttp",
) -> dict[str, Any]:
    """Run the closed-loop and the open-loop calibration points; returns {"closed": ..., "open": ...}."""
    out: dict[str, Any] = {"load_average": os.getloadavg(), "client": client_kind}
    with NullServerProcess() as url:
        backend = OpenAIBackend(url, model="null")
        wl = FixedWorkload(max_tokens=events)
        clock = RunClock()
        closed = LoadSpec("closed", concurrency=concurrency, num_requests=num_requests, warmup=concurrency)
        s = await run_point(backend, wl, closed, out_dir / "closed", clock, client_kind=client_kind)
        out["closed"] = _brief(s, events)
        opened = LoadSpec("poisson", rate=rate, duration=duration, warmup=int(rate), seed=1)
        s = await run_point(backend, wl, opened, out_dir / "open", clock, client_kind=client_kind)
        out["open"] = _brief(s, events)
    (out_dir / "calibrate.json").write_text(json.dumps(out, indent=1))
    return out


def _brief(s: dict[str, Any], events: int) -> dict[str, Any]:
    thr, cl = s["throughput"]["steady"], s["client"]
    lag = cl["schedule_lag"]
    return {
        "requests": s["counts"]["requests"], "errors": s["counts"]["errors"],
        "req_per_s": thr["req_per_s"], "events_per_s": (thr["req_per_s"] or 0) * events,
        "achieved_concurrency": cl["achieved_concurrency"], "requested_concurrency": cl["requested_concurrency"],
        "achieved_rate": cl["achieved_rate"], "requested_rate": cl["requested_rate"],
        "lag_p50_ms": lag["p50"] * 1e3 if lag["p50"] is not None else None,
        "lag_p99_ms": lag["p99"] * 1e3 if lag["p99"] is not None else None,
        "client_cpu": cl["cpu"], "client_cpu_wait": cl["cpu_wait"], "warnings": cl["warnings"],
        # CPU time the client spent per request: its ceiling on a free core is 1 / this
        "cpu_ms_per_request": cl["cpu"] * (s["t_end"] - s["t_start"]) / max(s["counts"]["requests"] + s["counts"]["warmup"], 1) * 1e3,
    }  # fmt: skip
