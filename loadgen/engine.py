"""The dispatcher: runs one load point (closed or open loop) and records every request.

Library API (used by ``bench``, the sweep driver and other areas)::

    summary = await run_point(backend, workload, LoadSpec(process="poisson", rate=20, num_requests=500),
                              out_dir=Path("results/x/points/r020"), clock=RunClock(), sidecars=[...])

``run_point`` writes ``out_dir/requests.jsonl`` (one line per request, flushed as it ends) and
``out_dir/summary.json`` and returns the PointSummary dict: ``point_id``, ``load``, ``workload``,
``labels``, the metrics of :func:`loadgen.pointsummary.summarize` (``latency``, ``throughput``, ``errors``,
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
  health probe asks the server whether it is still there (:func:`loadgen.client.probe`). Consecutive
  failed probes with no answer between them (``GONE_PROBES``) stop the point: no further request is sent,
  what is in flight is cancelled, and ``summary["aborted"]`` holds the reason and the time. So at most the
  requests in flight at the death are recorded after it.
- **SIGINT / SIGTERM** (under :func:`run_async`): dispatch stops, the requests in flight are cancelled
  (recorded as ``cancelled``), and the summary is written with ``summary["interrupted"]`` (the signal,
  the time, finished and cancelled counts). A second signal exits the process at once.

**Workers** (``fleet``, ``bench run --workers N`` / ``--ray``): one process drives ~2,000 req/s; beyond
that the point's load is split over workers (:class:`Share`): the open-loop schedule is drawn once for the
seed and dealt out (session ``i`` to worker ``i mod N``, at its time in the one schedule), closed-loop
concurrency and the request count are partitioned, a session stays on its worker. Each worker
(:class:`PointWorker`, in this process when there is one, else in a process or Ray actor of
:mod:`loadgen.fleet`) has its own event loop, client and record file; :func:`run_point` coordinates the
phases, merges the records onto the run clock and computes the one summary.

Size: one load point's run state (dispatch loop, in-flight set, server-death probe, signal handling, the
summary that closes it) is shared by every part; sidecars, arrivals, the client and the metrics are already
their own modules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import itertools
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import orjson

from backends.base import Backend
from loadgen import fleet as fleet_mod
from loadgen import metrics, pointsummary
from loadgen.alarm import Alarm
from loadgen.arrivals import arrival_times
from loadgen.client import HttpClient, execute, make_client, probe
from loadgen.clock import RunClock, Sidecar
from loadgen.defaults import POINT_FILE, REQUEST_TIMEOUT_S, REQUESTS_FILE, STALL_TIMEOUT_S, SUMMARY_FILE
from loadgen.fleet import ONE_PROCESS, Fleet
from loadgen.prebuild import Prebuilder
from loadgen.records import RecordWriter, write_json
from workloads.base import Session, Workload
from workloads.contracts import ARRIVAL_PROCESSES, OPEN_LOOP_PROCESSES, GenRequest, RequestRecord, read_jsonl

T = TypeVar("T")
GONE_PROBES = 3  # consecutive failed health probes that mean the server went away
PROBE_INTERVAL = 0.5  # seconds between them
_CONNECTION_LOST = frozenset({"connect", "disconnect"})


class Signals:
    """SIGINT/SIGTERM as :func:`run_async` saw them: the first one asks the run to stop."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.event = asyncio.Event()

    def receive(self, signum: int) -> None:
        if self.signum is not None:
            _exit_now(signum)
        self.signum = signum
        self.event.set()
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping; writing the partial summary and report ({name} again exits at once)",
              file=sys.stderr, flush=True)  # fmt: skip


def _exit_now(signum: int, *_: object) -> None:
    """The second signal: leave at once (every finished record is already on disk)."""
    print(f"\n{signal.Signals(signum).name} again: exiting now", file=sys.stderr, flush=True)
    os._exit(128 + signum)


_SIGNALS: ContextVar[Signals | None] = ContextVar("servelab_signals", default=None)


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


