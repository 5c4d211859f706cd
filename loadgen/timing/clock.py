"""The run clock and the sidecar contract.

Every timestamp in a result is seconds since the run's ``t0`` on ``time.perf_counter()``; ``t0_unix``
lets series recorded by other processes (server iteration logs, telemetry) be put on the same axis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class RunClock:
    t0: float = field(default_factory=time.perf_counter)
    t0_unix: float = field(default_factory=time.time)

    def now(self) -> float:
        """Seconds since t0."""
        return time.perf_counter() - self.t0

    def from_unix(self, unix_t: float) -> float:
        """A wall-clock time (e.g. from a server log) on the run clock."""
        return unix_t - self.t0_unix


class Sidecar(Protocol):
    """Something that runs beside one load point (server-state poller, telemetry sampler).

    ``start`` must return quickly and never block the event loop (use a thread or a task);
    ``stop`` ends sampling, flushes its series into ``point_dir`` and returns summary fields that are
    merged into the point's ``summary.json`` under the sidecar's ``name``.
    """

    name: str

    def start(self, clock: RunClock, point_dir: Path) -> None: ...

    def stop(self, window: tuple[float, float] | None) -> dict[str, Any]: ...
