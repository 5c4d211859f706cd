"""A load point's live counters (:class:`Progress`), which the dispatch increments and the CLI displays."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loadgen.metrics import definitions as metrics
from workloads.contracts import RequestRecord


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