@dataclass
class Progress:
    """Live counters the CLI displays; the engine only increments them."""

    started: int = 0
    done: int = 0
    errors: int = 0
    inflight: int = 0
    output_tokens: int = 0
    t_start: float = 0.0
    counted_at: float | None = None  # run-clock time the counters cover at least (None: live, they cover now)
    error_kinds: dict[str, int] = field(default_factory=dict)
    warmup_done: int = 0
    # for the live display, over measured successful requests: every TTFT (s), and the latest requests'
    # events, whose ITLs are computed only when the display asks (a few µs per request here, not per token)
    ttft: list[float] = field(default_factory=list)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=128))

    def observe(self, rec: RequestRecord) -> None:
        if rec.warmup:
            self.warmup_done += 1
        if rec.warmup or rec.error is not None or not rec.events:
            return
        r = {"sent": rec.sent, "events": rec.events}
        self.ttft.append(metrics.ttft(r) or 0.0)
        self.recent.append(r)

    def itl(self) -> list[float]:
        """Inter-token latencies (s) of the latest (up to 128) measured successful requests."""
        return [g for r in list(self.recent) for g in metrics.itl(r).tolist()]


class _Dispatch:
    def __init__(
        self, backend: Backend, workload: Workload, load: LoadSpec, clock: RunClock, client: HttpClient,
        writer: RecordWriter, progress: Progress, share: Share, signals: Signals | None,
    ) -> None:
        self.backend, self.load, self.clock, self.client = backend, load, clock, client
        self.writer, self.progress, self.share, self.signals = writer, progress, share, signals
        self.workload = workload
        self.prebuilt: Prebuilder | None = None  # started by prebuild(), before the first phase's clock starts
        self.measured = 0
        self.warming = False  # the warm-up phase: only the first ``warmup`` sessions, no duration bound
        self.t_start = 0.0
        self.stop = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.healthy = asyncio.Event()  # cleared while a health probe decides whether the server is there
        self.healthy.set()
        self.gone = asyncio.Event()
        self.gone_info: dict[str, Any] | None = None
        self._probe: asyncio.Task[None] | None = None
        self.alarm = Alarm(clock)  # send times and think times: see loadgen.alarm
        self.turns: concurrent.futures.ThreadPoolExecutor | None = None  # builds later turns of conversations (next_turn)

    async def next_session(self) -> tuple[Session, bool, int, GenRequest] | None:
        """This worker's next session, whether it is a warm-up, its index in the workload's order and its
        first request (built ahead, off the loop: :mod:`loadgen.prebuild`). None when the phase or the
        workload is over (started sessions go on)."""
        assert self.prebuilt is not None, "prebuild() comes first"
        item = await self.prebuilt.peek()
        if item is None or self.stop.is_set() or (self.warming and item[0] >= self.load.warmup):
            return None
        self.prebuilt.take()
        i, sess, first = item
        return sess, i < self.load.warmup, i, first

    def ticket(self, warmup: bool) -> bool:
        """May one more request start now? Counts it when so."""
        load = self.load
        if self.stop.is_set():
            return False
        if warmup:
            return True
        if load.duration is not None and self.clock.now() - self.t_start > load.duration:
            self.stop.set()
            return False
        if load.num_requests is not None and self.measured >= load.num_requests:
            self.stop.set()
            return False
        self.measured += 1
        if load.num_requests is not None and self.measured >= load.num_requests:
            self.stop.set()  # this is the last one
        return True

    async def session(self, sess: Session, warmup: bool, index: int, intended: float, req: GenRequest) -> None:
        """Session ``sess`` from its first request ``req`` (built ahead) to its last turn."""
        sid = f"s{index + 1}"
        turn = 0
        while True:
            if not self.healthy.is_set():
                await self.healthy.wait()
            if not self.ticket(warmup):
                return
            rec = RequestRecord(id=req.request_id, cls=req.workload_class, warmup=warmup, intended=intended,
                                session=sid, turn=turn)
            prog = self.progress
            prog.started += 1
            prog.inflight += 1
            try:
                text = await execute(self.client, self.backend, req, rec, self.clock, self.load.timeout)
            finally:
                prog.inflight -= 1
                prog.done += 1
                prog.output_tokens += rec.output_tokens or 0
                if rec.error is not None and not rec.warmup:  # as the results count them: measured requests
                    prog.errors += 1
                    kind = rec.error["kind"]
                    prog.error_kinds[kind] = prog.error_kinds.get(kind, 0) + 1
                prog.observe(rec)
                self.writer.write(rec)
            if rec.error is not None:
                if rec.error["kind"] in _CONNECTION_LOST:
                    self.suspect(rec.error["message"])
                return
            nxt = await self.next_turn(sess, text)
            if nxt is None:
                return
            think, req = nxt
            turn += 1
            intended = rec.end + think
            await self.alarm.until(intended)

    async def next_turn(self, sess: Session, text: str) -> tuple[float, GenRequest] | None:
        """A session's next request, built off the loop (on one thread of this dispatcher) where the session
        has turns: its prompt carries the whole conversation, and counting its tokens grows with it."""
        if type(sess).next is Session.next:
            return None
        if self.turns is None:
            self.turns = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="turns")
        return await asyncio.get_running_loop().run_in_executor(self.turns, sess.next, text)

    def suspect(self, why: str) -> None:
        """A request lost its connection: hold dispatch until a probe says whether the server is there."""
        if (self._probe is None or self._probe.done()) and not self.gone.is_set():
            self.healthy.clear()
            self._probe = asyncio.ensure_future(self.check(why))

    async def check(self, why: str) -> None:
        for i in range(GONE_PROBES):
            if i:
                await asyncio.sleep(PROBE_INTERVAL)
            if await probe(self.backend.base_url):
                self.healthy.set()
                return
        t = self.clock.now()
        self.gone_info = {
            "reason": f"the server stopped accepting connections ({GONE_PROBES} health probes of "
                      f"{self.backend.base_url} failed after: {why})",
            "t": t, "t_rel": t - self.t_start, "t_unix": self.clock.t0_unix + t,
        }  # fmt: skip
        self.stop.set()
        self.gone.set()
        self.healthy.set()  # waiting sessions see stop and end

    async def closed(self) -> None:
        async def slot() -> None:
            while (item := await self.next_session()) is not None:
                sess, warmup, i, first = item
                await self.session(sess, warmup, i, self.clock.now(), first)

        await asyncio.gather(*(slot() for _ in range(self.load.concurrency or 1)))

    async def open(self) -> None:
        """Open-loop dispatch: up to :data:`LOOKAHEAD` upcoming sends are built and set on the alarm ahead of
        time, and each one's task is created by the alarm's own callback: a send due right after another
        does not wait for the dispatcher's next round. Past ``max_inflight`` requests in flight, a due send
        waits for one to end (its lag is recorded)."""
        load = self.load
        times: Iterator[float] | None = None
        if load.process != "trace":
            times = arrival_times(load.process, load.rate or 0.0, load.seed, load.burstiness)
        held: deque[tuple[Session, bool, int, float, GenRequest]] = deque()  # due, waiting for max_inflight
        scheduled = 0  # on the alarm, not yet due
        changed = asyncio.Event()
        stopped = False

        def begin(sess: Session, warmup: bool, i: int, intended: float, first: GenRequest) -> None:
            task = asyncio.create_task(self.session(sess, warmup, i, intended, first))
            self.tasks.add(task)
            task.add_done_callback(ended)

        def ended(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            if held and not stopped:
                begin(*held.popleft())
            changed.set()

        def due(args: tuple[Session, bool, int, float, GenRequest]) -> None:
            nonlocal scheduled
            scheduled -= 1
            changed.set()
            if stopped:
                return
            if len(self.tasks) < load.max_inflight:
                begin(*args)
            else:
                held.append(args)

        pos = 0 if self.warming else self.load.warmup  # session index of the schedule's next time (a phase's own)
        try:
            while (item := await self.next_session()) is not None:
                sess, warmup, i, first = item
                t = None
                if times is not None:  # session i's time in the phase's schedule; the other workers' are skipped
                    t = next(itertools.islice(times, i - pos, None))
                    pos = i + 1
                elif sess.at is not None:  # trace arrivals: its recorded time (under any other process, the schedule's)
                    t = sess.at / load.speedup
                if t is None:
                    raise ValueError("trace replay needs every session to carry `at`")
                if load.duration is not None and t > load.duration:
                    break
                while scheduled >= LOOKAHEAD:
                    changed.clear()
                    await changed.wait()
                scheduled += 1
                self.alarm.call_at(self.t_start + t, functools.partial(due, (sess, warmup, i, self.t_start + t, first)))
            while scheduled or held or self.tasks:  # every send made and answered
                changed.clear()
                await changed.wait()
        finally:
            stopped = True
            if self.tasks:  # cancelled: what is in flight ends as cancelled, its record written
                for task in self.tasks:
                    task.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)

    async def prebuild(self) -> None:
        """Start building sessions ahead (once, for both phases) and wait for the first phase's first sends."""
        ahead = max(LOOKAHEAD, self.load.concurrency or 1)
        self.prebuilt = Prebuilder(iter(self.workload.sessions(self.load.seed)), self.share.mine, ahead)
        await self.prebuilt.fill(min(ahead, self.load.warmup or ahead))

    def dispatch(self) -> Coroutine[Any, Any, None]:
        return self.closed() if self.load.process == "closed" else self.open()


