"""A worker object for :func:`loadgen.dispatch.fleet.serve` in a spawned process (importable there by name): its event
loop notes the time every few milliseconds, and one call replies with a body larger than a pipe holds."""

from __future__ import annotations

import asyncio
import time


class Ticker:
    def __init__(self) -> None:
        self.ticks: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def tick() -> None:
            while True:
                self.ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        self._task = asyncio.create_task(tick())

    async def big(self, size: int) -> bytes:
        return b"x" * size

    async def times(self) -> list[float]:
        return self.ticks


def serve(conn: object) -> None:
    from loadgen.dispatch.fleet import serve as fleet_serve
    from loadgen.dispatch.signals import run_async

    async def orphaned() -> None:
        return None

    run_async(fleet_serve(Ticker(), conn, orphaned))  # type: ignore[arg-type]
