"""Wake-ups at run-clock instants, to tens of microseconds, without spinning the event loop.

The event loop's own timers count whole milliseconds: uvloop wakes up to 0.5 ms before or after the
deadline, asyncio's loop up to ~1.5 ms after. The dispatcher used to sleep to a millisecond short of each
send time and then yield to the loop until the clock passed it; at 600 arrivals/s that busy wait doubled
the client's CPU per request (1.11 against 0.69 ms, docs/performance.md) and took CPU from the streams
being read. Here one Linux ``timerfd`` per :class:`Alarm`, armed for the earliest pending instant, wakes the
loop through its selector when that instant comes. Where there is no ``timerfd`` (not Linux), waits use
the loop's timer with half a millisecond of slack: never early, up to ~1.5 ms late.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import time
from collections.abc import Callable

from loadgen.clock import RunClock

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
    ``alarm.call_at(t, fn)`` calls ``fn`` then. Any number may wait at once. :meth:`close` when done drops
    whatever still waits (cancel the waiting tasks first)."""

    def __init__(self, clock: RunClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._armed: float | None = None
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None

    def _open(self) -> bool:
        """The timerfd, registered with the running loop on first use; False where there is none."""
        if self._fd >= 0:
            return True
        if _LIBC is None:
            return False
        fd = _LIBC.timerfd_create(time.CLOCK_MONOTONIC, _TFD_FLAGS)
        if fd < 0:
            return False
        self._fd, self._loop = fd, asyncio.get_running_loop()
        self._loop.add_reader(fd, self._fire)
        return True

    def call_at(self, t: float, fn: Callable[[], object]) -> None:
        """Call ``fn`` from the event loop (not in a task: no extra round of the loop before it runs)
        once the run clock has passed ``t``."""
        now = self.clock.now()
        loop = asyncio.get_running_loop()
        if t <= now:
            loop.call_soon(fn)
        elif self._open():
            heapq.heappush(self._heap, (t, next(self._seq), fn))
            if self._armed is None or t < self._armed:
                self._arm(t, now)
        else:  # the loop's timer, checked again when it fires: never early
            loop.call_later(t - now + SLACK_S, self.call_at, t, fn)

    async def until(self, t: float) -> None:
        if t <= self.clock.now():
            return
        fut = asyncio.get_running_loop().create_future()
        self.call_at(t, lambda: fut.done() or fut.set_result(None))  # a cancelled waiter's entry does nothing
        await fut

    def _arm(self, t: float, now: float) -> None:
        delay = max(t - now, 1e-6)  # relative to now: a timer never fires before its delay has passed
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(int(delay), int(delay % 1 * 1e9)))
        if _LIBC is None or _LIBC.timerfd_settime(self._fd, 0, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed = t

    def _fire(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # re-armed after it expired, before this callback ran
            return
        self._armed = None
        now, heap = self.clock.now(), self._heap
        while heap and heap[0][0] <= now:
            heapq.heappop(heap)[2]()
        if heap:
            self._arm(heap[0][0], now)

    def close(self) -> None:
        if self._fd >= 0:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        self._heap.clear()
