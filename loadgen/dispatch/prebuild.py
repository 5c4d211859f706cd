"""Sessions and their first requests, built on a thread ahead of dispatch.

Building a request (a prompt of exact length, a conversation's first turn) is the workload's work, and its
cost grows with the prompt; on the event loop it delayed every send and every read timestamp behind it (a
32,000-token prompt took 51 ms to build, docs/performance.md). Here a thread walks the workload's sessions,
keeps this worker's share, builds each first request and hands it to the loop, at most ``ahead`` at a time
(memory stays flat on a long run of long prompts). The loop only takes what is ready. Python code of a slow
builder still takes the GIL for up to the interpreter's switch interval at a time; the tokenizer's and most
of the builder's work is done in native code.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from workloads.base import Session
from workloads.contracts import GenRequest

HAND_S = 0.001  # a batch is handed to the loop once the thread has built for this long
Item = tuple[int, Session, GenRequest]  # session index in the workload's order, the session, its first request


class Prebuilder:
    """``await peek()`` the next item of this worker (None after the last), ``take()`` it.

    Items cross between the thread and the loop in batches: the loop gives room back a quarter of ``ahead``
    at a time, and the thread hands what it built when it runs out of room or has built for
    :data:`HAND_S`. One item at a time, each send woke the thread and then the loop (a self-pipe write) once
    more, and the thread took a CPU from the loop it feeds (open loop, 2 workers on 2 cores at 1,800/s: the
    loops waited for a CPU 10-12 % of the time instead of 14-15 %)."""

    def __init__(self, sessions: Iterator[Session], mine: Callable[[int], bool], ahead: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: deque[Item | BaseException | None] = deque()
        self._ready = asyncio.Event()
        self._room = threading.Semaphore(ahead)
        self._batch = max(1, ahead // 4)
        self._taken = 0  # taken, room not yet given back
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sessions, mine), name="prebuild", daemon=True)
        self._thread.start()

    def _run(self, sessions: Iterator[Session], mine: Callable[[int], bool]) -> None:
        built: list[Item | BaseException | None] = []
        since = 0.0
        try:
            for i, sess in enumerate(sessions):
                if not mine(i):
                    continue
                if built and time.monotonic() - since > HAND_S:
                    self._hand(built)
                    built = []
                if not self._room.acquire(blocking=False):
                    if built:  # out of room: what is built goes now, then wait for the loop to take some
                        self._hand(built)
                        built = []
                    while not self._room.acquire(timeout=0.1):
                        if self._stop.is_set():
                            return
                if self._stop.is_set():
                    return
                if not built:
                    since = time.monotonic()
                built.append((i, sess, sess.first()))
            built.append(None)
        except BaseException as exc:  # the workload's error is raised where the loop takes the item
            built.append(exc)
        self._hand(built)

    def _hand(self, items: list[Item | BaseException | None]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._put, items)
        except RuntimeError:  # the loop is closed: nobody takes it
            self._stop.set()

    def _put(self, items: list[Item | BaseException | None]) -> None:
        self._items.extend(items)
        self._ready.set()

    async def fill(self, n: int) -> None:
        """Wait until ``n`` items are ready (or all there are): a phase starts with its first sends built."""
        while len(self._items) < n and not self._stop.is_set():
            if self._items and not isinstance(self._items[-1], tuple):  # the end: None, or the workload's error
                return
            self._ready.clear()
            await self._ready.wait()

    async def peek(self) -> Item | None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items[0]
        if isinstance(item, BaseException):
            raise item
        return item

    def take(self) -> None:
        self._items.popleft()
        self._taken += 1
        if self._taken >= self._batch:
            self._room.release(self._taken)
            self._taken = 0

    def close(self) -> None:
        self._stop.set()
