"""Quantiles of Student's t and the F distribution by closed-form approximations (no SciPy): the t for the
gate's bootstrap level and the capacity fit's band, the F for the design effect of a closed loop's waves."""

from __future__ import annotations

import math
import statistics


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (Hill 1970, ACM algorithm 396; error < 1e-5 for the levels used here)."""
    if not 0.5 < p < 1:
        raise ValueError("p must be in (0.5, 1)")
    two_tail = 2 * (1 - p)
    n = float(df)
    if df == 1:
        return math.cos(two_tail * math.pi / 2) / math.sin(two_tail * math.pi / 2)
    if df == 2:
        return math.sqrt(2 / (two_tail * (2 - two_tail)) - 2)
    a = 1 / (n - 0.5)
    b = 48 / (a * a)
    c = ((20700 * a / b - 98) * a - 16) * a + 96.36
    d = ((94.5 / (b + c) - 3) / b + 1) * math.sqrt(a * math.pi / 2) * n
    x = d * two_tail
    y = x ** (2 / n)
    if y > 0.05 + a:
        x = statistics.NormalDist().inv_cdf(two_tail / 2)
        y = x * x
        if df < 5:
            c += 0.3 * (n - 4.5) * (x + 0.6)
        c = (((0.05 * d * x - 5) * x - 7) * x - 2) * x + b + c
        y = (((((0.4 * y + 6.3) * y + 36) * y + 94.5) / c - y - 3) / b + 1) * x
        y = math.expm1(a * y * y)
    else:
        y = ((1 / (((n + 6) / (n * y) - 0.089 * d - 0.822) * (n + 2) * 3) + 0.5 / (n + 4)) * y - 1) * (
            n + 1
        ) / (n + 2) + 1 / y
    return math.sqrt(n * y)


def f_lower(z: float, d1: int, d2: int) -> float:
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
