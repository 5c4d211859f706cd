"""One worker's part of a load point (:class:`PointWorker`), driven by the coordinator through
:mod:`loadgen.dispatch.fleet` in this process, a worker process or a Ray actor."""

from __future__ import annotations

import asyncio
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from backends.base import Backend
from loadgen.client.http import HttpClient, make_client
from loadgen.dispatch import fleet as fleet_mod
from loadgen.dispatch.dispatcher import Dispatch, bounded
from loadgen.dispatch.gcpolicy import run_gc
from loadgen.dispatch.loadspec import LoadSpec, Share
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.signals import SIGNALS, Signals, run_async
from loadgen.records.writer import RecordWriter, lines_from
from loadgen.timing.clock import RunClock
from workloads.base import Workload

RECENT_SHIPPED = 16  # recent requests (with their events, for the live ITL) a worker's progress reply carries


class PointWorker:
    """One worker's part of a load point: its own HTTP client and dispatch, its records streamed to ``path``.

    The coordinator calls ``warmup`` (the warm-up phase; returns how the point ended early, if it did), then
    ``measure`` with the common start of the measured phase (this worker's run clock); ``progress_delta``
    and ``interrupt`` may come meanwhile. It runs in the coordinator's process, or pickled into a worker
    process or a Ray actor (:mod:`loadgen.dispatch.fleet`)."""

    def __init__(
        self, backend: Backend, workload: Workload, load: LoadSpec, share: Share, path: Path, clock: RunClock,
        client_kind: str, *, client: HttpClient | None = None, progress: Progress | None = None,
    ) -> None:  # fmt: skip
        self.backend, self.workload, self.load, self.share, self.path = backend, workload, load, share, path
        self.clock, self.client_kind, self.client, self.own_client = clock, client_kind, client, client is None
        self.progress = progress or Progress()
        self.early: dict[str, Any] | None = None
        self._d: Dispatch | None = None
        self._signals: Signals | None = None
        self._reported = 0  # TTFTs already passed on by progress_delta
        self._closed: dict[str, Any] | None = None

    def _sig(self) -> Signals:
        if self._signals is None:  # the process's own (run_async) or, in a Ray actor, this worker's
            self._signals = SIGNALS.get() or Signals()
        return self._signals

    async def warmup(self) -> dict[str, Any] | None:
        load = self.load
        if self.client is None:
            conns = load.concurrency if load.process == "closed" else load.max_inflight
            self.client = make_client(self.client_kind, max_connections=conns or 1, stall_timeout=load.stall_timeout)
        self.writer = RecordWriter(self.path)
        d = self._d = Dispatch(self.backend, self.workload, load, self.clock, self.client, self.writer,
                                self.progress, self.share, self._sig())  # fmt: skip
        self.cpu0, self.wait0, self.wall0 = time.process_time(), _cpu_wait(), time.perf_counter()
        await d.prebuild()
        d.t_start = self.clock.now()
        if load.warmup:  # its own phase: every warm-up ends before the first measured send
            d.warming = True
            with run_gc():
                self.early = await bounded(asyncio.ensure_future(d.dispatch()), d, None)  # the warm-ups run to their end
            d.warming = False
        return self.early

    async def measure(self, t_start: float) -> dict[str, Any]:
        """The measured phase from ``t_start`` (unless the warm-up phase ended the point: an interrupt or a
        dead server); returns how it ended and the worker's CPU use."""
        d = self._d
        assert d is not None, "warmup() comes first"
        if self.early is None:
            await d.alarm.until(t_start)
            d.t_start = self.progress.t_start = t_start
            with run_gc():
                self.early = await bounded(asyncio.ensure_future(d.dispatch()), d, self.load.duration)
        return {"early": self.early, **await self.close()}

    async def close(self) -> dict[str, Any]:
        """Close the record file and the client (once); the CPU and wall seconds since ``warmup``."""
        if self._closed is None:
            self._closed = {}
            if self._d is not None:
                if self._d._probe is not None:
                    self._d._probe.cancel()
                self._d.alarm.close()
                if self._d.prebuilt is not None:
                    self._d.prebuilt.close()
                if self._d.turns is not None:
                    self._d.turns.shutdown(wait=False, cancel_futures=True)
                wall, wait1 = max(time.perf_counter() - self.wall0, 1e-9), _cpu_wait()
                wait = wait1 - self.wait0 if self.wait0 is not None and wait1 is not None else None
                self._closed = {"cpu_s": time.process_time() - self.cpu0, "wait_s": wait, "wall_s": wall}
                self.writer.close()
            if self.own_client and self.client is not None:
                await self.client.aclose()
        return self._closed

    async def progress_delta(self, since: int) -> dict[str, Any]:
        """The live counters, the TTFTs and (up to :data:`RECENT_SHIPPED`) recent requests observed since the
        last call, and the records written after the first ``since`` bytes of its record file (``records``,
        complete lines, at least those the counters count; the caller says where it is, so a reply it never
        got loses nothing)."""
        p = self.progress
        new = len(p.ttft) - self._reported
        self._reported = len(p.ttft)
        recent = list(p.recent)[-min(new, RECENT_SHIPPED):] if new else []
        counters = {k: getattr(p, k) for k in ("started", "done", "errors", "inflight", "output_tokens", "warmup_done")}
        records = await asyncio.to_thread(lines_from, self.path, since)  # megabytes at scale: off the loop
        return {**counters, "error_kinds": dict(p.error_kinds), "ttft": p.ttft[-new:] if new else [], "recent": recent,
                "records": records}  # fmt: skip

    async def now(self) -> float:
        return self.clock.now()

    async def interrupt(self, signum: int) -> None:
        sig = self._sig()
        if sig.signum is None:
            sig.signum = signum
            sig.event.set()

    def serve_process(self, conn: Connection) -> None:
        """A worker process's entry point (:mod:`loadgen.dispatch.fleet`)."""
        run_async(fleet_mod.serve(self, conn, lambda: self.interrupt(signal.SIGTERM)))


def _cpu_wait() -> float | None:
    """Seconds the event-loop thread has spent runnable but waiting for a CPU (Linux schedstat)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
