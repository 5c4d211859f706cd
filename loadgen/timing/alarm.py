"""Wake-ups at run-clock instants, to tens of microseconds, without spinning the event loop.

The event loop's own timers count whole milliseconds: uvloop wakes up to 0.5 ms before or after the
deadline, asyncio's loop up to ~1.5 ms after. The dispatcher used to sleep to a millisecond short of each
send time and then yield to the loop until the clock passed it; at 600 arrivals/s that busy wait doubled
the client's CPU per request (1.11 against 0.69 ms, docs/performance.md) and took CPU from the streams
being read. Here one Linux ``timerfd`` per :class:`Alarm`, armed for the earliest pending instant, wakes the
loop through its selector when that instant comes. Where there is no ``timerfd`` (not Linux), waits use
the loop's timer, armed the same way with half a millisecond of slack: never early, up to ~1.5 ms late.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import time
from collections.abc import Callable

from loadgen.timing.clock import RunClock

SLACK_S = 0.0005  # the loop timer's rounding: what the fallback adds so that no wait ends early
_TFD_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_NONBLOCK and TFD_CLOEXEC have these values


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create, libc.timerfd_settime  # noqa: B018 (Linux only: AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class Alarm:
    """``await alarm.until(t)`` returns once the run clock has passed ``t`` (at once when it has);
    ``alarm.call_at(t, fn)`` calls ``fn`` then. Any number may wait at once; they wake in the order of
    their instants. :meth:`close` when done drops whatever still waits (cancel the waiting tasks first)."""

    def __init__(self, clock: RunClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._armed: float | None = None  # the instant the timer is set for
        self._fd = -1
        self._handle: asyncio.TimerHandle | None = None  # the loop's timer, where there is no timerfd
        self._loop: asyncio.AbstractEventLoop | None = None

    def call_at(self, t: float, fn: Callable[[], object]) -> None:
        """Call ``fn`` from the event loop (not in a task: no extra round of the loop before it runs)
        once the run clock has passed ``t``."""
        now = self.clock.now()
        if t <= now:
            asyncio.get_running_loop().call_soon(fn)
            return
        heapq.heappush(self._heap, (t, next(self._seq), fn))
        if self._armed is None or t < self._armed:
            self._arm(t, now)

    async def until(self, t: float) -> None:
        if t <= self.clock.now():
            return
        fut = asyncio.get_running_loop().create_future()
        self.call_at(t, lambda: fut.done() or fut.set_result(None))  # a cancelled waiter's entry does nothing
        await fut

    def _arm(self, t: float, now: float) -> None:
        if self._loop is None:  # first use: the timerfd, registered with the running loop, where there is one
            self._loop = asyncio.get_running_loop()
            if _LIBC is not None and (fd := _LIBC.timerfd_create(time.CLOCK_MONOTONIC, _TFD_FLAGS)) >= 0:
                self._fd = fd
                self._loop.add_reader(fd, self._fire)
        delay = max(t - now, 1e-6)  # relative to now: a timer never fires before its delay has passed
        if self._fd >= 0:
            spec = _Itimerspec(_Timespec(0, 0), _Timespec(int(delay), int(delay % 1 * 1e9)))
            if _LIBC is None or _LIBC.timerfd_settime(self._fd, 0, ctypes.byref(spec), None) != 0:
                raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        else:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_later(delay + SLACK_S, self._fire)
        self._armed = t

    def _fire(self) -> None:
        if self._fd >= 0:
            try:
                os.read(self._fd, 8)
            except BlockingIOError:  # re-armed after it expired, before this callback ran
                return
        self._armed = self._handle = None
        now, heap = self.clock.now(), self._heap
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)[2]()
        if heap:
            self._arm(heap[0][0], now)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        if self._fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        self._heap.clear()