async def run_point(
    backend: Backend, workload: Workload, load: LoadSpec, out_dir: Path, clock: RunClock,
    sidecars: Sequence[Sidecar] = (), *, point_id: str | None = None, labels: dict[str, Any] | None = None,
    slo: dict[str, float] | None = None, client: HttpClient | None = None, client_kind: str = "aiohttp",
    progress: Progress | None = None, slo_from: str = "sent", fleet: Fleet = ONE_PROCESS,
) -> dict[str, Any]:
    """Run one load point into ``out_dir``; returns its PointSummary (also written to summary.json).
    ``slo_from="intended"`` judges the SLOs' TTFT and E2E from the intended send time.

    ``fleet``: the point's load is split over ``fleet.workers`` workers (:class:`Share`; processes on this
    machine, or Ray actors), each streaming its records to ``workers/w<k>.jsonl``; every warm-up ends before
    the measured phase starts on all of them at one instant, and their records are merged (sorted by end,
    on this run clock) into ``requests.jsonl``, from which the one summary is computed. A worker that dies
    is reported under ``summary["workers"]["lost"]`` and its records up to its death are kept."""
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
    coord = _Coordinator(fleet.start(workers), progress, clock, None if single else out_dir / REQUESTS_FILE,
                         [w.path for w in workers])  # fmt: skip
    try:
        t_measured, results = await coord.run()
    finally:
        with _run_gc():  # records are many small acyclic containers: no GC pass needs to walk them as they load
            merged = await coord.close()
    if merged is None:
        with _run_gc():
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


