"""The one sampling loop of every sidecar: a daemon thread that records one JSON object per tick.

Each record is ``{"t": <run clock>, **tick()}``, appended to ``records`` and written as one flushed line
of the point's JSONL file; a tick that raises is recorded as ``{"t", "error"}`` and sampling goes on.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from loadgen.timing.clock import RunClock

Record = dict[str, Any]


class ThreadedSampler:
    """Subclasses set ``name`` (the summary key), ``filename`` and ``t_digits``, and implement
    :meth:`_tick` and :meth:`summary`; :meth:`_last` may take a final sample before the file closes.

    ``skip_ahead``: after a tick that overran its period, start the next one period from now (a slow
    scrape must not fire a burst of scrapes at a server) rather than catching up (cheap local readings:
    the count per second stays what was asked)."""

    name = "sampler"
    filename = "samples.jsonl"
    t_digits = 6
    skip_ahead = False

    def __init__(self, rate_hz: float, what: str) -> None:
        if not rate_hz > 0:
            raise ValueError(f"{what} must be > 0 Hz, got {rate_hz}")
        self.period = 1.0 / rate_hz
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock: RunClock | None = None
        self._dir: Path | None = None
        self._out: Any = None

    def _tick(self, t: float) -> Record:
        """One reading taken at run-clock time ``t`` (the record's fields but ``t``)."""
        raise NotImplementedError

    def summary(self, window: tuple[float, float] | None) -> dict[str, Any]:
        """What goes into the point's summary under ``name``."""
        raise NotImplementedError

    def _last(self) -> None:
        """Called once the thread has stopped, before the file is closed."""

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self._clock, self._dir = clock, point_dir
        self._stop.clear()
        self.records = []
        point_dir.mkdir(parents=True, exist_ok=True)
        self._out = (point_dir / self.filename).open("w", encoding="utf-8")
        self._thread = threading.Thread(target=self._loop, name=f"servelab-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, window: tuple[float, float] | None) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._out is not None:
            self._last()
            self._out.close()
            self._out = None
        return self.summary(window)

    def _loop(self) -> None:
        assert self._clock is not None
        next_t = self._clock.now()
        while not self._stop.is_set():
            self._sample()
            next_t += self.period
            delay = next_t - self._clock.now()
            if delay < 0 and self.skip_ahead:
                next_t, delay = self._clock.now(), 0.0
            self._stop.wait(max(0.0, delay))

    def _sample(self) -> None:
        assert self._clock is not None
        t = self._clock.now()
        rec: Record = {"t": round(t, self.t_digits)}
        try:
            rec.update(self._tick(t))
        except Exception as exc:  # a sampler bug must not end the run: record it and go on
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        self.records.append(rec)
        self._out.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._out.flush()
