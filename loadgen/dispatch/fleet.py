"""Where the workers of a load point run: in this process, in worker processes on this machine, or as Ray
actors on a cluster.

The coordinator (:func:`loadgen.dispatch.engine.run_point`) drives every worker the same way, whatever its kind:
``await handle.call("method", *args)`` awaits the named async method of the worker object
(:class:`loadgen.dispatch.worker.PointWorker`) where it runs. A worker that dies makes every call on its handle raise
:class:`WorkerLost`.

- **In process** (one worker, no Ray): the call is a plain await; the single-process run.
- **Processes** (``--workers N``): each worker object is pickled into a spawned process with its own event
  loop and HTTP client, and calls travel as ``(id, method, args)`` over a pipe (several at once: a progress
  poll while the measured phase runs). Workers sit in their own process group, so a terminal's Ctrl-C
  reaches only the coordinator, which forwards it once (``interrupt``). Local workers share the system's
  monotonic clock (``time.perf_counter`` is ``CLOCK_MONOTONIC`` on Linux), so their clock offset is 0 exactly.
- **Ray** (``--ray ADDRESS``): each worker object is held by a Ray actor (``ray`` from the ``servelab[ray]``
  extra), possibly on another machine. Its clock offset to the coordinator is measured by round trips.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

OFFSET_ROUND_TRIPS = 8  # clock-offset samples per Ray worker; the one with the shortest round trip is kept
START_MARGIN_S = 0.1  # the measured phase starts this long after the coordinator says go (every worker hears it)


class WorkerLost(RuntimeError):
    """The worker's process or actor is gone."""


class Handle(Protocol):
    index: int
    remote: bool  # the worker does not share this process (signals must be forwarded to it)
    local: bool  # the worker shares this machine's clock and file system
    lost: str | None  # why it is gone, once it is

    async def call(self, method: str, *args: Any) -> Any: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Fleet:
    """How many workers a point gets and where they run (``ray``: None for this machine; ``local`` starts a
    Ray instance here, anything else is a Ray address, e.g. ``auto`` or ``ray://head:10001``)."""

    workers: int = 1
    ray: str | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")

    def describe(self) -> dict[str, Any]:
        return {"workers": self.workers, "ray": self.ray}

    def start(self, objs: list[Any]) -> list[Handle]:
        if self.ray is not None:
            return [_RayHandle(i, obj, self.ray) for i, obj in enumerate(objs)]
        if len(objs) == 1:
            return [_InProcess(objs[0])]
        return [_ProcessHandle(i, obj) for i, obj in enumerate(objs)]


ONE_PROCESS = Fleet()  # the single-process run


class _InProcess:
    index, remote, local, lost = 0, False, True, None

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.obj, method)(*args)

    def describe(self) -> dict[str, Any]:
        return {"index": 0, "kind": "in-process", "pid": os.getpid()}

    def close(self) -> None:
        pass


class _ProcessHandle:
    remote, local = True, True

    def __init__(self, index: int, obj: Any) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads and an event loop
        self.index, self.lost = index, None
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=obj.serve_process, args=(child,), name=f"bench-worker-{index}", daemon=True)
        self.proc.start()
        child.close()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._loop = asyncio.get_running_loop()
        self._closing = False
        # a blocking reader thread: an event loop's add_reader would make the pipe non-blocking (uvloop does),
        # and a Connection cannot read a message in pieces
        self._reader = threading.Thread(target=_read_into, args=(self._conn, self._loop, self._deliver), daemon=True)
        self._reader.start()

    async def call(self, method: str, *args: Any) -> Any:
        if self.lost is not None:
            raise WorkerLost(self.lost)
        i = next(self._ids)
        fut = self._pending[i] = self._loop.create_future()
        try:
            self._conn.send((i, method, args))
        except OSError:
            self._lose()
        return await fut

    def _deliver(self, msg: tuple[int, bool, Any] | None) -> None:
        if msg is None:  # the pipe ended: the worker exited
            if not self._closing:
                self._lose()
            return
        i, ok, value = msg
        fut = self._pending.pop(i, None)
        if fut is not None and not fut.done():
            fut.set_result(value) if ok else fut.set_exception(RuntimeError(f"worker {self.index}: {value}"))

    def _lose(self) -> None:
        if self.lost is not None:
            return
        self.proc.join(2.0)
        code = self.proc.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        self.lost = f"worker {self.index} (pid {self.proc.pid}) {how}; its records up to then are kept"
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(WorkerLost(self.lost))
        self._pending.clear()

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "kind": "process", "pid": self.proc.pid}

    def goodbye(self) -> None:
        """Tell the worker to exit (``close`` waits for it)."""
        if not self._closing:
            self._closing = True
            if self.lost is None:
                with contextlib.suppress(OSError):
                    self._conn.send(None)  # the worker's last message: it exits, and the reader thread sees EOF

    def close(self) -> None:
        self.goodbye()
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._reader.join(5.0)
        self._conn.close()


