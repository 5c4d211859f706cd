"""When a probe is decided: the sequential test over its looks (:class:`Sequential`) and an open loop's
overload seen in its growing backlog (:class:`Backlog`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from loadgen.capacity.stats import Samples, SloCheck, backlog_growth, check, correlation_time, over_slo
from loadgen.metrics.slo import SLO


@dataclass
class Decision:
    verdict: str  # "pass" | "fail"
    confident: bool
    reason: str


class Sequential:
    """When is a probe decided? Looks at sample counts ``first·1.5^k`` (up to ``max_samples``) and, in place
    of the looks left, once at the probe's end (:meth:`end`), each at z of ``confidence`` split over the
    looks (Bonferroni). ``pooled``: a probe for :func:`pooled_fit`, which runs to its cap (one look at
    ``max_samples``, no stop on a growing backlog): a probe stopped when its data looked decided is a biased
    sample of its miss share."""

    def __init__(self, slos: Sequence[SLO], confidence: float = 0.95, first: int = 30, max_samples: int = 2000,
                 resolution: float = 0.05, pooled: bool = False) -> None:  # fmt: skip
        self.slos, self.confidence, self.resolution, self.pooled = list(slos), confidence, resolution, pooled
        self.looks = [max_samples if pooled else first]
        while self.looks[-1] < max_samples:
            self.looks.append(min(max_samples, math.ceil(self.looks[-1] * 1.5)))
        self.z = NormalDist().inv_cdf(1 - (1 - confidence) / len(self.looks))
        self.max_samples = max_samples
        self.next_look = 0

    def checks(self, samples: Samples) -> list[SloCheck]:
        """Each SLO on the probe's steady state (:meth:`Samples.steady`)."""
        steady = samples.steady()
        return [check(steady, s, self.z, self.confidence) for s in self.slos]

    def due(self, n: int) -> bool:
        """Does a look fall at n samples?"""
        return self.next_look < len(self.looks) and n >= self.looks[self.next_look]

    def decide(self, samples: Samples) -> Decision | None:
        """A decision at the next look that ``samples`` reached; None: more samples."""
        if self.next_look >= len(self.looks) or len(samples) < self.looks[self.next_look]:
            return None
        while self.next_look < len(self.looks) and len(samples) >= self.looks[self.next_look]:
            self.next_look += 1
        d = self.confident(samples)
        if d is None and len(samples) >= self.max_samples:
            return self.end(samples, "sample cap")
        return d

    def end(self, samples: Samples, why: str) -> Decision:
        """The probe's end at its sample or time cap: one last look at the same z while a look is left and the
        first look's samples are in (the looks it skips are never taken, so the split over the looks holds),
        else the verdict of the point estimates (not confident)."""
        if self.next_look < len(self.looks) and len(samples) >= self.looks[0]:
            self.next_look = len(self.looks)
            if (d := self.confident(samples)) is not None:
                return d
        bad = [c.key for c, s in zip(self.checks(samples), self.slos, strict=True) if over_slo(c, s)]
        unsteady = backlog_growth(samples, self.z, self.resolution) if not bad else None
        return Decision("fail" if bad else "pass", False, f"{why}: point estimate" + (f", {', '.join(bad)} over" if bad else "")
                        + (f"; {unsteady}" if unsteady else ""))  # fmt: skip

    def confident(self, samples: Samples) -> Decision | None:
        """A confident verdict: an SLO violated fails; every SLO holding passes once the server has kept up
        with the load (:func:`backlog_growth`). None: more samples."""
        checks = self.checks(samples)
        bad = [c.key for c in checks if c.state == "violated"]
        if bad:
            return Decision("fail", True, f"{', '.join(bad)} violated")
        if all(c.state == "holds" for c in checks) and backlog_growth(samples, self.z, self.resolution) is None:
            return Decision("pass", True, "every SLO holds")
        return None


class Backlog:
    """Open-loop overload, seen before any request of the overload has ended: the backlog (sent, not answered)
    grows by more than ``share`` of the arrival rate over the second half of the probe (from ``min_s``
    seconds on), significantly at ``z``: the slope's error counts the backlog's fluctuations about the line
    as correlated over their batch-means correlation time and at least twice a request's mean residence
    (Little's law: backlog / rate), since near saturation a random burst lifts the backlog for seconds."""

    def __init__(self, rate: float, share: float = 0.1, min_s: float = 2.0, z: float = 2.33) -> None:
        self.rate, self.share, self.min_s, self.z = rate, share, min_s, z
        self.trace: list[tuple[float, int]] = []

    def overloaded(self, t: float, backlog: int) -> str | None:
        self.trace.append((t, backlog))
        if t < self.min_s:
            return None
        half = [(a, b) for a, b in self.trace if a >= t / 2]
        if len(half) < 4:
            return None
        ts, bs = np.asarray(half, dtype=float).T
        fit = np.polyfit(ts, bs, 1)
        resid = bs - np.polyval(fit, ts)
        residence = 2 * float(bs.mean()) / self.rate * (ts.size - 1) / float(ts[-1] - ts[0])  # in trace points
        se = math.sqrt(float(resid.var()) * max(correlation_time(resid), residence) / float(((ts - ts.mean()) ** 2).sum()))
        slope = float(fit[0])
        if slope - self.z * se > self.share * self.rate and backlog > 10:
            return f"backlog growing {slope:.1f} req/s (now {backlog} in flight)"
        return None
