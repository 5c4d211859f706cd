"""SIGINT/SIGTERM as a clean stop: :func:`run_async` runs a coroutine with them turned into a request to
stop (the point running then ends as ``interrupted``, its summary written: :mod:`loadgen.dispatch.engine`); a second
signal exits the process at once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Coroutine
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")


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


SIGNALS: ContextVar[Signals | None] = ContextVar("servelab_signals", default=None)  # the running run_async's (None outside one)


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
    token = SIGNALS.set(signals)
    try:
        return await coro
    finally:
        SIGNALS.reset(token)
        for sig in installed:
            loop.remove_signal_handler(sig)
            if signals.signum is not None:  # stopping already (summary, report): the next one exits now
                signal.signal(sig, _exit_now)


def interrupted_by() -> int | None:
    """The signal that stopped the current :func:`run_async` run, if any."""
    signals = SIGNALS.get()
    return None if signals is None else signals.signum
