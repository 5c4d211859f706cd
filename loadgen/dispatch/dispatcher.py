"""One worker's dispatch of a load point (:class:`Dispatch`): sessions sent closed- or open-loop, each
request recorded, dispatch held while a health probe asks whether the server is still there, and
:func:`bounded`, which ends it (the load's bound, a signal, the server gone) and cancels what is in flight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import signal
from collections import deque
from collections.abc import Coroutine, Iterator
from typing import Any

from backends.base import Backend
from loadgen.client.http import HttpClient, execute, probe
from loadgen.dispatch.loadspec import LoadSpec, Share
from loadgen.dispatch.prebuild import Prebuilder
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.signals import Signals
from loadgen.records.writer import RecordWriter
from loadgen.timing.alarm import Alarm
from loadgen.timing.arrivals import arrival_times
from loadgen.timing.clock import RunClock
from workloads.base import Session, Workload
from workloads.contracts import GenRequest, RequestRecord

GONE_PROBES = 3  # consecutive failed health probes that mean the server went away
PROBE_INTERVAL = 0.5  # seconds between them
_CONNECTION_LOST = frozenset({"connect", "disconnect"})
LOOKAHEAD = 64  # sessions built ahead of dispatch; open-loop sends set on the alarm ahead of their time


class Dispatch:
    """One worker's sessions sent under its part of the load, one phase at a time (``warming`` first), each
    request recorded by ``writer`` and counted in ``progress``."""

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
        self.alarm = Alarm(clock)  # send times and think times: see loadgen.timing.alarm
        self.turns: concurrent.futures.ThreadPoolExecutor | None = None  # builds later turns of conversations (next_turn)

    async def next_session(self) -> tuple[Session, bool, int, GenRequest] | None:
        """This worker's next session, whether it is a warm-up, its index in the workload's order and its
        first request (built ahead, off the loop: :mod:`loadgen.dispatch.prebuild`). None when the phase or the
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


async def bounded(main: asyncio.Future[None], d: Dispatch, duration: float | None) -> dict[str, Any] | None:
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


def _early_end(d: Dispatch, signals: Signals | None) -> dict[str, Any] | None:
    if signals is not None and signals.signum is not None:
        t = d.clock.now()
        sig = {"signal": signal.Signals(signals.signum).name, "t": t, "t_rel": t - d.t_start}
        return {"interrupted": sig}
    if d.gone_info is not None:
        return {"aborted": d.gone_info}
    return None


async def _cancel(main: asyncio.Future[None], d: Dispatch) -> None:
    """Cancel the dispatch and every request task; each writes its record as ``cancelled``."""
    d.stop.set()
    tasks = [main, *d.tasks]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