class PointWorker:
    """One worker's part of a load point: its own HTTP client and dispatch, its records streamed to ``path``.

    The coordinator calls ``warmup`` (the warm-up phase; returns how the point ended early, if it did), then
    ``measure`` with the common start of the measured phase (this worker's run clock); ``progress_delta``
    and ``interrupt`` may come meanwhile. It runs in the coordinator's process, or pickled into a worker
    process or a Ray actor (:mod:`loadgen.fleet`)."""

    def __init__(
        self, backend: Backend, workload: Workload, load: LoadSpec, share: Share, path: Path, clock: RunClock,
        client_kind: str, *, client: HttpClient | None = None, progress: Progress | None = None,
    ) -> None:  # fmt: skip
        self.backend, self.workload, self.load, self.share, self.path = backend, workload, load, share, path
        self.clock, self.client_kind, self.client, self.own_client = clock, client_kind, client, client is None
        self.progress = progress or Progress()
        self.early: dict[str, Any] | None = None
        self._d: _Dispatch | None = None
        self._signals: Signals | None = None
        self._reported = 0  # TTFTs already passed on by progress_delta
        self._closed: dict[str, Any] | None = None

    def _sig(self) -> Signals:
        if self._signals is None:  # the process's own (run_async) or, in a Ray actor, this worker's
            self._signals = _SIGNALS.get() or Signals()
        return self._signals

    async def warmup(self) -> dict[str, Any] | None:
        load = self.load
        if self.client is None:
            conns = load.concurrency if load.process == "closed" else load.max_inflight
            self.client = make_client(self.client_kind, max_connections=conns or 1, stall_timeout=load.stall_timeout)
        self.writer = RecordWriter(self.path)
        d = self._d = _Dispatch(self.backend, self.workload, load, self.clock, self.client, self.writer,
                                self.progress, self.share, self._sig())  # fmt: skip
        self.cpu0, self.wait0, self.wall0 = time.process_time(), _cpu_wait(), time.perf_counter()
        await d.prebuild()
        d.t_start = self.clock.now()
        if load.warmup:  # its own phase: every warm-up ends before the first measured send
            d.warming = True
            with _run_gc():
                self.early = await _bounded(asyncio.ensure_future(d.dispatch()), d, None)  # the warm-ups run to their end
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
            with _run_gc():
                self.early = await _bounded(asyncio.ensure_future(d.dispatch()), d, self.load.duration)
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
        records = await asyncio.to_thread(_lines_from, self.path, since)  # megabytes at scale: off the loop
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
        """A worker process's entry point (:mod:`loadgen.fleet`)."""
        run_async(fleet_mod.serve(self, conn, lambda: self.interrupt(signal.SIGTERM)))