def close_all(handles: list[Handle]) -> None:
    """Close every handle: worker processes are all told to exit first, then waited for, so that their exits
    (each interpreter's shutdown, ~0.1 s) overlap instead of queueing one after another."""
    for h in handles:
        if isinstance(h, _ProcessHandle):
            h.goodbye()
    for h in handles:
        h.close()


def _read_into(conn: Connection, loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None]) -> None:
    """Pass every message from ``conn`` to ``deliver`` on ``loop``; None when the pipe ends."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        try:
            loop.call_soon_threadsafe(deliver, msg)
        except RuntimeError:  # the loop is closed
            return
        if msg is None:
            return


async def serve(obj: Any, conn: Connection, on_orphaned: Callable[[], Any]) -> None:
    """A worker process's side of :class:`_ProcessHandle`: run each call as a task and send its result back
    until the coordinator closes the pipe. A coordinator that goes away mid-point (EOF with calls still
    running) gets ``on_orphaned`` called (the worker stops its point), then the running calls finish."""
    os.setpgid(0, 0)  # signals come from the coordinator only
    eof = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    # Replies are pickled and written on a thread of their own, one at a time: a progress reply carries half
    # a second of records (megabytes at scale), and writing it waits for the coordinator to read it; on the
    # loop that stalled the worker's sends and reads twice a second (docs/performance.md, issue 38).
    sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelab-reply")

    async def run(i: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            msg = (i, True, await getattr(obj, method)(*args))
        except Exception as exc:
            msg = (i, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        with contextlib.suppress(OSError):  # the coordinator is gone
            await asyncio.get_running_loop().run_in_executor(sender, conn.send, msg)

    def deliver(msg: tuple[int, str, tuple[Any, ...]] | None) -> None:
        if msg is None:  # the coordinator said goodbye, or went away
            eof.set()
            return
        task = asyncio.ensure_future(run(*msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    threading.Thread(target=_read_into, args=(conn, asyncio.get_running_loop(), deliver), daemon=True).start()
    await eof.wait()
    if tasks:
        await on_orphaned()
        await asyncio.gather(*tasks, return_exceptions=True)


class _RayHost:
    """The Ray actor holding one worker object; its records go to a temporary file on the actor's node and
    come back through Ray with its progress (``progress_delta``)."""

    def __init__(self, obj: Any) -> None:
        obj.path = Path(tempfile.mkdtemp(prefix="servelab-worker-")) / obj.path.name
        self.obj = obj

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.obj, method)(*args)

    def where(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "host": os.uname().nodename}


class _RayHandle:
    remote, local = True, False

    def __init__(self, index: int, obj: Any, address: str) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs Ray: pip install 'servelab[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=None if address == "local" else address, log_to_driver=False)
        self.index, self.lost = index, None
        actor = ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_RayHost)
        self.actor = actor.remote(obj)
        self._where: dict[str, Any] = {}

    async def call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        if self.lost is not None:
            raise WorkerLost(self.lost)
        try:
            if not self._where:
                self._where = await self.actor.where.remote()
            return await self.actor.call.remote(method, *args)
        except RayActorError as exc:
            self.lost = f"worker {self.index} (Ray actor) died: {str(exc).splitlines()[0]}"
            raise WorkerLost(self.lost) from None

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "kind": "ray", **self._where}

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


async def clock_offset(handle: Handle, now: Callable[[], float]) -> dict[str, float]:
    """The worker's run clock minus the coordinator's (``offset_s``), and its error bound (``bound_s``): half
    the shortest of :data:`OFFSET_ROUND_TRIPS` round trips, whose midpoint is taken as the worker's instant.
    Workers that share this machine's monotonic clock are not measured: their offset is 0 exactly."""
    if handle.local:
        return {"offset_s": 0.0, "bound_s": 0.0}
    best = (float("inf"), 0.0)
    for _ in range(OFFSET_ROUND_TRIPS):
        t1 = now()
        w = await handle.call("now")
        t2 = now()
        best = min(best, (t2 - t1, w - (t1 + t2) / 2))
    return {"offset_s": best[1], "bound_s": best[0] / 2}

