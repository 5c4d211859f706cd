"""The evidence of every probe near the SLO crossing at once: for open-loop probes a logistic fit of the misses
against load (:func:`pooled_fit`), for closed-loop ones a fit of each latency SLO's percentile against load
(:func:`closed_fit`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from loadgen.capacity.probe import Probe
from loadgen.metrics.quantiles import t_quantile
from loadgen.metrics.slo import ERROR_RATE, SLO


@dataclass
class Fit:
    """The capacity from the probes near the SLO crossing together (:func:`pooled_fit`, :func:`closed_fit`):
    each end None when the probed loads do not bound it."""

    lo: float | None
    hi: float | None
    estimate: float
    probes: int  # the probes it pooled
    basis: str = "the SLO misses"  # what of each probe it fitted (open loop: misses; closed loop: percentiles)
    crossing: float | None = None  # closed loop: where the line crosses, in sessions (not yet whole)
    # closed loop: the half-width of the crossing's interval in log load by the delta method (the slope taken as
    # known), which shrinks as the square root of the probe-seconds near it: what more budget would buy
    half: float | None = None

    def within(self, mode: str, lo: float | None, hi: float | None) -> Fit:
        """The fit inside the confirmed bracket ``[lo, hi]`` (:func:`agreeing`). Concurrency: ``hi`` is the fewest
        sessions that fail."""
        gap = 1.0 if mode == "concurrency" else 0.0
        a, b = self.lo, self.hi
        if a is not None:
            a = max(a, lo) if lo is not None else a
            a = min(a, hi - gap) if hi is not None else a
        if b is not None:
            b = min(b, hi) if hi is not None else b
            b = max(b, lo + gap) if lo is not None else b
        est = self.estimate
        est = max(est, lo) if lo is not None else est
        est = min(est, hi - gap) if hi is not None else est
        return Fit(a, b, est, self.probes, self.basis, self.crossing, self.half)


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


def agreeing(slos: Sequence[SLO], probes: Sequence[Probe], confidence: float, lo: float | None,
             hi: float | None) -> tuple[float | None, float | None]:  # fmt: skip
    """The ends of the confirmed bracket ``[lo, hi]`` (each a single probe's verdict at the stated confidence) that
    the fit of the other probes agrees with (:func:`closed_fit` without the probes that confirmed it, at that load):
    a pass at or below its crossing, a fail above it; an end stands where the others cannot place a crossing. A
    closed-loop probe's confidence covers the server during its own minute or two: on the reference server one load
    read TPOT p90 142 and 164 ms within a run, and a confident fail at 52 sessions (154 ms) cut the fit of a run to
    [49, 52] ("resolution reached") where that session's 30 search probes pooled crossed at 56."""

    def agrees(load: float | None, verdict: str) -> bool:
        if load is None:
            return False
        rest = [p for p in probes if not (p.confident and p.verdict == verdict and p.load == load)]
        fit = closed_fit(slos, rest, confidence)
        if fit is None or fit.crossing is None:
            return True
        # a tie within rounding agrees with either verdict
        return load <= fit.crossing * (1 + 1e-9) if verdict == "pass" else load > fit.crossing * (1 - 1e-9)

    return (lo if agrees(lo, "pass") else None), (hi if agrees(hi, "fail") else None)


def closed_probes(probes: Sequence[Probe], least: int = 3) -> list[Probe]:
    """The closed-loop probes whose percentiles place the capacity: the search's once they cover ``least`` loads,
    else the pilot's as well. A pilot probe is two waves of a few requests, one of them the burst of a start on
    the idle server; a search probe runs for minutes in the steady state."""
    closed = [p for p in probes if p.mode == "concurrency" and p.requests]
    search = [p for p in closed if p.phase == "search"]
    return search if len({p.load for p in search}) >= least else closed


def closed_fit(slos: Sequence[SLO], probes: Sequence[Probe], confidence: float, width: float = 0.5,
               least: int = 3) -> Fit | None:
    """The capacity's interval (whole sessions) from the closed-loop probes (:func:`closed_probes`) at once.

    A closed loop's sessions share batches, so one probe near the capacity holds few independent requests (a
    wave counts as about one): confirming a pass there takes longer than a probe, while the percentiles of
    all the probes together trace the latency's rise with load. Per latency SLO, the log of each probe's
    percentile is fitted against log load within ``±width`` of the crossing (a straight line: the least
    squares, each probe weighted by its percentile's own variance, :attr:`SloCheck.se`, the probes' scatter about
    the line beyond it widening the interval), and the crossing's interval is Fieller's for the ratio that places
    it, at ``confidence`` two-sided split over the SLOs that cross (:func:`_crossing`). Each SLO's line runs up to
    the lowest load where another SLO's percentile is over its limit (that load included where this SLO is over there
    too); an SLO whose every percentile there is under
    its limit does not bind. The capacity is the lowest SLO's crossing, rounded down to
    whole sessions; its interval, as the confirmed bracket's, runs from the most sessions that hold to the
    fewest that fail. None: no SLO crosses between the probed loads, fewer than ``least`` loads near it, or a
    percentile that falls with load there (the data say nothing yet). The estimate stays between the highest
    load under the limit and the lowest over it on their point estimates, under that one (a line through a step, a
    queue that forms at the slot count, can cross far from it), unless a load at or above that one passed (the level
    moved between probes: then no higher than the highest pass), and its interval holds it."""
    near = closed_probes(probes, least)
    series = []  # per latency SLO: its log percentile, weight and independent requests at each probe's log load
    for slo in (s for s in slos if s.metric != ERROR_RATE):
        checks = ((p, next((c for c in p.checks if c.key == slo.key), None)) for p in near)
        pts = [(math.log(p.load), math.log(c.value), c.se ** -2, c.units) for p, c in checks
               if c is not None and p.requests and c.value is not None and 0 < c.value < math.inf and c.se]  # fmt: skip
        if not pts:
            return None
        series.append((slo, pts))
    # each SLO's line only up to the lowest load where another SLO's percentile is over its limit: the capacity lies
    # below it, and past it the server is in another regime (a queue at its slot count: the TTFT grows, the batch
    # and with it the TPOT stop growing; on the reference server TPOT p90 144-170 ms at 71-79 sessions, 164-183 at
    # 56-60). That load itself stays on the line only where this SLO is over there too (on its way up; under it, the
    # queue's plateau: a pilot at 128 sessions, TTFT p90 11.6 s and TPOT 144 ms over a fail at 71, 155 ms, left no
    # rising line). An SLO under its limit at every load left does not bind there: the confidence is split over those
    # that cross
    first_over = {slo.key: min((x for x, v, _, _ in pts if v > math.log(slo.limit)), default=math.inf)
                  for slo, pts in series}  # fmt: skip
    crossing = []
    for slo, pts in series:
        cut = min((o for k, o in first_over.items() if k != slo.key), default=math.inf)
        below = [pt for pt in pts if pt[0] < cut or (pt[0] == cut and pt[1] > math.log(slo.limit))]
        if below and max(v for _, v, _, _ in below) > math.log(slo.limit):
            crossing.append((slo, below, cut))
    q_two = 1 - (1 - confidence) / (2 * max(1, len(crossing)))
    ends: list[tuple[float, float | None, float | None, int, float]] = []  # (estimate, lo, hi, probes, half), log load
    for slo, pts, cut in crossing:
        x, y, w, units = (np.asarray(v, dtype=float) for v in zip(*pts, strict=True))
        target = math.log(slo.limit)
        if y.min() > target:
            return None  # over it at every load: no crossing to fit (the confirmed verdicts decide)
        over = x[y > target].min()  # the crossing lies between the lowest load over the limit and the highest under it
        under = x[(y <= target) & (x < over)]
        got = _crossing(x, y, (w, units), target, float((over + under.max()) / 2 if under.size else over), width, least,
                        q_two)  # fmt: skip
        if got is None:
            return None
        # the estimate no lower than the highest load under the limit below the lowest over it, and below that lowest
        # over (a whole session: the capacity is the most sessions that hold), or where a load at or above it passed
        # (the level moved between probes: the reference server failed 47 sessions at TPOT p90 159 ms and passed 56 at
        # 146 in one run), no higher than the highest load that passed (short of the load where another SLO is over:
        # past a queue at the slot count the TPOT stops growing)
        passed = x[(y <= target) & (x >= over) & (x < cut)]
        top = float(passed.max()) if passed.size else math.log(max(1.0, math.exp(over) - 1))
        est = min(max(got[0], float(under.max()) if under.size else -math.inf), top)
        # the interval holds its estimate: a load that passed on its point estimate above the line's crossing (a probe
        # of two waves at 52 sessions, 145 ms, over a line that crossed at 47) widens it to there
        lo, hi = (None if got[1] is None else min(got[1], est)), (None if got[2] is None else max(got[2], est))
        # and its lower end no higher than the highest load under the limit: in the gap up to the lowest load over it a
        # line cannot tell a slope from a step (llama-server's 16 slots: TTFT p90 0.14 s at 16 sessions, 6 s at 26;
        # the line's end at 25 answered "capacity 25, [25, 26], resolution reached" where the truth is 17); a load that
        # passed there counts too (llama-server: TPOT p90 155, 153 and 122 ms at 7 sessions, and a probe at 1 set the
        # lower end to 1)
        passes = x[(y <= target) & (x <= over)]
        lo = lo if lo is None or not passes.size else min(lo, float(passes.max()))
        ends.append((est, lo, hi, got[3], got[4]))
    if not ends:
        return None
    est, half = min((e[0], e[4]) for e in ends)  # the lowest crossing binds; its interval's ends are the lowest ends
    lo = None if any(e[1] is None for e in ends) else min(e[1] for e in ends if e[1] is not None)
    hi = min((e[2] for e in ends if e[2] is not None), default=None)

    def whole(v: float) -> float:
        return max(1.0, float(math.floor(math.exp(v) + 1e-9)))

    # as the confirmed bracket: [the most sessions that hold, the fewest that fail]
    return Fit(None if lo is None else whole(lo), None if hi is None else whole(hi) + 1, whole(est),
               max(e[3] for e in ends), "the percentiles", math.exp(est), half)  # fmt: skip


def _crossing(x: np.ndarray, y: np.ndarray, weights: tuple[np.ndarray, np.ndarray], target: float, centre: float,
              width: float, least: int, q_two: float) -> tuple[float, float | None, float | None, int, float] | None:  # fmt: skip
    """Where the line of ``y`` on ``x`` near ``centre`` (the window following the estimate) reaches ``target``,
    with Fieller's interval (None ends: the data do not bound it). ``weights``: each point's inverse variance and
    independent requests. The line's scale pools the points' own variances with their scatter about it (as a
    moderated variance does: a closed loop near its capacity fits only a few probes into the budget, and the
    scatter's own few degrees of freedom, t 25 at one at 98.75 %, left the interval open; many probes' scatter
    outweighs a variance model that does not fit them). The window: ``±log1p(width)``, or as far as the
    ``least`` nearest distinct ``x`` (a pilot doubles its load: its nearest neighbours are a factor 2 away). Last:
    the interval's half-width by the delta method, the slope taken as known (:attr:`Fit.half`).
    None when fewer than ``least`` distinct ``x`` or the line does not rise."""
    w, units = weights
    got = None
    loads = np.unique(x)
    if loads.size < least:
        return None
    for _ in range(4):
        reach = max(math.log1p(width), float(np.sort(np.abs(loads - centre))[least - 1]))
        near = np.abs(x - centre) <= reach + 1e-12
        xs, ys, ws = x[near] - centre, y[near], w[near]
        design = np.column_stack([np.ones_like(xs), xs])
        info = design.T @ (design * ws[:, None])
        if np.linalg.cond(info) > 1e12:
            return got
        cov = np.linalg.inv(info)
        a, b = cov @ design.T @ (ws * ys)
        if b <= 0:
            return got
        dof = int(near.sum()) - 2
        resid = ys - (a + b * xs)
        # the scale: the points' own variances (each as many degrees of freedom as its independent requests less
        # one: on the reference server 41 probes of ten runs scattered about their common line as their own errors
        # said, chi-squared 1.11 per degree of freedom) pooled with the scatter about the line (the points less two)
        prior = max(1, int(np.maximum(units[near] - 1, 1).sum()))
        cov = cov * (prior + float((ws * resid * resid).sum())) / (prior + max(dof, 0))
        q = t_quantile(q_two, prior + max(dof, 0))
        est = centre + (target - a) / b
        # Fieller: the u where (a + b·u - target)² <= q²·(v00 + 2·u·v01 + u²·v11), a bounded interval only when
        # the slope is known well enough (b² > q²·v11)
        quad = b * b - q * q * cov[1, 1]
        half = (b * (a - target) - q * q * cov[0, 1]) ** 2 - quad * ((a - target) ** 2 - q * q * cov[0, 0])
        lo = hi = None
        if quad > 0 and half >= 0:
            mid = -(b * (a - target) - q * q * cov[0, 1]) / quad
            lo, hi = centre + mid - math.sqrt(half) / quad, centre + mid + math.sqrt(half) / quad
            # the line holds within its window: an end beyond it is the line's extrapolation, not the data's
            lo = lo if lo >= centre - 2 * reach else None
            hi = hi if hi <= centre + 2 * reach else None
        u = est - centre  # the delta method: the line's error where it crosses, over its slope
        half = q * math.sqrt(max(0.0, float(cov[0, 0] + 2 * u * cov[0, 1] + u * u * cov[1, 1]))) / float(b)
        got = (est, lo, hi, int(near.sum()), half)
        if abs(est - centre) < 1e-3 or abs(est - centre) > 2 * reach:
            return got
        centre = est
    return got