class _Coordinator:
    """The coordinator's side of a point's workers: the phases on all of them, the progress and signals
    passed between, the records merged.

    Workers that are not this process pass their records on with their progress (every ``POLL_S``), and
    they are appended to the point's ``requests.jsonl`` (``out``) as they come, on this run clock: whoever
    reads that file while the point runs (``bench capacity``'s probe) sees every worker's records, as it sees
    the one in-process worker's. ``progress.counted_at`` says which moment the polled counters cover."""

    POLL_S = 0.5

    def __init__(self, handles: list[fleet_mod.Handle], progress: Progress, clock: RunClock, out: Path | None,
                 paths: list[Path]) -> None:  # fmt: skip
        self.handles, self.progress, self.clock = handles, progress, clock
        self.remote = [h for h in handles if h.remote]
        self.offsets = [{"offset_s": 0.0, "bound_s": 0.0} for _ in handles]
        self.latest: dict[int, dict[str, Any]] = {}
        self.forwarded = False
        self.out, self.paths = out, paths  # out: None when one worker in this process writes requests.jsonl
        self.received = [0] * len(handles)  # bytes of each worker's record file appended to out
        self._f = out.open("wb", buffering=0) if out is not None else None

    async def run(self) -> tuple[float, list[dict[str, Any] | None]]:
        """Clock offsets, the warm-up phase on every worker (with the building of their first sessions), then
        the measured phase from one instant; returns that instant and each worker's result (None for a worker
        lost)."""
        for h in self.handles:
            with contextlib.suppress(fleet_mod.WorkerLost):
                self.offsets[h.index] = await fleet_mod.clock_offset(h, self.clock.now)
        await self._each("warmup", lambda h: ())
        if self.remote:
            t_go = self.progress.t_start = self.clock.now() + fleet_mod.START_MARGIN_S
        else:
            t_go = self.clock.now()
        results = await self._each("measure", lambda h: (t_go + self.offsets[h.index]["offset_s"],))
        await self._poll()
        return t_go, results

    async def _each(self, method: str, args: Callable[[fleet_mod.Handle], tuple[Any, ...]]) -> list[Any]:
        """``method`` on every live worker at once, progress polled and signals forwarded meanwhile."""
        live = [h for h in self.handles if h.lost is None]
        calls = [asyncio.ensure_future(h.call(method, *args(h))) for h in live]
        watch = asyncio.ensure_future(self._watch())
        try:
            got = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            watch.cancel()
        out: list[Any] = [None] * len(self.handles)
        for h, r in zip(live, got, strict=True):
            if isinstance(r, fleet_mod.WorkerLost):
                continue
            if isinstance(r, BaseException):
                raise r
            out[h.index] = r
        return out

    async def _watch(self) -> None:
        signals = _SIGNALS.get()
        while self.remote:
            if signals is not None and signals.signum is not None and not self.forwarded:
                self.forwarded = True  # a worker process is in its own process group: it hears it once, from here
                for h in self.remote:
                    with contextlib.suppress(fleet_mod.WorkerLost):
                        await h.call("interrupt", signals.signum)
            await self._poll()
            with contextlib.suppress(asyncio.TimeoutError):  # a signal is passed on at once
                await asyncio.wait_for(signals.event.wait() if signals and not self.forwarded else asyncio.sleep(self.POLL_S),
                                       self.POLL_S)  # fmt: skip

    async def _poll(self) -> None:
        """The workers' progress into the coordinator's (the one live view)."""
        if not self.remote:
            return
        t = self.clock.now()  # each worker's counters are taken after this instant
        for h in self.remote:
            with contextlib.suppress(fleet_mod.WorkerLost):
                delta = await h.call("progress_delta", self.received[h.index])
                self._append(h, delta.pop("records"))
                self.progress.ttft.extend(delta.pop("ttft"))
                self.progress.recent.extend(delta.pop("recent"))
                self.latest[h.index] = delta
        p = self.progress
        p.counted_at = t
        for key in ("started", "done", "errors", "inflight", "output_tokens", "warmup_done"):
            setattr(p, key, sum(c[key] for c in self.latest.values()))
        p.error_kinds = {}
        for c in self.latest.values():
            for kind, k in c["error_kinds"].items():
                p.error_kinds[kind] = p.error_kinds.get(kind, 0) + k

    def _append(self, h: fleet_mod.Handle, lines: bytes) -> None:
        """Worker ``h``'s next records (lines of its record file) into ``requests.jsonl``, on this run clock."""
        if self._f is None or not lines:
            return
        self.received[h.index] += len(lines)
        if off := self.offsets[h.index]["offset_s"]:
            recs = [orjson.loads(line) for line in lines.splitlines()]
            for r in recs:
                r["intended"], r["sent"], r["end"] = r["intended"] - off, r["sent"] - off, r["end"] - off
                r["events"] = [[t - off, k] for t, k in r["events"]]
            lines = b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in recs)
        self._f.write(lines)

    def describe(self, results: list[dict[str, Any] | None], fleet: Fleet) -> dict[str, Any]:
        per = []
        for h, r in zip(self.handles, results, strict=True):
            per.append({**h.describe(), **self.offsets[h.index], **{k: v for k, v in (r or {}).items() if k != "early"},
                        "lost": h.lost})  # fmt: skip
        bound = max(o["bound_s"] for o in self.offsets)
        note = (f"{len(self.handles)} Ray workers: records put on this machine's run clock by measured offsets, error "
                f"bound {bound * 1e3:.2f} ms") if fleet.ray is not None else None  # fmt: skip
        return {
            **fleet.describe(), "count": len(self.handles), "note": note, "cpu_s": sum(r["cpu_s"] for r in results if r and "cpu_s" in r),
            "clock_bound_s": bound, "per_worker": per,
            "lost": [{"index": h.index, "reason": h.lost} for h in self.handles if h.lost is not None],
        }  # fmt: skip

    async def close(self) -> list[dict[str, Any]] | None:
        """Stop the workers; then what a worker on this machine wrote and did not pass on (it was lost, or the
        point was cancelled) joins ``requests.jsonl``, which is put in order of the records' end (as one
        process writes it). Returns its records in that order (None when the one worker in this process wrote
        it: it is as written). A Ray worker's records not passed on by then stay on its node."""
        for h in self.handles:
            if not h.remote:
                await h.call("close")
        fleet_mod.close_all(self.handles)
        if self._f is None or self.out is None:
            return None
        for h, path in zip(self.handles, self.paths, strict=True):
            if h.local:
                self._append(h, _lines_from(path, self.received[h.index]))
        self._f.close()
        lines = self.out.read_bytes().splitlines(keepends=True)  # whole lines: the coordinator appends no other
        recs = [orjson.loads(line) for line in lines]
        order = sorted(range(len(recs)), key=lambda i: recs[i]["end"])
        with self.out.open("wb") as f:
            f.writelines(lines[i] for i in order)
        return [recs[i] for i in order]


