"""SLO capacity search: the highest load (open-loop rate or closed-loop concurrency) at which every SLO holds.

The search (:func:`search`) runs in two phases, all probes through one :class:`Prober`:

1. **Pilot** (cheap first estimate): closed-loop probes at concurrency 1, 2, 4, ... of a couple of waves
   each, judged on point estimates, until one misses an SLO. Concurrency mode starts from the last one
   that met them; rate mode from its throughput (Little's law: rate = concurrency / latency).
2. **Bracket, then bisect**, with statistical probes: each probe runs until a sequential test decides
   (:class:`Sequential`): for every SLO ``metric_pQ <= limit`` the share of requests above the limit (a
   failed request counts as above) has a Wilson interval; the SLO holds when the interval lies below
   ``1 - Q``, is violated when it lies above (equivalently: an order-statistic interval of the quantile
   lies below / above the limit). The test looks at geometrically spaced sample counts with a Bonferroni
   correction, so each verdict has the stated confidence. An open-loop probe whose backlog (requests sent
   but not answered) keeps growing is overloaded and fails at once; a probe still undecided at its
   sample/time cap is judged on its point estimate and marked not confident.

The answer: ``[lo, hi]`` = the highest load that passed and the lowest that failed; the search stops when
the interval is within ``±resolution`` (or for concurrency adjacent integers), when the time budget runs
out (it says so and reports the bracket it holds), when the SLOs fail at the lowest load (unreachable)
or hold at the highest (not saturated).

Probers: :class:`LiveProber` runs :func:`loadgen.engine.run_point` against a server;
:class:`loadgen.servicemodel.SimProber` runs the known-answer service model in virtual time (tests and the
cost comparison with a linear sweep, :func:`linear_sweep`).

Size: SLO parsing, the sequential probe decisions, the search, the live prober and the gate on capacity:
one file because they share the probe and decision types; the natural next split is the gate
(``gate_capacity``) into loadgen/gate.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from statistics import NormalDist
from typing import Any, Protocol

import numpy as np

from loadgen import metrics
from loadgen.clock import RunClock
from loadgen.defaults import REQUEST_TIMEOUT_S, REQUESTS_FILE
from loadgen.engine import LoadSpec, Progress, run_point
from loadgen.fleet import ONE_PROCESS, Fleet
from loadgen.gate import Check, GateReport, t_quantile
from loadgen.slo import SLO
from workloads.contracts import read_jsonl

MODES = ("rate", "concurrency")
# --- the statistical decision --------------------------------------------------------------------------


def wilson_eff(k: int, n: int, z: float, tau: float) -> tuple[float, float]:
    """Wilson interval with ``n / tau`` effective samples (``tau``: integrated correlation time in requests)."""
    if n == 0:
        return (0.0, 1.0)
    n_eff = max(1.0, n / tau)
    p = k / n
    d = 1 + z * z / n_eff
    c = (p + z * z / (2 * n_eff)) / d
    h = z * math.sqrt(p * (1 - p) / n_eff + z * z / (4 * n_eff * n_eff)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def correlation_time(series: np.ndarray, exponential: bool = False) -> float:
    """Integrated autocorrelation time (in requests) of a series in completion order, by batch means over
    ``sqrt(n)`` batches: requests that overlap share the server's state (queue, batch), so n of them carry
    less than n independent samples' worth of evidence. 1 for a constant or short series. ``exponential``:
    a series whose correlation decays gradually (a queue's length), whose batch-means value is corrected for
    the part of the correlation longer than a batch (:func:`_ar1_tau`); at most n (the probe as one sample), and
    n when the series is too short to bound its decay (a handful of requests can all lie in one burst)."""
    x = np.asarray(series, dtype=float)
    n = x.size
    m = int(math.sqrt(n))
    var = float(x.var()) if n else 0.0
    if exponential and m < 4 and var > 0:
        return float(n)
    if m < 4 or var <= 1e-12 * max(1.0, float(np.abs(x).max()) ** 2):
        return 1.0
    batches = x[: m * m].reshape(m, m).mean(axis=1)
    seen = m * float(batches.var()) / var
    return min(float(n), _ar1_tau(seen, m)) if exponential else max(1.0, seen)


def _ar1_tau(seen: float, b: float) -> float:
    """The integrated correlation time whose batch means of ``b`` requests show ``seen``: batches as long as the
    correlation see only part of it (a queue excursion longer than a batch is split across batches), so the
    batch-means value is inverted under an exponential autocorrelation ``rho^k``, for which it is
    ``1 + 2·rho/(1-rho) - 2·rho·(1 - rho^b) / (b·(1-rho)^2)``; infinite when ``seen`` reaches ``b`` (batches
    too short to bound it)."""
    if seen <= 1:
        return 1.0
    if seen >= b:
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(50):  # the value grows with rho from 1 (rho 0) to b (rho -> 1)
        r = (lo + hi) / 2
        lo, hi = (r, hi) if 1 + 2 * r / (1 - r) - 2 * r * (1 - r**b) / (b * (1 - r) ** 2) < seen else (lo, r)
    return (1 + lo) / (1 - lo)


def design_effect(x: np.ndarray, m: int, z: float) -> float:
    """How many requests count as one independent sample when groups of ``m`` consecutive ones (a closed
    loop's wave of sessions, in send order) share part of their latency: ``1 + (m - 1)·ICC``, the
    intra-class correlation at its upper confidence bound at ``z`` from a one-way ANOVA of ``x`` (Searle's
    interval: the between- over within-group mean squares against the F distribution's lower quantile,
    :func:`_f_lower`). Sessions that run together share a prefill step or a decode batch, but each also has
    its own prompt and answer; the data say how much is shared. Between 1 and ``m``, and ``m`` (a wave
    counts once) where the data cannot tell: fewer than 2 groups, or no spread within them."""
    g = x.size // m
    if m < 2 or g < 2:
        return float(max(1, m))
    y = np.asarray(x[: g * m], dtype=float).reshape(g, m)
    within = float(y.var(axis=1, ddof=1).mean())
    f_lo = _f_lower(z, g - 1, g * (m - 1))
    if within <= 1e-12 * max(1.0, float(np.abs(y).max()) ** 2) or f_lo <= 0:
        return float(m)
    ratio = m * float(y.mean(axis=1).var(ddof=1)) / within / f_lo
    return min(float(m), max(1.0, m * ratio / (ratio + m - 1)))


def _f_lower(z: float, d1: int, d2: int) -> float:
    """The lower quantile of the F(d1, d2) distribution at ``z`` standard deviations (one-sided), by
    Paulson's normal approximation of ``F^(1/3)``: it errs low (checked against sampled F quantiles at
    d1 = 2..49), so the bound built on it is conservative; 0 where it breaks down (d1 of 1 or 2 at small
    tail shares)."""
    a, b = 2 / (9 * d1), 2 / (9 * d2)
    qa, qb, qc = (1 - b) ** 2 - z * z * b, -2 * (1 - a) * (1 - b), (1 - a) ** 2 - z * z * a
    disc = qb * qb - 4 * qa * qc
    if qa <= 0 or disc < 0:
        return 0.0
    return max(0.0, (-qb - math.sqrt(disc)) / (2 * qa)) ** 3


@dataclass
class Samples:
    """Per-request outcomes of a probe, in send order: the SLO metrics (NaN when undefined, e.g. TPOT of a
    one-token answer), whether the request failed, and when it was sent and ended (s)."""

    values: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in metrics.SLO_KEYS})
    failed: list[bool] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    wave: int = 1  # requests that move together: a closed loop's sessions (1: open-loop arrivals)
    rate: float | None = None  # the open-loop arrival rate (None: a closed loop)
    bursty: bool = False  # random open-loop arrivals (Poisson, gamma), whose bursts queue: see :meth:`overlap`

    def add(self, ttft: float | None, tpot: float | None, e2e: float | None, failed: bool,
            sent: float = math.nan, end: float = math.nan) -> None:  # fmt: skip
        for m, v in zip(metrics.SLO_KEYS, (ttft, tpot, e2e), strict=True):
            self.values[m].append(math.nan if v is None else v)
        self.failed.append(failed)
        self.sent.append(sent)
        self.end.append(end)

    def add_record(self, r: dict[str, Any]) -> None:
        """A ``requests.jsonl`` record, with the metric definitions of :mod:`loadgen.metrics`."""
        ok = r["error"] is None
        self.add(metrics.ttft(r) if ok else None, metrics.tpot(r) if ok else None, metrics.e2e(r) if ok else None,
                 not ok, r["sent"], r["end"])  # fmt: skip

    def __len__(self) -> int:
        return len(self.failed)

    def timed(self) -> bool:
        """Every request has its send and end times (at least two requests): the backlog can be computed."""
        return len(self) >= 2 and not (np.isnan(self.sent).any() or np.isnan(self.end).any())

    def backlog(self) -> np.ndarray:
        """The requests in flight (sent, not ended) that each request finds when it is sent."""
        sent, end = np.asarray(self.sent), np.sort(np.asarray(self.end))
        return np.arange(sent.size) - np.searchsorted(end, sent, side="right")

    def overlap(self) -> float:
        """The correlation floor of a latency SLO's evidence, in requests: a closed loop's sessions move together
        (one wave); random arrivals come in bursts that queue, and near saturation a queue lasts longer than
        the probe's batches show, even when no request of it missed the SLO yet: the correlation time of the
        backlog each request finds (the server's state), corrected for its decay beyond a batch. Constant
        arrivals do not burst (their backlog is periodic, which batch means do not measure as a decay)."""
        if not self.bursty or not self.timed():
            return float(self.wave)
        return max(float(self.wave), correlation_time(self.backlog(), exponential=True))

    def steady(self) -> Samples:
        """The requests from the first one that finds as many requests in flight as the probe's second half
        finds on average (the crossing-the-mean rule of simulation output analysis): a probe starts on an
        idle server (its warm-up is drained), and the requests that fill it are faster than the steady state.
        A closed loop's whole first wave is left out: its ``wave`` requests are sent at once into the idle
        server and share one burst of prefill (slower than the steady state, where sessions desynchronise),
        and the last of them already finds as many in flight as a steady request. All of them without send
        and end times."""
        if not self.timed():
            return self
        backlog = self.backlog()
        k = int(np.argmax(backlog >= backlog[len(self) // 2 :].mean()))
        k = max(k, self.wave) if self.rate is None else k
        return Samples({m: v[k:] for m, v in self.values.items()}, self.failed[k:], self.sent[k:], self.end[k:],
                       self.wave, self.rate, self.bursty)  # fmt: skip

@dataclass
class SloCheck:
    """One SLO at one probe: misses k of n, the share's interval, the percentile and its interval."""

    key: str
    limit: float
    n: int
    misses: int
    share_lo: float
    share_hi: float
    value: float | None  # the percentile (point estimate); error_rate: the observed share
    value_lo: float | None  # the percentile's lower bound (order statistic), None: unbounded
    value_hi: float | None  # its upper bound (lognormal tolerance limit), None: none yet
    state: str  # "holds" | "violated" | "open"
    tau: float = 1.0  # the correlation time the verdict counted (requests per independent sample)


def check(samples: Samples, slo: SLO, z: float, confidence: float = 0.95) -> SloCheck:
    """One SLO's state at ``z`` (one-sided, per side). Violated: the Wilson interval of the share of misses
    lies above the allowed share. Holds: for error_rate, when that interval lies below it; for a latency SLO,
    when its percentile's upper bound (:func:`lognormal_upper`) is under the limit, at most half the allowed
    share of requests missed it, and the probe holds enough independent requests that a slow mode hitting
    the allowed share would have shown itself at ``confidence`` (:func:`units_to_see`)."""
    failed = np.asarray(samples.failed, dtype=bool)
    if slo.metric == "error_rate":
        miss, vals = failed, np.empty(0)
        value, vlo, vhi = (float(miss.mean()) if miss.size else None), None, None
    else:
        raw = np.asarray(samples.values[slo.metric], dtype=float)
        vals = np.where(failed, math.inf, raw)
        vals = vals[~np.isnan(vals)]  # undefined (one-token TPOT) cannot miss
        miss = vals > slo.limit
    n, k = int(miss.size), int(miss.sum())
    # misses cluster as the latencies do (with no miss yet, the latencies' own clustering stands in), and
    # requests that overlap share their latency: a closed loop's wave of sessions by the share of their
    # (log) latency that the data show in common, or wholly when a request failed (a failure shared by
    # overlapping requests shows in the failures' own correlation time)
    finite = vals[np.isfinite(vals)]
    if slo.metric == "error_rate":
        wave = 1.0
    elif samples.rate is None and finite.size == n:
        wave = design_effect(np.log(finite) if n and finite.min() > 0 else finite, samples.wave, z)
    else:
        wave = samples.overlap()
    tau = max(correlation_time(miss), correlation_time(finite) if finite.size == n else 1.0, wave)
    lo, hi = wilson_eff(k, n, z, tau)
    if slo.metric == "error_rate":
        holds = hi <= slo.allowed
    else:
        value, vlo = _quantile_lower(vals, slo.q, z, tau)
        vhi = lognormal_upper(vals, slo.q, z, n / tau)
        margin = k == 0 and n / tau >= units_to_see(slo, confidence) and vhi is not None and vhi <= slo.limit
        holds = hi <= slo.allowed or margin
    state = "violated" if lo > slo.allowed else "holds" if holds else "open"
    return SloCheck(slo.key, slo.limit, n, k, lo, hi, value, vlo, vhi, state, tau)


def units_to_see(slo: SLO, confidence: float) -> float:
    """Independent requests (``n / tau``) a latency SLO needs before it can hold: with this many, a slow mode
    that hits the allowed share of them is missing from the probe with a chance of at most ``1 -
    confidence`` (``(1 - allowed)^u <= exp(-allowed·u)``), whatever the latency model (p90 at 95 %: 30)."""
    return math.log(1 / (1 - confidence)) / slo.allowed


def _quantile_lower(vals: np.ndarray, q: float, z: float, tau: float) -> tuple[float | None, float | None]:
    """Point estimate of the q-quantile and its lower bound: the order statistic the Wilson lower bound on the
    miss share points at (normal approximation, the rank spread widened by the correlation time)."""
    n = vals.size
    if n == 0:
        return None, None
    s = np.sort(vals)
    point = float(np.percentile(s, q * 100)) if np.isfinite(s).all() else _rank(s, math.ceil(q * n))
    return point, _rank(s, math.floor(n * q - z * math.sqrt(n * q * (1 - q) * tau)))


def lognormal_upper(vals: np.ndarray, q: float, z: float, n_eff: float) -> float | None:
    """Upper confidence bound of the q-quantile of ``vals`` under a lognormal model: the one-sided tolerance
    limit ``exp(mean + k·sd)`` of the log latencies, ``k`` for ``n_eff`` independent samples at ``z``
    (Natrella's approximation of the noncentral-t factor). None when the model cannot say (a failed request,
    too few effective samples, a bound beyond any float: ``k`` grows without limit as ``n_eff`` falls to
    ``1 + z²/2``)."""
    a = 1 - z * z / (2 * (n_eff - 1)) if n_eff > 1 else 0.0
    if vals.size < 2 or a <= 0 or not np.isfinite(vals).all() or vals.min() <= 0:
        return None
    zp = NormalDist().inv_cdf(q)
    k = (zp + math.sqrt(max(0.0, zp * zp - a * (zp * zp - z * z / n_eff)))) / a
    logs = np.log(vals)
    bound = logs.mean() + k * logs.std(ddof=1)
    return float(math.exp(bound)) if bound < math.log(np.finfo(float).max) else None


def _rank(s: np.ndarray, r: int) -> float | None:
    """The r-th smallest (1-based); None outside 1..n or when infinite (a failed request)."""
    if r < 1 or r > s.size or not np.isfinite(s[r - 1]):
        return None
    return float(s[r - 1])


def samples_to_hold(slo: SLO, z: float, confidence: float) -> int:
    """The fewest independent requests, none missing, that can confirm ``slo``: for error_rate its Wilson
    bound (error_rate=1% at 95 % needs several hundred), for a latency SLO :func:`units_to_see`."""
    if slo.metric != "error_rate":
        return math.ceil(units_to_see(slo, confidence))
    return math.ceil(z * z * (1 - slo.allowed) / slo.allowed)


def backlog_growth(samples: Samples, z: float, resolution: float) -> str | None:
    """Has an open-loop probe's server kept up with its arrivals? None when it has, else why not yet.

    The backlog each request finds when it is sent (requests sent before it and not ended) is stationary at a
    rate the server sustains; it climbs while the server fills from idle (a probe starts on an idle server:
    its warm-up is drained) and keeps climbing above the sustainable rate. Latencies can lag that climb (a
    TTFT SLO breaks only once the slots are full and a queue forms), so a latency verdict on the first
    requests alone would pass any rate. Kept up: the backlog's mean over the probe's second half exceeds
    the first half's by less than ``resolution`` of the arrivals over half the probe (what the rate
    ``(1 + resolution)`` times the sustainable one would add), at ``z`` with batch-means errors."""
    if samples.rate is None:
        return None  # a closed loop's sessions bound its backlog
    backlog = samples.backlog()
    a, b = backlog[: backlog.size // 2], backlog[backlog.size // 2 :]
    if a.size < 2:
        return "too few requests to see the backlog"
    se = math.sqrt(sum(float(x.var()) * correlation_time(x) / x.size for x in (a, b)))
    growth = float(b.mean() - a.mean())
    allowed = resolution * samples.rate * (samples.sent[-1] - samples.sent[0]) / 2
    if growth + z * se > allowed:
        return f"backlog still growing (+{growth:.1f} in flight from the first half to the second)"
    return None


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
        bad = [c.key for c, s in zip(self.checks(samples), self.slos, strict=True) if _over(c, s)]
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


def _over(c: SloCheck, s: SLO) -> bool:
    """Over the SLO on the point estimate (no sample at all counts as over)."""
    return c.n == 0 or c.misses / c.n > s.allowed


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


# --- the evidence of every probe near the crossing at once (open loop) --------------------------------


@dataclass
class Fit:
    """The capacity from the open-loop probes near the SLO crossing together (:func:`pooled_fit`): each end
    None when the probed loads do not bound it."""

    lo: float | None
    hi: float | None
    estimate: float
    probes: int  # the probes it pooled


def _logistic(u: np.ndarray, k: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Logistic regression of ``k`` misses of ``n`` (effective counts) on ``u`` by Newton's method:
    coefficients and their covariance; None when it does not converge (misses and passes separated by load:
    a step, as under constant arrivals, has no finite slope)."""
    x = np.column_stack([np.ones_like(u), u])
    share = min(max(k.sum() / n.sum(), 1e-3), 1 - 1e-3)
    b = np.array([math.log(share / (1 - share)), 0.0])
    for _ in range(50):
        p = 1 / (1 + np.exp(-(x @ b)))
        info = x.T @ (x * (n * p * (1 - p))[:, None])
        if np.linalg.cond(info) > 1e12:
            return None
        step = np.linalg.solve(info, x.T @ (k - n * p))
        b = b + step
        if np.abs(b).max() > 1e3:
            return None
        if np.abs(step).max() < 1e-9:
            return b, np.linalg.inv(info)
    return None


def pooled_fit(slos: Sequence[SLO], probes: Sequence[Probe], confidence: float, width: float = 0.2,
               least: int = 4) -> Fit | None:
    """The capacity's interval from every open-loop search probe within ``±width`` of the crossing at once.

    Under random arrivals the share of requests missing an SLO rises slowly through the capacity (a p90 TTFT:
    from ~7 % at 0.95x to ~16 % at 1.05x), so one probe alone needs thousands of requests to tell 0.95x from
    the capacity; every probe near it carries part of that evidence. Per SLO, the misses of each probe
    (counted as ``n / tau`` effective samples, ``tau`` the probes' mean correlation time) are fitted by a logistic
    regression on log load, and the loads whose confidence band of the miss share contains the allowed share
    (the Fieller interval of the crossing, at ``confidence`` two-sided, split over the SLOs) form its
    interval; an SLO with no miss yet is bounded by the pooled zero-miss bound of the probes at and above
    each load (the miss share grows with the load). The capacity is the lowest SLO's crossing. Only probes that
    ran to their cap count (pooled ones, and those undecided there): one stopped when its data looked decided
    (or its backlog grew) is a biased sample. None: fewer than two loads, or no fit."""
    eligible = [p for p in probes if p.phase == "search" and p.mode == "rate" and p.requests
                and p.pooled]  # fmt: skip
    if len({p.load for p in eligible}) < 2:
        return None
    z = NormalDist().inv_cdf(1 - (1 - confidence) / (2 * len(slos)))
    center, fit = float(np.exp(np.mean([math.log(p.load) for p in eligible]))), None
    for _ in range(3):  # the window follows the estimate
        near = [p for p in eligible if abs(math.log(p.load / center)) <= math.log1p(width)]
        if len({p.load for p in near}) < 2:
            return fit
        u = np.log([p.load / center for p in near])
        grid = np.linspace(-math.log1p(width), math.log1p(width), 401)  # the fit's model holds across the window
        lows, highs, points = [], [], []
        for i, slo in enumerate(slos):
            # one correlation time for all (their mean): a probe's own estimate is noisy and lowest in a probe
            # that saw few bursts, so weighting each by its own would favour the probes with few misses
            tau = float(np.mean([p.checks[i].tau for p in near]))
            k = np.asarray([p.checks[i].misses for p in near]) / tau
            n = np.asarray([p.checks[i].n for p in near]) / tau
            if k.sum() == 0:  # holds up to the highest load whose probes at and above bound it below the share
                pooled = np.asarray([n[u >= g].sum() for g in grid])
                ok = math.log(1 / (1 - NormalDist().cdf(z))) < slo.allowed * pooled
                lows.append(math.inf if ok.all() else float(grid[np.argmin(ok)]) if ok[0] else None)
                highs.append(math.inf)
                continue
            got = _logistic(u, k, n)
            if got is None:
                return fit
            b, cov = got
            q = z
            if len(near) > 2:  # the probes' scatter about the fit (quasi-binomial: t with the fit's degrees of freedom)
                share = 1 / (1 + np.exp(-(b[0] + b[1] * u)))
                cov = cov * max(1.0, float(((k - n * share) ** 2 / (n * share * (1 - share))).sum()) / (len(near) - 2))
                q = t_quantile(NormalDist().cdf(z), len(near) - 2)
            eta = b[0] + b[1] * grid
            se = np.sqrt(cov[0, 0] + 2 * cov[0, 1] * grid + cov[1, 1] * grid * grid)
            target = math.log(slo.allowed / (1 - slo.allowed))
            holds, fails = eta + q * se < target, eta - q * se > target
            # the lower end: the top of the run of confident holds from the lowest load; the upper: the start
            # of the run of confident failures up to the highest
            lows.append(math.inf if holds.all() else float(grid[np.argmin(holds) - 1]) if holds[0] else None)
            highs.append(math.inf if not fails[-1] else float(grid[0] if fails.all() else grid[len(fails) - np.argmin(fails[::-1])]))
            if b[1] > 0:
                points.append((target - b[0]) / b[1])
        lo = None if None in lows or min(lows) == math.inf or len(near) < least else min(lows)  # type: ignore[type-var]
        hi = None if min(highs) == math.inf or len(near) < least else min(highs)
        est = min(points) if points else float(grid[-1])
        fit = Fit(None if lo is None else center * math.exp(lo), None if hi is None else center * math.exp(hi),
                  center * math.exp(float(np.clip(est, grid[0], grid[-1]))), len(near))  # fmt: skip
        if abs(math.log(fit.estimate / center)) < 1e-3:
            break
        center = fit.estimate
    return fit


# --- probes -------------------------------------------------------------------------------------------


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


def _load_label(mode: str, load: float) -> str:
    return f"c{int(load):03d}" if mode == "concurrency" else f"r{load:07.2f}"


def probe_result(
    index: int, phase: str, mode: str, load: float, samples: Samples, seq: Sequential | None, slos: Sequence[SLO],
    decision: Decision, seconds: float, span: float | None,
) -> Probe:  # fmt: skip
    checks = seq.checks(samples) if seq is not None else [check(samples, s, NormalDist().inv_cdf(0.975)) for s in slos]
    failed = np.asarray(samples.failed, dtype=bool)
    e2e = np.asarray(samples.values["e2e"], dtype=float)[~failed] if len(samples) else np.empty(0)
    good = sum(1 for i in range(len(samples)) if not samples.failed[i] and _meets(samples, i, slos))
    return Probe(
        index, phase, mode, load, decision.verdict, decision.confident, decision.reason, seconds, len(samples),
        int(failed.sum()), checks, throughput=(len(samples) - int(failed.sum())) / span if span else None,
        goodput=good / span if span else None, mean_e2e=float(e2e.mean()) if e2e.size else None,
        pooled=seq is not None and seq.pooled, bursty=samples.bursty,
    )  # fmt: skip


def _meets(samples: Samples, i: int, slos: Sequence[SLO]) -> bool:
    for s in slos:
        if s.metric != "error_rate":
            v = samples.values[s.metric][i]
            if not math.isnan(v) and v > s.limit:
                return False
    return True


def pilot_requests(c: int) -> int:
    return max(8, 2 * c)


def pilot_decision(samples: Samples, slos: Sequence[SLO]) -> Decision:
    bad = [s.key for s in slos if _over(check(samples, s, 0.0), s)]
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


class LiveProber:
    """Probes a server with :func:`loadgen.engine.run_point`: rate mode with ``process`` arrivals (Poisson by
    default), concurrency mode closed loop. The probe's records are read as they are written (with
    ``fleet``'s workers, as the coordinator receives them); the probe is stopped (in-flight requests
    cancelled) as soon as it is decided."""

    def __init__(
        self, backend: Any, workload: Any, slos: Sequence[SLO], out_dir: Path, clock: RunClock | None = None,
        process: str = "poisson", seed: int = 0, tick: float = 0.25, timeout: float = REQUEST_TIMEOUT_S,
        client_kind: str = "aiohttp", fleet: Fleet = ONE_PROCESS,
    ) -> None:  # fmt: skip
        self.backend, self.workload, self.slos, self.out_dir = backend, workload, list(slos), out_dir
        self.clock = clock or RunClock()
        self.process, self.seed, self.tick, self.timeout, self.client_kind = process, seed, tick, timeout, client_kind
        self.fleet = fleet

    async def probe(self, mode: str, load: float, seq: Sequential | None, max_seconds: float, index: int,
                    phase: str) -> Probe:  # fmt: skip
        cap = seq.max_samples if seq is not None else pilot_requests(int(load))
        if mode == "concurrency" or phase == "pilot":
            c = int(load)
            spec = LoadSpec("closed", concurrency=c, num_requests=cap, warmup=c, seed=self.seed + index,
                            duration=max_seconds, drain=0.0, timeout=self.timeout)  # fmt: skip
        else:
            spec = LoadSpec(self.process, concurrency=None, rate=load, num_requests=cap, seed=self.seed + index,
                            warmup=min(50, math.ceil(load * 0.5)), duration=max_seconds, drain=0.0,
                            timeout=self.timeout)  # fmt: skip
        out = self.out_dir / "probes" / f"{index:02d}-{phase}-{_load_label(mode if phase != 'pilot' else 'concurrency', load)}"
        progress = Progress()
        task = asyncio.ensure_future(run_point(self.backend, self.workload, spec, out, self.clock,
                                               progress=progress, client_kind=self.client_kind, fleet=self.fleet))  # fmt: skip
        judge = ProbeJudge(self.slos, seq, cap, load, spec.process == "closed", spec.process not in ("closed", "constant"))
        decision: Decision | None = None
        t0 = self.clock.now()
        starts: list[tuple[float, int]] = []  # (run-clock time, requests started by then)
        path = out / REQUESTS_FILE
        measured: list[dict[str, Any]] = []
        while decision is None:
            done, _ = await asyncio.wait({task}, timeout=self.tick)
            now = self.clock.now()
            starts.append((now if progress.counted_at is None else progress.counted_at, progress.started))
            recs = read_jsonl(path) if path.exists() else []
            cohort = _cohort(recs, None if done else starts)
            measured = [r for r in cohort if not r["warmup"]]
            decision = judge.look(len(measured), partial(_samples, measured), bool(done), now - t0, progress.inflight)
        samples = judge.samples
        seconds = self.clock.now() - t0
        warnings: list[str] = []
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif task.exception() is None:
            summary = task.result()
            warnings = list(summary["client"]["warnings"])
            if "interrupted" in summary:
                raise SearchStopped("interrupted", f"interrupted by {summary['interrupted']['signal']}")
            if "aborted" in summary:
                raise SearchStopped("server_gone", summary["aborted"]["reason"])
        span = _span(read_jsonl(path) if path.exists() else [])
        p = probe_result(index, phase, mode, load, samples, seq, self.slos, decision, seconds, span)
        lag = [r["sent"] - r["intended"] for r in measured]
        if not warnings and lag and spec.process != "closed" and (p99 := float(np.percentile(lag, 99))) > metrics.LAG_WARN_S:
            warnings.append(f"client schedule lag p99 {p99 * 1e3:.1f} ms: the client, not the server, may limit this probe")
        p.warnings, p.dir = warnings, str(out)
        return p


def _samples(records: list[dict[str, Any]]) -> Samples:
    samples = Samples()
    for r in records:
        samples.add_record(r)
    return samples


def _cohort(records: list[dict[str, Any]], starts: list[tuple[float, int]] | None) -> list[dict[str, Any]]:
    """The records of every request sent up to the latest moment by which all requests sent had ended
    (sorted by send time): judging only finished requests of a still-running probe would favour the fast
    ones. ``starts``: (time, requests started by then) samples of the engine's progress counter; None when
    the probe is over. Requests the probe itself cancelled at its end count as unfinished."""
    cut = min((r["sent"] for r in records if (r["error"] or {}).get("kind") == "cancelled"), default=math.inf)
    by_sent = sorted((r for r in records if r["sent"] < cut), key=lambda r: r["sent"])
    if starts is None:
        return by_sent
    sent = np.asarray([r["sent"] for r in by_sent])
    for t, started in reversed(starts):
        k = int(np.searchsorted(sent, t, side="right"))
        if k >= started:
            return by_sent[:k]
    return []


def _span(records: list[dict[str, Any]]) -> float | None:
    measured = [r for r in records if not r["warmup"] and r["error"] is None]
    if len(measured) < 2:
        return None
    return max(r["end"] for r in measured) - min(r["sent"] for r in measured)


# --- the search ---------------------------------------------------------------------------------------


DEFAULT_PROBE_S = 60.0
PROBE_MARGIN = 1.25  # a probe sized to bring what its SLOs need runs this much longer (the estimate is rough)
PROBES_IN_BUDGET = 4  # a probe sized that way runs at most this share of the budget: the search needs several


@dataclass
class SearchConfig:
    mode: str = "rate"
    resolution: float = 0.05  # ± share of the capacity
    budget_s: float = 600.0  # probe-seconds, pilot included
    confidence: float = 0.95  # per probe verdict
    max_probe_s: float | None = None  # None: DEFAULT_PROBE_S, longer for a slow open-loop probe (probe_cap)
    max_samples: int = 2000
    first_look: int = 30
    max_concurrency: int = 256
    max_rate: float = 1000.0
    min_rate: float | None = None  # default: a tenth of the pilot's estimate
    growth: float = 1.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 < self.resolution < 0.5:
            raise ValueError("resolution must be between 0 and 0.5 (e.g. 0.05 for ±5 %)")
        if self.budget_s <= 0 or (self.max_probe_s is not None and self.max_probe_s <= 0):
            raise ValueError("budget and probe time must be > 0 s")
        if not 0.5 <= self.confidence < 1:
            raise ValueError("confidence must be in [0.5, 1)")

    def probe_cap(self, slos: Sequence[SLO], load: float, pooled: bool, last: Probe | None) -> float:
        """A search probe's time cap: ``max_probe_s`` when given. By default 60 s, and a rate-mode probe that
        does not pool runs long enough for its arrivals to bring the independent requests every latency SLO
        needs (:func:`units_to_see`, at the correlation time ``last`` counted, at least 2: requests that share
        a queue count as fewer), up to a quarter of the budget: at a low rate a shorter probe cannot confirm a
        pass, and a lower rate brings even fewer requests (a closed loop goes to fewer sessions: :func:`_reach`)."""
        if self.max_probe_s is not None or self.mode != "rate" or pooled:
            return self.fixed_probe_s
        tau = max([2.0] + [c.tau for c in (last.checks if last is not None else [])])
        need = max([0.0] + [units_to_see(s, self.confidence) for s in slos if s.metric != "error_rate"])
        return max(DEFAULT_PROBE_S, min(self.budget_s / PROBES_IN_BUDGET, PROBE_MARGIN * need * tau / load))

    @property
    def fixed_probe_s(self) -> float:
        """The time cap of a probe not sized to its SLOs (pilot, closed loop, pooled): ``max_probe_s`` or 60 s."""
        return self.max_probe_s if self.max_probe_s is not None else DEFAULT_PROBE_S


@dataclass
class CapacityResult:
    status: str  # "ok" | "budget" | "unresolved" | "unreachable" | "not_saturated" | "interrupted" | "server_gone"
    mode: str
    slos: list[str]
    capacity: float | None  # the highest load that passed
    interval: tuple[float | None, float | None]  # [highest pass, lowest fail]
    resolution_met: bool
    goodput: float | None
    knee: float | None
    estimate: float | None
    probe_seconds: float
    budget_s: float
    confidence: float
    message: str
    probes: list[Probe]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["interval"] = list(self.interval)
        return d


def _converged(mode: str, lo: float, hi: float, res: float) -> bool:
    """Is [lo, hi] within ±res of its middle (for concurrency: adjacent integers, or within ±res)?"""
    if mode == "concurrency" and hi - lo <= 1:
        return True
    return hi - lo <= res * (lo + hi) * (1 + 1e-9)


def _reach(cfg: SearchConfig, slos: Sequence[SLO], probe: Probe | None) -> float:
    """Concurrency mode: the most sessions whose probe can count the independent requests a latency SLO needs
    to hold (:func:`units_to_see`) within ``max_probe_s`` at ``probe``'s throughput, after the first wave (on
    the idle server, not judged: :meth:`Samples.steady`). A wave of ``c`` sessions counts as ``c / (1 + (c -
    1)·icc)`` independent requests, ``icc`` read off the correlation time ``probe``'s verdict counted
    (:func:`design_effect`; 1, a wave counts once, from one session or a pilot's two waves); unbounded
    without a throughput."""
    if cfg.mode != "concurrency" or probe is None or not probe.throughput:
        return math.inf
    budget, reach = probe.throughput * cfg.fixed_probe_s, math.inf
    for s in slos:
        c = next((c for c in probe.checks if c.key == s.key), None)
        if s.metric == "error_rate" or c is None:
            continue
        icc = min(1.0, max(0.0, (c.tau - 1) / (probe.load - 1))) if probe.load > 1 else 1.0
        need = units_to_see(s, cfg.confidence)  # (need·(1 + (x - 1)·icc) + x) requests <= budget, solved for x
        reach = min(reach, (budget - need * (1 - icc)) / (need * icc + 1))
    return reach if math.isinf(reach) else float(max(1, math.floor(reach)))


def _toward(soft: float, hi: float) -> float:
    """The integer load halfway from the pilot's soft low end up to a failing load (the soft end itself when
    none lies between)."""
    mid = math.floor((soft + hi) / 2)
    return float(mid if soft < mid < hi else soft)


def _next_inside(cfg: SearchConfig, probes: Sequence[Probe], lo: float, hi: float) -> float | None:
    """The next load inside (lo, hi): one resolution step beside an undecided probe, else the middle;
    None when every such load was probed already."""
    tried = [p.load for p in probes if p.phase == "search"]
    undecided = [p.load for p in probes if p.phase == "search" and not p.confident and lo < p.load < hi]
    step = cfg.resolution
    cands = [max(undecided) * (1 + step), min(undecided) * (1 - step)] if undecided else []
    cands.append((lo + hi) / 2)
    for x in cands:
        if cfg.mode == "concurrency":
            x = float(round(x)) if round(x) not in (lo, hi) else float(math.floor(x) if x > (lo + hi) / 2 else math.ceil(x))
        if lo < x < hi and all(abs(x - t) > 1e-6 * max(1.0, t) for t in tried):
            return x
    return None


async def search(prober: Prober, slos: Sequence[SLO], cfg: SearchConfig) -> CapacityResult:
    """Pilot, bracket, bisect; see the module docstring."""
    probes: list[Probe] = []

    try:
        return await _search(prober, slos, cfg, probes)
    except SearchStopped as stop:
        res = _result("budget", cfg, slos, None, None, 0.0, sum(p.seconds for p in probes), probes)
        res.status, res.message = stop.status, f"{stop}; {len(probes)} probe(s) finished before (capacity.json)"
        return res


async def _search(prober: Prober, slos: Sequence[SLO], cfg: SearchConfig, probes: list[Probe]) -> CapacityResult:
    spent = 0.0
    unspent: tuple[float, float] | None = None  # (load, seconds it needs) of the probe the budget left out

    async def run(mode: str, load: float, phase: str, pooled: bool = False) -> Probe | None:
        """The probe, or None when what is left of the budget would end it before it judged anything."""
        nonlocal spent, unspent
        need = judge_s(cfg, probes, mode, load) if phase == "search" else 0.0
        if cfg.budget_s - spent < need:
            unspent = (load, need)
            return None
        seq = Sequential(slos, cfg.confidence, cfg.first_look, cfg.max_samples, cfg.resolution, pooled) if phase == "search" else None
        last = next((q for q in reversed(probes) if q.phase == "search"), None)
        cap = cfg.probe_cap(slos, load, pooled, last) if phase == "search" else cfg.fixed_probe_s
        p = await prober.probe(mode, load, seq, min(cap, max(1.0, cfg.budget_s - spent)), len(probes), phase)
        probes.append(p)
        spent += p.seconds
        return p

    # 1. pilot: closed loop, doubling
    c, last_ok, first_bad = 1, None, None
    while spent < cfg.budget_s:
        p = await run("concurrency", c, "pilot")
        assert p is not None  # a pilot probe always runs
        if p.verdict == "fail":
            first_bad = p
            break
        last_ok = p
        if c >= cfg.max_concurrency:
            break
        c = min(cfg.max_concurrency, c * 2)
    hi: float | None = None
    # a pilot that finished its waves and violates an SLO is clear enough already (Wilson at 97.5 %, one look);
    # one cut short by the probe time is not: one slow request of one is no evidence of a p90
    if (first_bad is not None and first_bad.requests >= pilot_requests(int(first_bad.load))
            and any(c.state == "violated" for c in first_bad.checks)):  # fmt: skip
        first_bad.confident = True
    if cfg.mode == "concurrency":
        x = last_ok.load if last_ok else 1.0
        lo_bound, hi_bound = 1.0, float(cfg.max_concurrency)
        hint = first_bad.load if first_bad else None
        if first_bad is not None and first_bad.confident:  # the same closed loop: the pilot's verdict stands
            hi, hint = first_bad.load, None
    else:
        ref = last_ok or first_bad
        thr = (ref.throughput or (ref.load / ref.mean_e2e if ref and ref.mean_e2e else None)) if ref else None
        x = (thr if last_ok else 0.5 * thr) if thr else 1.0
        lo_bound = cfg.min_rate or x / 10
        hi_bound = cfg.max_rate
        hint = None
        x = min(max(x, lo_bound), hi_bound)
    # the pilot's last pass (a point estimate) is a soft low end: below a failing load the search bisects
    # towards it before it steps down by the growth factor (each passing probe costs the same ~30 waves),
    # and no higher than the sessions whose waves a probe can count within its time at that throughput
    soft = None
    if cfg.mode == "concurrency" and last_ok is not None:
        soft = min(last_ok.load, _reach(cfg, slos, last_ok))
    estimate = x
    if last_ok is None and first_bad is not None:  # fails already one at a time: confirm at the lowest load
        x = lo_bound
    elif soft is not None and hi is not None:
        x = _toward(soft, min(hi, _reach(cfg, slos, last_ok) + 1))

    # 2. bracket, then bisect; only confident verdicts move the bracket, an undecided probe (the SLO
    # boundary is within its noise) is flanked by probes one resolution step either side
    lo: float | None = None
    fit: Fit | None = None
    pooled = False
    status = "unreachable" if hi is not None and hi <= lo_bound else "budget"
    while spent < cfg.budget_s and status == "budget":
        q = await run(cfg.mode, x, "search", pooled)
        if q is None:
            break
        p, pooled = q, False
        if p.confident and p.verdict == "pass":
            lo = x if lo is None else max(lo, x)
        elif p.confident:
            hi = x if hi is None else min(hi, x)
        if lo is not None and hi is not None and lo >= hi:  # contradicting verdicts: re-test both ends
            lo, hi = None, None
        fit = pooled_fit(slos, probes, cfg.confidence) if cfg.mode == "rate" else None
        if fit is not None and fit.lo is not None and fit.hi is not None and _converged(cfg.mode, fit.lo, fit.hi, cfg.resolution):
            lo, hi, status = fit.lo, fit.hi, "ok"
            break
        if p.bursty and lo is not None and hi is not None:
            # random arrivals: a probe alone cannot place the crossing within the resolution (the miss share
            # rises slowly through it, and a probe that saw no burst looks confident), the pooled fit does
            near = fit.estimate if fit is not None else _undecided(probes, lo, hi) or math.sqrt(lo * hi)
            x, pooled = min(max(_beside(near, probes, cfg.resolution), lo_bound), hi_bound), True
        elif hi is None and (p.verdict == "pass" or lo is not None):
            if x >= hi_bound:
                if p.confident and p.verdict == "pass":
                    status = "not_saturated"
                    break
                if p.requests == 0:
                    break
                continue  # undecided at the highest load: probe it again while the budget lasts
            # no failing end yet: an undecided closed-loop probe moves no end of the bracket, and a clearly
            # failing one decides within a few waves, so it looks for the failing end at the growth step too
            up = cfg.growth if p.confident or cfg.mode == "concurrency" else 1 + cfg.resolution
            x = min(hi_bound, hint if hint is not None and hint > x else x * up)
        elif lo is None:
            if x <= lo_bound:
                if p.confident:
                    status = "unreachable"
                    break
                if p.requests == 0:  # nothing finished in time: no verdict at all, and no lower load to try
                    break
                continue  # undecided at the lowest load: probe it again while the budget lasts
            if soft is not None and soft < x:
                x, soft = _toward(soft, x), (soft if _toward(soft, x) > soft else None)
            else:
                x = max(lo_bound, x / (cfg.growth if p.confident else 1 + cfg.resolution))
            if not p.confident:  # undecided at its time cap: go where a probe can count enough waves
                x = max(lo_bound, min(x, _reach(cfg, slos, p)))
        elif _converged(cfg.mode, lo, hi, cfg.resolution):
            status = "ok"
            break
        else:
            nxt = _next_inside(cfg, probes, lo, hi)
            if nxt is None:
                status = "unresolved"
                break
            x = nxt
        if cfg.mode == "concurrency":
            x = float(max(1, round(x) if round(x) != round(p.load) else round(p.load) + (1 if x > p.load else -1)))
    if status == "budget" and p.bursty and fit is not None and fit.lo is not None and fit.hi is not None:
        lo, hi = fit.lo, fit.hi  # under random arrivals the pooled evidence, not the last probes' verdicts
    if fit is not None:
        estimate = fit.estimate
    elif (crossing := point_crossing([p for p in probes if p.mode == cfg.mode], slos, lo, hi)) is not None:
        estimate = crossing
    return _result(status, cfg, slos, lo, hi, estimate, spent, probes, fit, unspent)


def point_crossing(probes: Sequence[Probe], slos: Sequence[SLO], lo: float | None, hi: float | None) -> float | None:
    """Where the probes' (of one mode) point estimates put the capacity: the highest load that met every SLO on its point
    estimate below the lowest that missed one, within the confirmed bracket [lo, hi) (None: no such load).
    Loads that passed this way but not yet at the stated confidence are what the confirmed answer leaves out."""
    by_key = {s.key: s for s in slos}

    def over(p: Probe) -> bool:
        return any(_over(c, by_key[c.key]) for c in p.checks if c.key in by_key)

    judged = [p for p in probes if p.requests and (hi is None or p.load < hi)]
    fail = min((p.load for p in judged if over(p)), default=math.inf)
    passed = [p.load for p in judged if not over(p) and p.load < fail and (lo is None or p.load >= lo)]
    return max(passed, default=None)


def judge_s(cfg: SearchConfig, probes: Sequence[Probe], mode: str, load: float) -> float:
    """About how long a search probe at ``load`` runs before it can judge (its first look: ``first_look``
    requests finished), from the probe nearest in load that finished any: a closed loop's waves of that probe's
    mean E2E (longer in proportion above its load: a longer queue), an open loop's arrivals plus one E2E. A
    probe given less would end with nothing judged, its seconds lost; 0 before any probe finished a request."""
    done = [p for p in probes if p.mean_e2e] or [None]
    same = [p for p in done if p is not None and p.mode == mode]
    near = min(same, key=lambda p: abs(math.log(p.load / load))) if same else done[-1]
    if near is None or near.mean_e2e is None:
        return 0.0
    e2e = near.mean_e2e * (max(1.0, load / near.load) if near.mode == mode else 1.0)
    if mode == "concurrency":
        return e2e * math.ceil(cfg.first_look / max(load, 1.0))
    return cfg.first_look / load + e2e


HINT_EVIDENCE = 10


def _probe_time_hint(searched: Sequence[Probe], slos: Sequence[SLO], z: float, confidence: float,
                     unit: str) -> str | None:  # fmt: skip
    """How long a probe would take to confirm a load that passed on its point estimate, for the one of them
    cheapest to confirm: the independent requests at which the miss share it saw holds each SLO still open
    there (none missed: :func:`samples_to_hold`; else :func:`wilson_eff` at ``z``), at the rate and correlation time
    it measured (from at least ``HINT_EVIDENCE`` independent requests: a short probe's correlation time and
    miss share are too rough to extrapolate), with the margin and budget share of :meth:`SearchConfig.probe_cap`.
    A concrete figure instead of "raise it"."""
    by_key = {s.key: s for s in slos}
    best: tuple[float, Probe] | None = None
    for p in (q for q in searched if q.verdict == "pass" and not q.confident and q.requests):
        t = 0.0
        for c in (c for c in p.checks if c.state == "open"):
            allowed = by_key[c.key].allowed
            if c.n < HINT_EVIDENCE * c.tau or c.misses / c.n >= allowed:
                t = math.inf
                break
            m = float(samples_to_hold(by_key[c.key], z, confidence))  # independent requests: the bound falls with m
            while c.misses and wilson_eff(c.misses, c.n, z, c.n / m)[1] > allowed:
                m *= 1.1
            t = max(t, PROBE_MARGIN * m * c.tau * p.seconds / c.n)
        if p.seconds < t < math.inf and (best is None or t < best[0]):
            best = (t, p)
    if best is None:
        return None
    t, p = best
    return (f"; {_fmt_load(p.load)} {unit} passed on its point estimate ({p.requests} requests in {p.seconds:.0f} s): "
            f"confirming it at the misses it saw takes a probe of about {t:.0f} s: --max-probe-s {math.ceil(t)} "
            f"--budget {PROBES_IN_BUDGET * math.ceil(t)}, or relax the SLO")  # fmt: skip


def _undecided(probes: Sequence[Probe], lo: float, hi: float) -> float | None:
    """The load of the latest search probe inside (lo, hi) undecided at its cap."""
    return next((p.load for p in reversed(probes) if p.phase == "search" and not p.confident and lo < p.load < hi), None)


def _beside(estimate: float, probes: Sequence[Probe], step: float) -> float:
    """The next pooled probe: one resolution step below or above the estimate of the crossing, on the side with
    fewer pooled probes (its interval narrows with evidence on both sides)."""
    near = [p.load for p in probes if p.pooled]
    return estimate / (1 + step) if 2 * sum(x < estimate for x in near) <= len(near) else estimate * (1 + step)


def _result(
    status: str, cfg: SearchConfig, slos: Sequence[SLO], lo: float | None, hi: float | None, estimate: float,
    spent: float, probes: list[Probe], fit: Fit | None = None, unspent: tuple[float, float] | None = None,
) -> CapacityResult:  # fmt: skip
    unit = "concurrency" if cfg.mode == "concurrency" else "req/s"
    res_met = lo is not None and hi is not None and _converged(cfg.mode, lo, hi, cfg.resolution)
    at = [p for p in probes if p.phase == "search" and lo is not None and p.load <= lo and p.verdict == "pass"]
    goodput = max(at, key=lambda p: p.load).goodput if at else None
    messages = {
        "ok": f"capacity {_fmt_load(lo)} {unit}: every SLO holds there; {_fmt_load(hi)} fails "
              f"(resolution ±{cfg.resolution:.0%} reached)",
        "budget": f"time budget of {cfg.budget_s:g} probe-seconds ran out; the bracket held is "
                  f"[{_fmt_load(lo)}, {_fmt_load(hi)}] {unit}",
        "unresolved": f"the SLO boundary is flatter than ±{cfg.resolution:.0%} at {cfg.max_samples} samples a "
                      f"probe: the confident bracket is [{_fmt_load(lo)}, {_fmt_load(hi)}] {unit}",
        "unreachable": f"the SLOs fail already at the lowest load ({_fmt_load(hi)} {unit}): unreachable on this "
                       "server; relax them or fix the server",
        "not_saturated": f"the SLOs still hold at the highest load searched ({_fmt_load(lo)} {unit}); raise "
                         f"--max-{'concurrency' if cfg.mode == 'concurrency' else 'rate'}",
    }  # fmt: skip
    if status == "ok" and fit is not None and (lo, hi) == (fit.lo, fit.hi):
        messages[status] = (f"capacity {_fmt_load(lo)} {unit} at {cfg.confidence:.0%}, interval [{_fmt_load(lo)}, "
                            f"{_fmt_load(hi)}] {unit} (resolution ±{cfg.resolution:.0%} reached): the SLO misses of the "
                            f"{fit.probes} probes near the crossing, fitted against load together")  # fmt: skip
    elif fit is not None and (lo, hi) == (fit.lo, fit.hi):
        messages[status] += f" (the SLO misses of the {fit.probes} probes near the crossing, fitted against load together)"
    if status in ("budget", "unresolved") and fit is None and estimate is not None and estimate > (lo or 0.0):
        messages[status] += (f"; the probes' point estimates put it at {_fmt_load(estimate)} {unit} (it passed there, "
                             f"not yet at {cfg.confidence:.0%} confidence)")  # fmt: skip
    if status == "budget" and unspent is not None:
        messages[status] += (f"; the last {cfg.budget_s - spent:.0f} s were not spent: a probe at {_fmt_load(unspent[0])} "
                             f"{unit} needs ~{unspent[1]:.0f} s to judge its first {cfg.first_look} requests")  # fmt: skip
    if status == "budget" and probes and probes[-1].requests == 0:
        messages[status] += (f"; the last probe finished no request in {probes[-1].seconds:.0f} s: raise --max-probe-s "
                             "(and --budget) for a server this slow")  # fmt: skip
    z = Sequential(slos, cfg.confidence, cfg.first_look, cfg.max_samples).z
    searched = [p for p in probes if p.phase == "search"]
    short = []
    for s in slos:  # the independent requests each probe's verdict counted (check: n / tau)
        have = max((math.floor(c.n / c.tau) for p in searched for c in p.checks if c.key == s.key), default=0)
        if have < (need := samples_to_hold(s, z, cfg.confidence)):
            short.append(f"{s.key}: {need}, measured at most {have}")
    if status in ("budget", "unresolved") and any(p.requests for p in searched):
        if short:
            messages[status] += (f"; confirming an SLO takes at least this many independent requests in one probe, "
                                 f"none missing (requests that share a closed loop's wave or a queue count as fewer): "
                                 f"{'; '.join(short)}")  # fmt: skip
        hint = _probe_time_hint(searched, slos, z, cfg.confidence, unit)
        messages[status] += hint or (": raise --max-probe-s or relax the SLO" if short else "")
    failing = [p for p in probes if p.verdict == "fail" and p.errors]
    if status == "unreachable" and failing:
        p = failing[-1]
        where = f" (records: {p.dir})" if p.dir else ""
        messages[status] += f"; {p.errors} of {p.requests} requests failed at load {_fmt_load(p.load)}{where}"
    return CapacityResult(
        status, cfg.mode, [s.describe() for s in slos], lo, (lo, hi), res_met, goodput, knee(probes, cfg.mode),
        estimate, spent, cfg.budget_s, cfg.confidence, messages[status], probes,
    )  # fmt: skip


def _fmt_load(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def knee(probes: Sequence[Probe], mode: str) -> float | None:
    """The load where latency bends up (Kneedle on the mean E2E of the search probes against load)."""
    pts = sorted({p.load: p.mean_e2e for p in probes if p.phase == "search" and p.mean_e2e}.items())
    if len(pts) < 3:
        return None
    x, y = np.asarray(pts, dtype=float).T
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    xn, yn = (x - x.min()) / np.ptp(x), (y - y.min()) / np.ptp(y)
    return float(x[int(np.argmax(xn - yn))])


async def linear_sweep(prober: Prober, slos: Sequence[SLO], cfg: SearchConfig, step: float) -> tuple[float, list[Probe]]:
    """The baseline: loads step, 2·step, ... with the same statistical probes until one fails; returns the
    probe-seconds and the probes."""
    probes: list[Probe] = []
    x = step
    while True:
        seq = Sequential(slos, cfg.confidence, cfg.first_look, cfg.max_samples, cfg.resolution)
        p = await prober.probe(cfg.mode, x, seq, cfg.probe_cap(slos, x, False, probes[-1] if probes else None), len(probes),
                               "sweep")  # fmt: skip
        probes.append(p)
        if p.verdict == "fail" or x >= (cfg.max_concurrency if cfg.mode == "concurrency" else cfg.max_rate):
            return sum(q.seconds for q in probes), probes
        x += step



# --- bench gate on capacity -----------------------------------------------------------------------------


def load_capacity(path: str | Path) -> dict[str, Any]:
    """``capacity.json`` of a ``bench capacity`` result directory (or the file itself)."""
    import json

    p = Path(path)
    file = p / "capacity.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"{path}: no capacity.json (expected a `bench capacity` result directory)")
    return dict(json.loads(file.read_text()))


def gate_capacity(baseline: str, candidate: str, rules: Sequence[Any]) -> Any:
    """``bench gate --metric capacity:-X%``: per server configuration, the capacity ratio candidate/baseline
    lies in [lo_c / hi_b, hi_c / lo_b] (both searches' intervals; an integer concurrency capacity is at most
    hi - 1); regression when that whole range is below ``1 - X``, pass when it is all at or above,
    inconclusive otherwise."""
    rep = GateReport("invalid", baseline=baseline, candidate=candidate)
    try:
        docs = [load_capacity(baseline), load_capacity(candidate)]
    except (ValueError, OSError) as exc:
        rep.errors.append(str(exc))
        return rep
    keys = ("slo", "mode", "workload", "arrival")
    diff = [f"{k}: {docs[0]['config'].get(k)!r} vs {docs[1]['config'].get(k)!r}" for k in keys
            if docs[0]["config"].get(k) != docs[1]["config"].get(k)]  # fmt: skip
    if diff:
        rep.errors.append("the searches measure different things: " + "; ".join(diff))
        return rep
    base, cand = ({e["point_id"]: e for e in d["configs"] if "status" in e} for d in docs)
    common = [p for p in base if p in cand]
    if not common:
        rep.errors.append(f"no server configuration in common: {sorted(base)} vs {sorted(cand)}")
        return rep
    for rule in rules:
        if rule.metric != "capacity" or not rule.higher_is_better:
            rep.errors.append(f"{rule}: with capacity results the gate takes capacity:-X% only")
            return rep
        step = 1.0 if docs[0]["config"].get("mode") == "concurrency" else 0.0  # an integer capacity is < hi
        for pid in common:
            b, c = base[pid]["interval"], cand[pid]["interval"]
            b_lo, b_hi = b[0] or 0.0, b[1] - step if b[1] is not None else math.inf
            c_lo, c_hi = c[0] or 0.0, c[1] - step if c[1] is not None else math.inf
            lo = c_lo / b_hi if b_hi > 0 else 0.0
            hi = c_hi / b_lo if b_lo > 0 else math.inf
            verdict = "regression" if hi < rule.limit else "pass" if lo >= rule.limit else "inconclusive"
            mid = [(x[0] + x[1]) / 2 if None not in x else x[0] for x in (b, c)]
            ratio = mid[1] / mid[0] if mid[0] and mid[1] is not None else None
            rep.checks.append(Check(
                pid, "capacity", str(rule), verdict, mid[0], mid[1], ratio, (lo, hi), rule.limit, 1, 1,
                reason=f"baseline [{_fmt_load(b[0])}, {_fmt_load(b[1])}], candidate [{_fmt_load(c[0])}, {_fmt_load(c[1])}]",
            ))  # fmt: skip
    verdicts = {c.verdict for c in rep.checks}
    rep.verdict = "regression" if "regression" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    return rep
