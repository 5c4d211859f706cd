"""A probe of the search: its result (:class:`Probe`), what runs one (:class:`Prober`), and the one decision
loop that the live and the simulated prober both look at every tick (:class:`ProbeJudge`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Protocol

import numpy as np

from loadgen.capacity.sequential import Backlog, Decision, Sequential
from loadgen.capacity.stats import Samples, SloCheck, check, over_slo
from loadgen.metrics import definitions as metrics
from loadgen.metrics.slo import ERROR_RATE, SLO


@dataclass
class Probe:
    """One probe of the search, as it appears in the probe table and capacity.json."""

    index: int
    phase: str  # "pilot" | "search"
    mode: str
    load: float
    verdict: str
    confident: bool
    reason: str
    seconds: float
    requests: int
    errors: int
    checks: list[SloCheck]
    throughput: float | None = None  # successful req/s
    goodput: float | None = None  # req/s meeting every SLO
    mean_e2e: float | None = None
    max_e2e: float | None = None  # the slowest finished request's (a closed loop's first wave ends with it)
    warnings: list[str] = field(default_factory=list)
    dir: str | None = None
    pooled: bool = False  # ran to its cap for the pooled fit (:class:`Sequential`)
    bursty: bool = False  # random open-loop arrivals (:attr:`Samples.bursty`)


class SearchStopped(Exception):
    """A probe ended the search: ``status`` ``interrupted`` (SIGINT/SIGTERM) or ``server_gone``."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class Prober(Protocol):
    async def probe(self, mode: str, load: float, seq: Sequential | None, max_seconds: float, index: int,
                    phase: str) -> Probe: ...  # fmt: skip


def probe_result(
    index: int, phase: str, mode: str, load: float, samples: Samples, seq: Sequential | None, slos: Sequence[SLO],
    decision: Decision, seconds: float, span: float | None,
) -> Probe:  # fmt: skip
    checks = seq.checks(samples) if seq is not None else [check(judged(samples), s, NormalDist().inv_cdf(0.975)) for s in slos]
    failed = np.asarray(samples.failed, dtype=bool)
    e2e = np.asarray(samples.values[metrics.E2E.tag], dtype=float)[~failed] if len(samples) else np.empty(0)
    good = sum(1 for i in range(len(samples)) if not samples.failed[i] and _meets(samples, i, slos))
    return Probe(
        index, phase, mode, load, decision.verdict, decision.confident, decision.reason, seconds, len(samples),
        int(failed.sum()), checks, throughput=(len(samples) - int(failed.sum())) / span if span else None,
        goodput=good / span if span else None, mean_e2e=float(e2e.mean()) if e2e.size else None,
        max_e2e=float(e2e.max()) if e2e.size else None,
        pooled=seq is not None and seq.pooled, bursty=samples.bursty,
    )  # fmt: skip


def _meets(samples: Samples, i: int, slos: Sequence[SLO]) -> bool:
    for s in slos:
        if s.metric != ERROR_RATE:
            v = samples.values[s.metric][i]
            if not math.isnan(v) and v > s.limit:
                return False
    return True


def pilot_requests(c: int) -> int:
    """The requests a pilot at ``c`` sessions judges (its first wave left out: :func:`judged`): two waves, at least
    four (at one session eight took 30-40 s of a 480-s budget on the reference server, for a point far under the
    limits that the search's fit does not use)."""
    return max(4, 2 * c)


def pilot_sends(c: int) -> int:
    """The most requests a pilot's closed loop sends: twice those it judges, so that every session keeps sending
    until the judged ones have ended (the probe stops then). A loop that stopped sending at the judged count
    drained while its last wave ran, the batch shrinking under it: on the reference server a pilot at 64 sessions
    read TPOT p90 129-147 ms where the steady state gives ~177, passed there, and sent the search past the
    capacity (50 sessions)."""
    return 2 * pilot_requests(c)


def probe_requests(seq: Sequential | None, load: float) -> tuple[int, int]:
    """(the most requests a probe judges, the most it sends): a search probe's sample cap for both, a pilot's
    :func:`pilot_requests` and :func:`pilot_sends`."""
    if seq is not None:
        return seq.max_samples, seq.max_samples
    return pilot_requests(int(load)), pilot_sends(int(load))


def judged(samples: Samples) -> Samples:
    """A pilot's requests that its verdict reads: the steady part, or all of them when the probe ended within its
    first wave (a slow server: the burst is all there is to read)."""
    steady = samples.steady()
    return steady if len(steady) else samples


def pilot_decision(samples: Samples, slos: Sequence[SLO]) -> Decision:
    """A pilot's verdict on the point estimates of its steady part (:meth:`Samples.steady`): a closed loop's first
    wave is every session sent at once into the idle server, whose TTFT is that burst's (the reference server,
    chat-short: a pilot at 16 sessions judged on both its waves gave TTFT p90 2.2 s, the search probes at 14-24
    sessions 0.4-0.5 s), which sent the search below a quarter of the capacity."""
    bad = [s.key for s in slos if over_slo(check(judged(samples), s, 0.0), s)]
    if bad:
        return Decision("fail", False, f"pilot: {', '.join(bad)} over")
    return Decision("pass", False, "pilot: point estimates within the SLOs")


class ProbeJudge:
    """The one decision loop of a probe, looked at every tick by the live and the simulated prober alike.

    Each look gives the cohort's size (requests sent by the latest moment by which all sent had ended),
    a builder of its :class:`Samples` (called only when the look is due: built anew from the cohort), whether
    the probe is over (its time or its requests used up), the probe's elapsed seconds and the requests in
    flight. The verdict comes, in this order, from the sequential test on a due look, the end of the
    probe, a pilot's full sample, or an open-loop backlog that keeps growing."""

    def __init__(self, slos: Sequence[SLO], seq: Sequential | None, cap: int, load: float, closed: bool,
                 bursty: bool) -> None:  # fmt: skip
        self.slos, self.seq, self.cap = slos, seq, cap
        self.shape = (int(load), None) if closed else (1, load)  # the samples' wave and rate
        self.bursty = bursty
        self.backlog = None if closed else Backlog(load)
        self.samples = Samples()

    def look(self, n: int, build: Callable[[], Samples], over: bool, t: float, inflight: int) -> Decision | None:
        seq = self.seq
        if n > len(self.samples) and (over or n >= self.cap or seq is not None and seq.due(n)):
            self.samples = build()
            self.samples.wave, self.samples.rate = self.shape
            self.samples.bursty = self.bursty
            if seq is not None and (decision := seq.decide(self.samples)) is not None:
                return decision
        if over:
            return pilot_decision(self.samples, self.slos) if seq is None else seq.end(self.samples, "sample/time cap")
        if seq is None and len(self.samples) >= self.cap:
            return pilot_decision(self.samples, self.slos)
        if self.backlog is not None and (seq is None or not seq.pooled) and (why := self.backlog.overloaded(t, inflight)):
            return Decision("fail", True, why)
        return None
