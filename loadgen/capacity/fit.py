"""The evidence of every open-loop probe near the SLO crossing at once: a logistic fit of the misses against
load (:func:`pooled_fit`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from loadgen.capacity.probe import Probe
from loadgen.metrics.quantiles import t_quantile
from loadgen.metrics.slo import SLO


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
