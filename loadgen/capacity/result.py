"""A capacity search's answer (:class:`CapacityResult`) and the message that states it: the bracket, the
estimate, and what a search that could not confirm would need."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loadgen.capacity.config import PROBE_MARGIN, PROBES_IN_BUDGET, SearchConfig
from loadgen.capacity.fit import Fit
from loadgen.capacity.probe import Probe
from loadgen.capacity.sequential import Sequential
from loadgen.capacity.stats import samples_to_hold, wilson_eff
from loadgen.metrics.slo import SLO


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


def converged(mode: str, lo: float, hi: float, res: float) -> bool:
    """Is [lo, hi] within ±res of its middle (for concurrency: adjacent integers, or within ±res)?"""
    if mode == "concurrency" and hi - lo <= 1:
        return True
    return hi - lo <= res * (lo + hi) * (1 + 1e-9)


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
    return (f"; {fmt_load(p.load)} {unit} passed on its point estimate ({p.requests} requests in {p.seconds:.0f} s): "
            f"confirming it at the misses it saw takes a probe of about {t:.0f} s: --max-probe-s {math.ceil(t)} "
            f"--budget {PROBES_IN_BUDGET * math.ceil(t)}, or relax the SLO")  # fmt: skip


def _budget_hint(cfg: SearchConfig, probes: Sequence[Probe], half: float) -> str:
    """What more budget would buy a closed-loop fit: its interval narrows as the square root of the probe-seconds
    near the crossing (a wave of sessions counts about once, so a longer probe adds what another probe would),
    from its half-width by the delta method (:attr:`Fit.half`) to ``±resolution``. Empty when it is there."""
    goal = math.log1p(cfg.resolution)
    searched = sum(p.seconds for p in probes if p.phase == "search")
    if half <= goal or not searched:
        return ""
    need = sum(p.seconds for p in probes if p.phase == "pilot") + searched * (half / goal) ** 2
    return (f"; the fit's interval narrows as the square root of the probe-seconds near the crossing (±{math.expm1(half):.0%} "
            f"now in sessions before rounding to whole ones, the slope taken as known): about --budget "
            f"{math.ceil(need)} would bring it to ±{cfg.resolution:.0%}")  # fmt: skip


def make_result(
    status: str, cfg: SearchConfig, slos: Sequence[SLO], lo: float | None, hi: float | None, estimate: float,
    spent: float, probes: list[Probe], fit: Fit | None = None, unspent: tuple[float, float, float] | None = None,
) -> CapacityResult:  # fmt: skip
    unit = "concurrency" if cfg.mode == "concurrency" else "req/s"
    res_met = lo is not None and hi is not None and converged(cfg.mode, lo, hi, cfg.resolution)
    # goodput at the capacity: the passing probe nearest below it, a search probe before a pilot at one load (the
    # fit's lower end can be a load only the pilot probed)
    at = [p for p in probes if lo is not None and p.load <= lo and p.verdict == "pass" and p.goodput is not None]
    goodput = max(at, key=lambda p: (p.load, p.phase == "search")).goodput if at else None
    messages = {
        "ok": f"capacity {fmt_load(lo)} {unit}: every SLO holds there; {fmt_load(hi)} fails "
              f"(resolution ±{cfg.resolution:.0%} reached)",
        "budget": f"time budget of {cfg.budget_s:g} probe-seconds ran out; the bracket held is "
                  f"[{fmt_load(lo)}, {fmt_load(hi)}] {unit}",
        "unresolved": f"the SLO boundary is flatter than ±{cfg.resolution:.0%} at {cfg.max_samples} samples a "
                      f"probe: the confident bracket is [{fmt_load(lo)}, {fmt_load(hi)}] {unit}",
        "unreachable": f"the SLOs fail already at the lowest load ({fmt_load(hi)} {unit}): unreachable on this "
                       "server; relax them or fix the server",
        "not_saturated": f"the SLOs still hold at the highest load searched ({fmt_load(lo)} {unit}); raise "
                         f"--max-{'concurrency' if cfg.mode == 'concurrency' else 'rate'}",
    }  # fmt: skip
    pooled = f"{fit.basis} of the {fit.probes} probes near the crossing, fitted against load together" if fit else ""
    if status == "ok" and fit is not None and (lo, hi) == (fit.lo, fit.hi):
        messages[status] = (f"capacity {fmt_load(lo)} {unit} at {cfg.confidence:.0%}, interval [{fmt_load(lo)}, "
                            f"{fmt_load(hi)}] {unit} (resolution ±{cfg.resolution:.0%} reached): {pooled}")  # fmt: skip
    elif fit is not None and (lo, hi) == (fit.lo, fit.hi):
        messages[status] = (f"time budget of {cfg.budget_s:g} probe-seconds ran out: capacity about "
                            f"{fmt_load(estimate)} {unit}, interval [{fmt_load(lo)}, {fmt_load(hi)}] {unit} at "
                            f"{cfg.confidence:.0%} ({pooled})") if status == "budget" else f"{messages[status]} ({pooled})"  # fmt: skip
    elif status == "budget" and fit is not None:  # the fit places it, but its interval is open at an end yet
        open_ends = " or ".join(side for side, end in (("below", fit.lo), ("above", fit.hi)) if end is None)
        messages[status] = (f"time budget of {cfg.budget_s:g} probe-seconds ran out: capacity about {fmt_load(estimate)} "
                            f"{unit} ({pooled}; their interval at {cfg.confidence:.0%} is not bounded {open_ends} "
                            f"yet); the confirmed bracket is [{fmt_load(lo)}, {fmt_load(hi)}] {unit}")  # fmt: skip
    if fit is not None and (lo, hi) == (fit.lo, fit.hi):
        messages[status] += _confirmed(probes, unit, estimate)
    if status == "budget" and fit is not None and fit.half is not None:
        messages[status] += _budget_hint(cfg, probes, fit.half)
    above = [p.load for p in probes if p.phase == "search" and p.requests and p.verdict == "pass" and p.load > estimate]
    if fit is not None and above:
        messages[status] += (f"; {fmt_load(max(above))} {unit} passed on its point estimate above the estimate: the "
                             "server's level moved between probes, and the fit of every probe places the capacity")  # fmt: skip
    if status in ("budget", "unresolved") and fit is None and estimate is not None and estimate > (lo or 0.0):
        messages[status] += (f"; the probes' point estimates put it at {fmt_load(estimate)} {unit} (it passed there, "
                             f"not yet at {cfg.confidence:.0%} confidence)")  # fmt: skip
    if status == "budget" and unspent is not None:  # (load, seconds it needs to judge, its time cap)
        load, need, cap = unspent
        why = (f"the longest probe ({cap:.0f} s) is too short for it: --max-probe-s {math.ceil(need * PROBE_MARGIN)} and "
               f"--budget {math.ceil(max(cfg.budget_s, spent + need * PROBE_MARGIN))} would run it" if cap < need else
               f"--budget {math.ceil(spent + need * PROBE_MARGIN)} would run it")  # fmt: skip
        messages[status] += (f"; the last {cfg.budget_s - spent:.0f} s were not spent: a probe at {fmt_load(load)} {unit} "
                             f"needs ~{need:.0f} s to judge its first {cfg.first_look} requests; {why}")  # fmt: skip
    if status == "budget" and probes and probes[-1].requests == 0:
        messages[status] += (f"; the last probe finished no request in {probes[-1].seconds:.0f} s: raise --max-probe-s "
                             "(and --budget) for a server this slow")  # fmt: skip
    z = Sequential(slos, cfg.confidence, cfg.first_look, cfg.max_samples).z
    searched = [p for p in probes if p.phase == "search"]
    short = []
    for s in slos:  # the independent requests each probe's verdict counted (check: n / tau)
        have = max((math.floor(c.units) for p in searched for c in p.checks if c.key == s.key), default=0)
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
        messages[status] += f"; {p.errors} of {p.requests} requests failed at load {fmt_load(p.load)}{where}"
    return CapacityResult(
        status, cfg.mode, [s.describe() for s in slos], lo, (lo, hi), res_met, goodput, knee(probes, cfg.mode),
        estimate, spent, cfg.budget_s, cfg.confidence, messages[status], probes,
    )  # fmt: skip


def _confirmed(probes: Sequence[Probe], unit: str, estimate: float) -> str:
    """The verdicts at the stated confidence beside a fitted interval: the highest load confirmed to pass and
    the lowest confirmed to fail, and why the fit's ``estimate`` stands where one of them disagrees with it."""
    sure = [p for p in probes if p.phase == "search" and p.confident and p.requests]
    passed = max((p.load for p in sure if p.verdict == "pass"), default=None)
    failed = min((p.load for p in sure if p.verdict == "fail"), default=None)
    said = ([f"passes up to {fmt_load(passed)} {unit}"] if passed is not None else []) + (
        [f"fails from {fmt_load(failed)} {unit}"] if failed is not None else [])  # fmt: skip
    if not said:
        return "; no probe confirmed a pass or a fail on its own"
    disagree = (passed is not None and passed > estimate) or (failed is not None and failed <= estimate)
    why = (" (the estimate stands: a single probe's confidence covers the server during that probe, the fit every "
           "probe's level)" if disagree else "")  # fmt: skip
    return f"; confirmed by single probes: {', '.join(said)}{why}"


def fmt_load(x: float | None) -> str:
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