def _lines_from(path: Path, offset: int) -> bytes:
    """The complete lines of a record file after its first ``offset`` bytes."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return b""
    return data[: data.rfind(b"\n") + 1]


async def _bounded(main: asyncio.Future[None], d: _Dispatch, duration: float | None) -> dict[str, Any] | None:
    """Await the dispatch; after ``duration`` (+ drain) cancel what is still in flight. Returns how the
    point ended early (``{"interrupted": ...}`` or ``{"aborted": ...}``), None when it ran its course."""
    signals = d.signals
    stoppers = {asyncio.ensure_future(d.gone.wait())}
    if signals is not None:
        stoppers.add(asyncio.ensure_future(signals.event.wait()))
    try:
        if duration is not None:
            done, _ = await asyncio.wait({main, *stoppers}, timeout=duration, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                d.stop.set()
                drain = d.load.timeout if d.load.drain is None else d.load.drain
                await asyncio.wait({main, *stoppers}, timeout=drain, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.wait({main, *stoppers}, return_when=asyncio.FIRST_COMPLETED)
        early = _early_end(d, signals)
        if not main.done():
            await _cancel(main, d)
        else:
            main.result()  # a dispatch bug surfaces here
        return early
    except asyncio.CancelledError:  # cancelled from outside: close every in-flight record as cancelled
        await _cancel(main, d)
        raise
    finally:
        for f in stoppers:
            f.cancel()


def _early_end(d: _Dispatch, signals: Signals | None) -> dict[str, Any] | None:
    if signals is not None and signals.signum is not None:
        t = d.clock.now()
        sig = {"signal": signal.Signals(signals.signum).name, "t": t, "t_rel": t - d.t_start}
        return {"interrupted": sig}
    if d.gone_info is not None:
        return {"aborted": d.gone_info}
    return None


async def _cancel(main: asyncio.Future[None], d: _Dispatch) -> None:
    """Cancel the dispatch and every request task; each writes its record as ``cancelled``."""
    d.stop.set()
    tasks = [main, *d.tasks]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def _run_gc() -> Iterator[None]:
    """Short cyclic-GC pauses while requests run.

    Each stream event allocates a few small containers that live until their request ends, and a pass
    walks every object of the generations it collects: at the default gen-0 threshold (700) the collector
    ran every few hundred events; at 70,000 each gen-0 pass, and every tenth (gen 1: up to 700,000
    objects), took up to 75-90 ms here, a pause in which no arrival is sent and no read is timestamped
    (16 workers at 10,000 req/s on 16 cores: schedule lag p99 31.8 ms). So what exists before the run is
    frozen (never scanned), young passes come every :data:`GC_YOUNG` allocations, and what survives one
    is frozen too (:func:`_freeze_survivors`): no pass ever walks more than one threshold's objects. Frozen
    objects are still freed by reference counting when their request ends (per-request objects are
    acyclic; short-lived cycles die in the young passes); the old settings come back after the run.
    """
    global _gc_runs, _gc_saved
    _gc_runs += 1
    if _gc_runs == 1:  # with concurrent runs, the first to start sets, the last to end restores
        _gc_saved = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(GC_YOUNG, *_gc_saved[1:])
        gc.callbacks.append(_freeze_survivors)
    try:
        yield
    finally:
        _gc_runs -= 1
        if _gc_runs == 0:
            gc.callbacks.remove(_freeze_survivors)
            gc.set_threshold(*_gc_saved)
            gc.unfreeze()


RECENT_SHIPPED = 16  # recent requests (with their events, for the live ITL) a worker's progress reply carries
LOOKAHEAD = 64  # sessions built ahead of dispatch; open-loop sends set on the alarm ahead of their time
GC_YOUNG = 10_000  # tracked allocations between young passes while a run lasts: a pass of ~1-6 ms here


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


_gc_runs = 0
_gc_saved: tuple[int, ...] = gc.get_threshold()


def _cpu_wait() -> float | None:
    """Seconds the event-loop thread has spent runnable but waiting for a CPU (Linux schedstat)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` (on uvloop when installed) with SIGINT/SIGTERM turned into a clean stop: the point
    running then ends as ``interrupted`` with its summary written (see the module docstring)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_with_signals(coro))
    return uvloop.run(_with_signals(coro))


async def _with_signals(coro: Coroutine[Any, Any, T]) -> T:
    signals = Signals()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue  # e.g. a background job of a non-interactive shell: leave it ignored
        try:
            loop.add_signal_handler(sig, signals.receive, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such support
            pass
    token = _SIGNALS.set(signals)
    try:
        return await coro
    finally:
        _SIGNALS.reset(token)
        for sig in installed:
            loop.remove_signal_handler(sig)
            if signals.signum is not None:  # stopping already (summary, report): the next one exits now
                signal.signal(sig, _exit_now)


def interrupted_by() -> int | None:
    """The signal that stopped the current :func:`run_async` run, if any."""
    signals = _SIGNALS.get()
    return None if signals is None else signals.signum
