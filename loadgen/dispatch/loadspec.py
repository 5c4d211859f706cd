"""A load point's load (:class:`LoadSpec`: the arrival process, its bound, warm-up, timeouts) and one
worker's share of it (:class:`Share`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from loadgen.defaults import REQUEST_TIMEOUT_S, STALL_TIMEOUT_S
from workloads.contracts import ARRIVAL_PROCESSES, OPEN_LOOP_PROCESSES


@dataclass
class LoadSpec:
    process: str = "closed"
    concurrency: int | None = 1  # closed loop
    rate: float | None = None  # open loop, req/s
    burstiness: float = 1.0  # gamma shape
    num_requests: int | None = None  # measured requests (warm-up not counted)
    duration: float | None = None  # seconds of dispatch
    warmup: int = 0  # warm-up sessions, excluded from metrics
    seed: int = 0
    speedup: float = 1.0  # trace replay: send at ``at / speedup``
    timeout: float = REQUEST_TIMEOUT_S  # per request, whole response
    stall_timeout: float = STALL_TIMEOUT_S  # longest silence within a response
    drain: float | None = None  # wait for in-flight requests after dispatch stops (None: timeout)
    max_inflight: int = 4096  # open-loop safety bound on concurrent requests

    def __post_init__(self) -> None:
        if self.process not in ARRIVAL_PROCESSES:
            raise ValueError(f"unknown arrival process {self.process!r}; choose one of {', '.join(ARRIVAL_PROCESSES)}")
        if self.process == "closed" and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("closed loop needs concurrency >= 1")
        if self.process in OPEN_LOOP_PROCESSES and (self.rate is None or self.rate <= 0):
            raise ValueError(f"{self.process} arrivals need a rate > 0 req/s")
        if self.num_requests is None and self.duration is None and self.process != "trace":
            raise ValueError("a load point needs a bound: num_requests and/or duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("duration must be > 0 s")

    def point_id(self) -> str:
        """``c016`` for concurrency 16, ``r012.5`` for 12.5 req/s, ``trace`` (x speedup) for replay."""
        if self.process == "closed":
            return f"c{self.concurrency:03d}"
        if self.process == "trace":
            return "trace" if self.speedup == 1.0 else f"trace-x{self.speedup:g}"
        return f"r{self.rate:05.1f}" if self.rate != int(self.rate) else f"r{int(self.rate):03d}"  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def part(self, share: Share) -> LoadSpec:
        """One worker's part of this load: its share of the concurrency, the request count and the in-flight
        bound (the rate stays: the worker takes its sessions' times from the whole schedule)."""
        if share.count == 1:
            return self
        c, n = self.concurrency, self.num_requests
        return replace(self, concurrency=share.part(c) if c is not None else None,
                       num_requests=share.part(n) if n is not None else None,
                       max_inflight=max(1, share.part(self.max_inflight)))  # fmt: skip

    def workers(self, wanted: int) -> int:
        """How many of ``wanted`` workers get a part: no more than the concurrency or the requests."""
        n = min(wanted, self.concurrency or wanted) if self.process == "closed" else wanted
        return min(n, self.num_requests) if self.num_requests is not None else n


@dataclass(frozen=True)
class Share:
    """Worker ``index`` of ``count``: it runs the sessions whose index in the workload's (seeded) order is
    ``index`` modulo ``count``, so the workers' sessions together are the single-process run's, each
    session (all its turns) on one worker."""

    index: int = 0
    count: int = 1

    def mine(self, session_index: int) -> bool:
        return session_index % self.count == self.index

    def part(self, total: int) -> int:
        return total // self.count + (self.index < total % self.count)
