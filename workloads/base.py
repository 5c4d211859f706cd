"""What a workload hands the load engine: sessions of one or more turns.

A single-shot request is a session of one turn. A multi-turn conversation yields its next request only
after the previous response arrived (history carried, think time before the next turn), so the engine
asks the session for it with the response text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from workloads.contracts import GenRequest


class Session(ABC):
    """One unit of dispatch. ``at`` is the trace time offset (s) for replay, else None."""

    cls: str
    at: float | None = None

    @abstractmethod
    def first(self) -> GenRequest:
        """The first request."""

    def next(self, response_text: str) -> tuple[float, GenRequest] | None:
        """(think time in s, next request) after a response, or None when the session is over."""
        return None


@dataclass
class SingleShot(Session):
    request: GenRequest
    at: float | None = None

    @property
    def cls(self) -> str:  # type: ignore[override]
        return self.request.workload_class

    def first(self) -> GenRequest:
        return self.request


@dataclass
class ArrivalSpec:
    """Arrival settings a workload file may carry; CLI flags override them."""

    process: str | None = None  # "closed", "constant", "poisson", "gamma", "trace"
    rate: float | None = None  # req/s for open loop
    concurrency: int | None = None  # for closed loop
    burstiness: float | None = None  # gamma shape (1.0 = Poisson, <1 burstier)


class Workload(ABC):
    """A reproducible source of sessions: the same seed yields the same sessions, byte for byte."""

    finite = False  # True: its sessions end (a trace, a dataset), and a run sends them all by default

    name: str
    arrival: ArrivalSpec

    @abstractmethod
    def sessions(self, seed: int) -> Iterator[Session]:
        """Sessions in dispatch order; may be infinite (synthetic) or finite (trace)."""

    def describe(self) -> dict[str, object]:
        """The workload's identity for fingerprints (everything that changes the traffic)."""
        return {"name": self.name}

    def shares_prefix(self) -> bool | None:
        """Whether its requests share prompt prefixes on purpose (a server's prefix cache should hit them):
        True, False, or None when it cannot tell (recorded traffic)."""
        return None
