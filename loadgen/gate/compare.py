"""The regression gate: is a candidate result worse than a baseline, beyond noise?

Each side is a set of repeated trials (``bench run --repeat N``: one point per trial, ids ending in
``/t<k>``). For every point and metric the gate computes a bootstrap confidence interval of the ratio
candidate/baseline of the trial means and decides from the interval alone:

* a tolerance ``-5%`` means higher is better and the ratio may fall to 0.95; ``+10%`` means lower is
  better and the ratio may rise to 1.10;
* ``regression`` when the whole interval is beyond that limit, ``pass`` when the whole interval is within
  it, ``inconclusive`` otherwise (too few trials or too much noise to say).

Small samples: the plain percentile bootstrap is too narrow for a handful of trials, so the interval is
Hesterberg's *expanded percentile* interval (the percentile level widened so that it matches a
t-interval with the ``sqrt(n/(n-1))`` variance correction). Below 5 trials a bootstrap cannot reach
past the range of the data at all, so by default fewer trials give ``inconclusive``. Interleaved A/B
trials (``--ab``) are paired: the bootstrap then resamples the per-pair ratios, which cancels drift of
the machine's speed.

Exit codes (:mod:`loadgen.gate.verdict`): 0 pass, 1 regression, 2 inconclusive or invalid comparison.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from loadgen.gate.resultset import ResultSet, differences, trial_index
from loadgen.gate.rules import MetricRule, metric_path
from loadgen.gate.verdict import Check, GateReport
from loadgen.metrics.quantiles import t_quantile
from loadgen.records.results import lookup


def expanded_alpha(alpha: float, n: int) -> float:
    """Hesterberg's expanded percentile level: the bootstrap's tails widened for sample size ``n``."""
    z = math.sqrt(n / (n - 1)) * t_quantile(1 - alpha / 2, n - 1)
    return 2 * statistics.NormalDist().cdf(-z)


def ratio_ci(
    baseline: np.ndarray,
    candidate: np.ndarray,
    paired: bool = False,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(point estimate, low, high) of mean(candidate)/mean(baseline); paired: geometric mean of the
    per-pair ratios. Needs >= 2 trials per side (pairs when paired)."""
    rng = np.random.default_rng(seed)
    alpha = 1 - confidence
    if paired:
        logs = np.log(candidate / baseline)
        n = len(logs)
        boot = np.exp(logs[rng.integers(0, n, (resamples, n))].mean(axis=1))
        estimate = float(np.exp(logs.mean()))
    else:
        n = min(len(baseline), len(candidate))
        mb = baseline[rng.integers(0, len(baseline), (resamples, len(baseline)))].mean(axis=1)
        mc = candidate[rng.integers(0, len(candidate), (resamples, len(candidate)))].mean(axis=1)
        boot = mc / mb
        estimate = float(candidate.mean() / baseline.mean())
    a = expanded_alpha(alpha, n)
    lo, hi = np.quantile(boot, [a / 2, 1 - a / 2])
    return estimate, float(lo), float(hi)


def _values(trials: list[dict[str, Any]], path: tuple[str, ...]) -> dict[int, float]:
    """Trial index -> the metric's value, for the trials that have a finite value."""
    out = {}
    for pt in trials:
        v = lookup(pt, path)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[trial_index(pt)] = float(v)
    return out


def check_metric(
    point: str,
    rule: MetricRule,
    base: list[float],
    cand: list[float],
    paired: bool,
    confidence: float,
    min_trials: int,
) -> Check:
    c = Check(
        point,
        rule.metric,
        str(rule),
        "inconclusive",
        limit=rule.limit,
        n_baseline=len(base),
        n_candidate=len(cand),
    )
    if base:
        c.baseline_mean = float(np.mean(base))
    if cand:
        c.candidate_mean = float(np.mean(cand))
    if min(len(base), len(cand)) < min_trials:
        c.reason = (
            f"needs >= {min_trials} trials per side (bench run --repeat N), has {len(base)}/{len(cand)}"
        )
        return c
    b, k = np.asarray(base), np.asarray(cand)
    if (b <= 0).any() or (paired and (k <= 0).any()) or b.mean() <= 0:
        c.reason = "baseline values must be > 0 for a ratio"
        return c
    c.ratio, lo, hi = ratio_ci(b, k, paired=paired, confidence=confidence)
    c.ci = (lo, hi)
    worse_side, better_side = (hi, lo) if rule.higher_is_better else (lo, hi)
    beyond = (lambda x: x < rule.limit) if rule.higher_is_better else (lambda x: x > rule.limit)
    if beyond(worse_side):
        c.verdict, c.reason = "regression", "the whole interval is beyond the limit"
    elif not beyond(better_side):
        c.verdict, c.reason = "pass", "the whole interval is within the limit"
    else:
        c.reason = "the interval straddles the limit: more trials or less noise needed"
    return c


ENV_KEYS_HINT = "CPU model, GPU, driver, server version"


def compare(
    baseline: ResultSet,
    candidate: ResultSet,
    rules: list[MetricRule],
    confidence: float = 0.95,
    min_trials: int = 5,
    points: list[str] | None = None,
) -> GateReport:
    """The verdict for every (point, rule) both sides have; see the module docstring."""
    rep = GateReport("invalid", baseline=baseline.source, candidate=candidate.source, confidence=confidence)
    if not rules:
        rep.errors.append("no --metric given: e.g. --metric output_tok_s:-5% --metric ttft_p99:+10%")
        return rep
    diff = differences(baseline.fingerprint, candidate.fingerprint)
    if diff:
        rep.errors.append(
            "workload/config fingerprints differ, so the results measure different things: " + "; ".join(diff)
        )
        return rep
    rep.warnings += [
        f"environment differs ({ENV_KEYS_HINT}): {d}"
        for d in differences(baseline.environment, candidate.environment)
    ]
    common = [p for p in baseline.points if p in candidate.points]
    if points:
        missing = [p for p in points if p not in common]
        if missing:
            rep.errors.append(
                f"point(s) {', '.join(missing)} not in both results; both have: {', '.join(common) or 'none'}"
            )
            return rep
        common = points
    if not common:
        rep.errors.append(
            f"no point in common: baseline has {', '.join(baseline.points)}, candidate has {', '.join(candidate.points)}"
        )
        return rep
    paired = baseline.paired and candidate.paired
    # the metrics some point has: a point without one (bench verify's reference has no quality) is left out
    somewhere = {r.metric for r in rules for p in common
                 if _values(baseline.points[p], metric_path(r.metric)) or _values(candidate.points[p], metric_path(r.metric))}
    for pid in common:
        for rule in rules:
            path = metric_path(rule.metric)
            base, cand = _values(baseline.points[pid], path), _values(candidate.points[pid], path)
            if not base and not cand:
                missing = f"{pid}: metric {rule.metric} ({'.'.join(path)}) is in neither result"
                if rule.metric in somewhere:
                    rep.warnings.append(f"{missing}: not compared")
                else:
                    rep.errors.append(missing)
                continue
            if paired:  # pair trial k with trial k; a trial without a value on either side drops its pair
                keys = sorted(base.keys() & cand.keys())
                b, c = [base[k] for k in keys], [cand[k] for k in keys]
            else:
                b, c = list(base.values()), list(cand.values())
            rep.checks.append(check_metric(pid, rule, b, c, paired, confidence, min_trials))
    if rep.errors:
        return rep
    verdicts = {c.verdict for c in rep.checks}
    rep.verdict = (
        "regression" if "regression" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    )
    return rep
