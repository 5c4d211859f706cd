"""The statistics of one probe: its per-request outcomes (:class:`Samples`), each SLO's state on them
(:func:`check`: Wilson intervals on ``n / tau`` effective samples, ``tau`` the correlation time or a closed
loop's design effect; a latency SLO's lognormal margin), and whether an open loop's server kept up
(:func:`backlog_growth`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from loadgen.metrics import definitions as metrics
from loadgen.metrics.quantiles import f_lower
from loadgen.metrics.slo import ERROR_RATE, SLO


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
    :func:`loadgen.metrics.quantiles.f_lower`). Sessions that run together share a prefill step or a decode batch, but each also has
    its own prompt and answer; the data say how much is shared. Between 1 and ``m``, and ``m`` (a wave
    counts once) where the data cannot tell: fewer than 2 groups, or no spread within them."""
    g = x.size // m
    if m < 2 or g < 2:
        return float(max(1, m))
    y = np.asarray(x[: g * m], dtype=float).reshape(g, m)
    within = float(y.var(axis=1, ddof=1).mean())
    f_lo = f_lower(z, g - 1, g * (m - 1))
    if within <= 1e-12 * max(1.0, float(np.abs(y).max()) ** 2) or f_lo <= 0:
        return float(m)
    ratio = m * float(y.mean(axis=1).var(ddof=1)) / within / f_lo
    return min(float(m), max(1.0, m * ratio / (ratio + m - 1)))


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
        """A ``requests.jsonl`` record, with the metric definitions of :mod:`loadgen.metrics.definitions`."""
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
    se: float | None = None  # the standard error of the percentile's log (:func:`log_quantile_se`), None: unknown

    @property
    def units(self) -> float:
        """The independent requests the verdict counted (``n / tau``)."""
        return self.n / max(self.tau, 1.0)


def check(samples: Samples, slo: SLO, z: float, confidence: float = 0.95) -> SloCheck:
    """One SLO's state at ``z`` (one-sided, per side). Violated: the Wilson interval of the share of misses
    lies above the allowed share. Holds: for error_rate, when that interval lies below it; for a latency SLO,
    when its percentile's upper bound (:func:`lognormal_upper`) is under the limit, at most half the allowed
    share of requests missed it, and the probe holds enough independent requests that a slow mode hitting
    the allowed share would have shown itself at ``confidence`` (:func:`units_to_see`). Never violated on
    fewer independent requests than :func:`units_to_fail`: the Wilson bound at ``n / tau`` of 1 or 2 (a wave
    or two of a closed loop whose sessions share their latency) would call one slow wave a violation."""
    failed = np.asarray(samples.failed, dtype=bool)
    if slo.metric == ERROR_RATE:
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
    if slo.metric == ERROR_RATE:
        wave = 1.0
    elif samples.rate is None and finite.size == n:
        wave = design_effect(np.log(finite) if n and finite.min() > 0 else finite, samples.wave, z)
    else:
        wave = samples.overlap()
    tau = max(correlation_time(miss), correlation_time(finite) if finite.size == n else 1.0, wave)
    lo, hi = wilson_eff(k, n, z, tau)
    se = None
    if slo.metric == ERROR_RATE:
        holds = hi <= slo.allowed
    else:
        value, vlo = _quantile_lower(vals, slo.q, z, tau)
        se = log_quantile_se(vals, slo.q, tau)
        vhi = lognormal_upper(vals, slo.q, z, n / tau)
        margin = k == 0 and n / tau >= units_to_see(slo, confidence) and vhi is not None and vhi <= slo.limit
        holds = hi <= slo.allowed or margin
    state = "violated" if lo > slo.allowed and n / tau >= units_to_fail(slo, z) else "holds" if holds else "open"
    return SloCheck(slo.key, slo.limit, n, k, lo, hi, value, vlo, vhi, state, tau, se)


SE_FLOOR = 0.01  # a percentile is not known closer than 1 %: the clock's and the scheduler's jitter
FEW_UNITS = 3  # independent requests below which a sample's spread is its waves' (:func:`log_quantile_se`)


def log_quantile_se(vals: np.ndarray, q: float, tau: float) -> float | None:
    """The standard error of the log of the q-quantile of ``vals``, distribution-free: the larger distance from the
    point estimate to the order statistics one binomial standard deviation of rank away (``sqrt(n·q(1 - q)·tau)``,
    ``tau`` requests per independent one; a rank beyond the sample counts as its end), at least ``SE_FLOOR``. A
    job mix's latencies are multimodal: a lognormal's density at the quantile overstated the error five-fold
    where the quantile sits in a dense mode. From fewer than ``FEW_UNITS`` independent requests (a closed loop's
    wave or two, whose requests share their batches) the order statistics are the spread of those waves, not of
    the latency: the sample's whole log range then (a pilot's five steady TPOTs at 4 sessions, p90 134 ms, got the
    floor 1 % where 38 requests at 3 sessions, 160 ms, got 4 %, and pulled the fit's line up to it). None
    when a request failed or there are fewer than 2 values."""
    if vals.size < 2 or not np.isfinite(vals).all() or vals.min() <= 0:
        return None
    logs, n = np.sort(np.log(vals)), vals.size
    if n < FEW_UNITS * max(tau, 1.0):
        return max(SE_FLOOR, float(logs[-1] - logs[0]))
    point, spread = float(np.percentile(logs, q * 100)), math.sqrt(n * q * (1 - q) * max(tau, 1.0))
    below = float(logs[min(n - 1, max(0, math.floor(n * q - spread)))])
    above = float(logs[min(n - 1, max(0, math.ceil(n * q + spread) - 1))])
    return max(SE_FLOOR, point - below, above - point)


def units_to_see(slo: SLO, confidence: float) -> float:
    """Independent requests (``n / tau``) a latency SLO needs before it can hold: with this many, a slow mode
    that hits the allowed share of them is missing from the probe with a chance of at most ``1 -
    confidence`` (``(1 - allowed)^u <= exp(-allowed·u)``), whatever the latency model (p90 at 95 %: 30)."""
    return math.log(1 / (1 - confidence)) / slo.allowed


def units_to_fail(slo: SLO, z: float) -> int:
    """Independent requests (``n / tau``) a violation needs at the least: as many as, every one missing, show the
    share above the allowed one by the exact binomial bound at ``z`` (``allowed^u <= 1 - Phi(z)``; p90 at the
    looks' z = 2.64: 3). The Wilson interval is too narrow on fewer: at ``n / tau`` = 1 (clamped) or 2 it calls
    one or two slow waves of a closed loop a violation, where a share at the limit misses them with a chance of
    10 % or 1 %, not 0.4 %. A pass needs far more (:func:`units_to_see`, the Wilson bound's ~63 for a p90)."""
    alpha = max(1e-300, 1 - NormalDist().cdf(z))
    return max(1, math.ceil(math.log(alpha) / math.log(slo.allowed) - 1e-9)) if 0 < slo.allowed < 1 else 1


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
    if slo.metric != ERROR_RATE:
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


def over_slo(c: SloCheck, s: SLO) -> bool:
    """Over the SLO on the point estimate (no sample at all counts as over)."""
    return c.n == 0 or c.misses / c.n > s.allowed
