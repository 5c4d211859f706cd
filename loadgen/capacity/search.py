"""SLO capacity search: the highest load (open-loop rate or closed-loop concurrency) at which every SLO holds.

The search (:func:`search`) runs in two phases, all probes through one
:class:`loadgen.capacity.probe.Prober`:

1. **Pilot** (cheap first estimate): closed-loop probes at concurrency 1, 2, 4, ... (in concurrency mode x4
   after one whose percentiles lie under 40 % of their limits) of a couple of waves each, judged on point
   estimates, until one misses an SLO. Concurrency mode starts from the last one that met them; rate mode from
   its throughput (Little's law: rate = concurrency / latency).
2. **Bracket, then bisect**, with statistical probes: each probe runs until a sequential test decides
   (:class:`loadgen.capacity.sequential.Sequential`): for every SLO ``metric_pQ <= limit`` the share of
   requests above the limit (a failed request counts as above) has a Wilson interval; the SLO holds when
   the interval lies below ``1 - Q``, is violated when it lies above (equivalently: an order-statistic
   interval of the quantile lies below / above the limit). The test looks at geometrically spaced sample
   counts with a Bonferroni correction, so each verdict has the stated confidence. An open-loop probe
   whose backlog (requests sent but not answered) keeps growing is overloaded and fails at once; a probe
   still undecided at its sample/time cap is judged on its point estimate and marked not confident.

The answer: ``[lo, hi]`` = the highest load that passed and the lowest that failed; the search stops when
the interval is within ``±resolution`` (or for concurrency adjacent integers), when the time budget runs
out (it says so and reports the bracket it holds), when the SLOs fail at the lowest load (unreachable)
or hold at the highest (not saturated).

Probers: :class:`loadgen.capacity.live.LiveProber` runs :func:`loadgen.dispatch.engine.run_point` against a
server; :class:`loadgen.testservers.servicemodel.SimProber` runs the known-answer service model in virtual
time (tests and the cost comparison with a linear sweep, :func:`linear_sweep`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loadgen.capacity.config import (
    FIT_SPREAD,
    PILOT_FAR,
    PILOT_LEAP,
    PROBE_MARGIN,
    SearchConfig,
    nearest,
    wave_icc,
    wave_s,
)
from loadgen.capacity.fit import Fit, agreeing, closed_fit, closed_probes, pooled_fit
from loadgen.capacity.probe import Probe, Prober, SearchStopped, pilot_requests
from loadgen.capacity.result import CapacityResult, converged, make_result
from loadgen.capacity.sequential import Sequential
from loadgen.capacity.stats import over_slo, units_to_see
from loadgen.metrics.slo import ERROR_RATE, SLO


async def search(prober: Prober, slos: Sequence[SLO], cfg: SearchConfig) -> CapacityResult:
    """Pilot, bracket, bisect; see the module docstring."""
    probes: list[Probe] = []

    try:
        return await _search(prober, slos, cfg, probes)
    except SearchStopped as stop:
        res = make_result("budget", cfg, slos, None, None, 0.0, sum(p.seconds for p in probes), probes)
        res.status, res.message = stop.status, f"{stop}; {len(probes)} probe(s) finished before (capacity.json)"
        return res


async def _search(prober: Prober, slos: Sequence[SLO], cfg: SearchConfig, probes: list[Probe]) -> CapacityResult:
    spent = 0.0
    # (load, seconds it needs, its time cap) of the probe left out: what is left of the budget, or its cap, would
    # end it before it judged anything
    unspent: tuple[float, float, float] | None = None

    async def run(mode: str, load: float, phase: str, pooled: bool = False, fitting: bool = False) -> Probe | None:
        """The probe, or None when what is left of the budget or its time cap would end it before it judged
        anything (:func:`judge_s`; a pilot: before its first wave ended). ``fitting``: a closed-loop probe the
        fit placed, or one below a failing end (:meth:`SearchConfig.fit_cap`)."""
        nonlocal spent, unspent
        last = next((q for q in reversed(probes) if q.phase == "search"), None)
        if phase == "search" and fitting:
            loads = len({q.load for q in probes if q.phase == "search" and q.requests})
            need, cap = judge_s(cfg, probes, mode, load), cfg.fit_cap(slos, load, probes, cfg.budget_s - spent, loads)
        elif phase == "search":
            need, cap = judge_s(cfg, probes, mode, load), cfg.probe_cap(slos, load, pooled, last, probes)
        else:
            need, cap = wave_s(probes, load, first=True) or 0.0, cfg.pilot_cap(load, probes, pilot_requests(int(load)))
        if cfg.max_probe_s is None and cap < need <= cfg.budget_s - spent:  # a slow server: sized to fit, not cut
            cap = min(cfg.budget_s - spent, PROBE_MARGIN * need)
        if min(cap, cfg.budget_s - spent) < need:
            unspent = (load, need, cap)
            return None
        if cfg.max_probe_s is None and phase == "search" and cfg.budget_s - spent - cap < need:
            # the last probe the budget holds takes what is left of it: a remainder shorter than a probe needs would
            # judge nothing (17-58 s of 480 in the reference server's runs of the ninth session)
            cap = cfg.budget_s - spent
        seq = Sequential(slos, cfg.confidence, cfg.first_look, cfg.max_samples, cfg.resolution, pooled) if phase == "search" else None
        p = await prober.probe(mode, load, seq, min(cap, max(1.0, cfg.budget_s - spent)), len(probes), phase)
        probes.append(p)
        spent += p.seconds
        unspent = None
        return p

    # 1. pilot: closed loop, doubling (leaping far under the limits)
    c, last_ok, first_bad = 1, None, None
    while spent < cfg.budget_s:
        q = await run("concurrency", c, "pilot")
        if q is None:  # the budget left or the longest probe cannot fit its first wave: the search goes on from here
            break
        p = q
        if p.verdict == "fail":
            first_bad = p
            break
        last_ok = p
        if c >= cfg.max_concurrency:
            break
        c = min(cfg.max_concurrency, c * (PILOT_LEAP if cfg.mode == "concurrency" and _under(p, PILOT_FAR) else 2))
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
    # towards it before it steps down by the growth factor (each passing probe costs the same ~30 waves); not
    # capped at the sessions whose waves a probe could count to confirm a pass (llama-server on a CPU without
    # AVX-512, ~0.5 requests/s: a pilot that passed 4 and failed 8 on its miss share, TPOT p90 150 ms, sent the
    # first search probe to 1 session, 50 s at a twelfth of the limit, which then pulled the fit's line and interval)
    soft = last_ok.load if cfg.mode == "concurrency" and last_ok is not None else None
    estimate = x
    fit: Fit | None = closed_fit(slos, probes, cfg.confidence) if cfg.mode == "concurrency" else None
    if last_ok is None and first_bad is not None:  # fails already one at a time: confirm at the lowest load
        x = lo_bound
    elif fit is not None:  # the pilot's percentiles cross the SLOs: start where they do
        x = min(max(fit.estimate, lo_bound), hi_bound)
    elif soft is not None and (top := hint if hi is None else hi) is not None:
        # between the pilot's last pass and its failure, confirmed or not (on the reference server a pilot at 64
        # sessions, TPOT p90 at the limit on its miss share and just under on its percentile, gave no crossing: the
        # search's first probe ran 120 s at 32 sessions, a pass far below the capacity of 50)
        x = _toward(soft, top)

    # 2. bracket, then bisect; only confident verdicts move the bracket, an undecided probe (the SLO
    # boundary is within its noise) is flanked by probes one resolution step either side
    lo: float | None = None
    pooled = fitting = False
    status = "unreachable" if hi is not None and hi <= lo_bound else "budget"
    while spent < cfg.budget_s and status == "budget":
        # below a failing end a closed-loop probe seldom confirms a pass within its time: it serves the fit
        q = await run(cfg.mode, x, "search", pooled, fitting or (cfg.mode == "concurrency" and hi is not None))
        if q is None:
            break
        p, pooled, fitting = q, False, False
        if p.confident and p.verdict == "pass":
            lo = x if lo is None else max(lo, x)
        elif p.confident:
            hi = x if hi is None else min(hi, x)
        if lo is not None and hi is not None and lo >= hi:  # contradicting verdicts: re-test both ends
            lo, hi = None, None
        fit = pooled_fit(slos, probes, cfg.confidence) if cfg.mode == "rate" else closed_fit(slos, probes, cfg.confidence)
        sure = (lo, hi)  # the confirmed bracket; in concurrency mode its ends that the other probes' fit agrees with
        if fit is not None and cfg.mode == "concurrency":
            sure = agreeing(slos, probes, cfg.confidence, lo, hi)
            fit = fit.within(cfg.mode, *sure)
        if fit is not None and fit.lo is not None and fit.hi is not None and converged(cfg.mode, fit.lo, fit.hi, cfg.resolution):
            lo, hi, status = fit.lo, fit.hi, "ok"
            break
        if cfg.mode == "concurrency" and fit is not None:
            # a closed loop near its capacity counts about a wave as one request: a probe there seldom confirms
            # a pass within its time, the percentiles of all the probes together place the crossing: probe
            # either side of it, FIT_SPREAD away (the line's slope, which bounds its interval, needs loads apart;
            # a probe that decides early still moves the confirmed bracket)
            inside = (lo_bound if sure[0] is None else sure[0] + 1, hi_bound if sure[1] is None else sure[1] - 1)
            x, fitting = _beside(fit.estimate, [q for q in probes if q.phase == "search"], FIT_SPREAD, inside), True
        elif p.bursty and lo is not None and hi is not None:
            # random arrivals: a probe alone cannot place the crossing within the resolution (the miss share
            # rises slowly through it, and a probe that saw no burst looks confident), the pooled fit does
            near = fit.estimate if fit is not None else _undecided(probes, lo, hi) or math.sqrt(lo * hi)
            x, pooled = min(max(_beside(near, [q for q in probes if q.pooled], cfg.resolution), lo_bound), hi_bound), True
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
            under_fails = cfg.mode == "concurrency" and p.verdict == "fail"
            if under_fails:
                # no crossing in the percentiles yet (every search load over the limit): the line needs a load under
                # it near them, not a pass far below (a closed loop near its capacity counts too few waves to confirm
                # one: the reference server's search went from 52 sessions, TPOT p90 151 ms, to 14, its reach)
                fails = [q.load for q in probes if q.phase == "search" and q.requests and q.verdict == "fail"]
                x = max(lo_bound, min(fails, default=x) / (1 + FIT_SPREAD))
            elif soft is not None and soft < x:
                x, soft = _toward(soft, x), (soft if _toward(soft, x) > soft else None)
            else:
                x = max(lo_bound, x / (cfg.growth if p.confident else 1 + cfg.resolution))
            if not p.confident and not under_fails:
                x = max(lo_bound, min(x, _reach(cfg, slos, p)))  # undecided at its cap: where a probe counts enough waves
        elif converged(cfg.mode, lo, hi, cfg.resolution):
            status = "ok"
            break
        else:
            nxt = _next_inside(cfg, probes, lo, hi)
            if nxt is None:
                status = "unresolved"
                break
            x = nxt
        if cfg.mode == "concurrency":  # a load the fit placed may come again (its evidence adds up), another moves on
            x = float(max(1, round(x) if fitting or round(x) != round(p.load) else round(p.load) + (1 if x > p.load else -1)))
    if status == "budget" and (p.bursty or cfg.mode == "concurrency") and fit is not None and fit.lo is not None and fit.hi is not None:
        lo, hi = fit.lo, fit.hi  # the pooled evidence, not the last probes' verdicts
    if fit is not None:
        estimate = fit.estimate
    elif (crossing := point_crossing(closed_probes(probes) if cfg.mode == "concurrency" else
                                     [p for p in probes if p.mode == cfg.mode], slos, lo, hi)) is not None:  # fmt: skip
        estimate = crossing
    return make_result(status, cfg, slos, lo, hi, estimate, spent, probes, fit, unspent)


def _under(probe: Probe, share: float = 1.0) -> bool:
    """Whether ``probe`` has latency percentiles and every one lies under ``share`` of its limit (the pilot leaps
    under ``PILOT_FAR``; the fit's probes count on the side under their limits)."""
    lat = [c for c in probe.checks if c.key != ERROR_RATE]
    return bool(lat) and all(c.value is not None and c.value <= share * c.limit for c in lat)


def _reach(cfg: SearchConfig, slos: Sequence[SLO], probe: Probe | None) -> float:
    """Concurrency mode: the most sessions whose probe can count the independent requests a latency SLO needs
    to hold (:func:`units_to_see`) within the longest probe (``max_probe_s``, by default a quarter of the
    budget: :attr:`SearchConfig.longest_probe_s`) at ``probe``'s throughput, after the first wave (on the idle
    server, not judged: :meth:`Samples.steady`). A wave of ``c`` sessions counts as ``c / (1 + (c - 1)·icc)``
    independent requests, ``icc`` read off the correlation time ``probe``'s verdict counted
    (:func:`loadgen.capacity.config.wave_icc`; 1, a wave counts once, from one session or a pilot's two
    waves); unbounded without a throughput."""
    if cfg.mode != "concurrency" or probe is None or not probe.throughput:
        return math.inf
    budget, reach = probe.throughput * cfg.longest_probe_s, math.inf
    for s in slos:
        c = next((c for c in probe.checks if c.key == s.key), None)
        if s.metric == ERROR_RATE or c is None:
            continue
        icc = wave_icc(probe, s.key)
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


def point_crossing(probes: Sequence[Probe], slos: Sequence[SLO], lo: float | None, hi: float | None) -> float | None:
    """Where the probes' (of one mode) point estimates put the capacity: the highest load that met every SLO on its point
    estimate below the lowest that missed one, within the confirmed bracket [lo, hi) (None: no such load).
    Loads that passed this way but not yet at the stated confidence are what the confirmed answer leaves out."""
    by_key = {s.key: s for s in slos}

    def over(p: Probe) -> bool:
        return any(over_slo(c, by_key[c.key]) for c in p.checks if c.key in by_key)

    judged = [p for p in probes if p.requests and (hi is None or p.load < hi)]
    fail = min((p.load for p in judged if over(p)), default=math.inf)
    passed = [p.load for p in judged if not over(p) and p.load < fail and (lo is None or p.load >= lo)]
    return max(passed, default=None)


def judge_s(cfg: SearchConfig, probes: Sequence[Probe], mode: str, load: float) -> float:
    """About how long a search probe at ``load`` runs before it can judge ``first_look`` requests, from the
    probe nearest in load that finished any: a closed loop's first wave (on the idle server, never judged:
    :meth:`Samples.steady`) and the waves that bring ``first_look`` more, each that probe's mean E2E
    (:func:`loadgen.capacity.config.wave_s`: longer in proportion above its load), an open loop's arrivals
    plus one E2E. A probe given less would end with nothing judged, its seconds lost; 0 before any probe
    finished a request. The first wave is sent at once and judged only when its slowest request ended."""
    if mode == "concurrency" and (wave := wave_s(probes, load)) is not None:
        return (wave_s(probes, load, first=True) or wave) + wave * math.ceil(cfg.first_look / max(load, 1.0))
    done = [p for p in probes if p.mean_e2e]
    near = nearest([p for p in done if p.mode == mode], load) or (done[-1] if done else None)
    if near is None or near.mean_e2e is None:
        return 0.0
    return cfg.first_look / load + near.mean_e2e * (max(1.0, load / near.load) if near.mode == mode else 1.0)


def _undecided(probes: Sequence[Probe], lo: float, hi: float) -> float | None:
    """The load of the latest search probe inside (lo, hi) undecided at its cap."""
    return next((p.load for p in reversed(probes) if p.phase == "search" and not p.confident and lo < p.load < hi), None)


def _beside(estimate: float, near: Sequence[Probe], step: float, within: tuple[float, float] | None = None) -> float:
    """The next probe near the crossing: ``step`` (a share) below or above its estimate, on the side with less
    evidence among the probes ``near`` (the fit's so far; its interval narrows with evidence on both sides), above
    on a tie. Evidence: what the fit weighs each probe by. Open loop (``within`` None): the independent requests
    a probe's misses counted (:attr:`SloCheck.units`). Closed loop: the inverse variance of the binding SLO's
    percentile (:attr:`SloCheck.se`; the SLO nearest its limit): a closed-loop probe that fails confidently stops
    after a few waves, and counted as one probe it kept the next ones below (58 sessions with 3 waves over 40, 41
    and 40 sessions under an estimate of 47); counted by its independent requests, three confident fails of
    TPOT p90 ±3-5 % at 11-12 sessions, each a few waves, kept the next ones above a pass of ±10 % at 8 (the
    reference server, tenth session: interval [4, 11] for a truth of 9).

    ``within``: whole sessions (the estimate the most that hold), the next probe within these bounds (the inside
    of the confirmed bracket), at least the load that decides the answer on its side, the estimate itself or one
    session more, and the sides the probes whose percentiles are under their limits and those over: at 2
    sessions a share of 20 % rounds back onto 2, and a probe there sat on neither side of it (the reference
    server's search went from a long probe at 2 sessions, under the limit, to 1, which its pilot had passed at
    half the limit, instead of 3)."""
    ratios: dict[str, float] = {}
    for c in (c for p in near for c in p.checks if c.key != ERROR_RATE and c.value is not None and c.limit):
        ratios[c.key] = max(ratios.get(c.key, 0.0), c.value / c.limit)
    binding = max(ratios, key=ratios.__getitem__, default=None)

    def evidence(p: Probe) -> float:
        if within is None:
            return min((c.units for c in p.checks if c.key != ERROR_RATE), default=0.0)
        return sum(c.se ** -2 for c in p.checks if c.key == binding and c.se)

    lower, upper = estimate / (1 + step), estimate * (1 + step)
    if within is None:
        below = sum(evidence(p) for p in near if p.load < estimate)
    else:
        lower = min(max(float(round(lower)), within[0]), estimate, within[1])
        upper = max(min(max(float(round(upper)), estimate + 1), within[1]), within[0])
        below = sum(evidence(p) for p in near if _under(p))
    return lower if below < sum(evidence(p) for p in near) - below else upper


async def linear_sweep(prober: Prober, slos: Sequence[SLO], cfg: SearchConfig, step: float) -> tuple[float, list[Probe]]:
    """The baseline: loads step, 2·step, ... with the same statistical probes until one fails; returns the
    probe-seconds and the probes."""
    probes: list[Probe] = []
    x = step
    while True:
        seq = Sequential(slos, cfg.confidence, cfg.first_look, cfg.max_samples, cfg.resolution)
        p = await prober.probe(cfg.mode, x, seq, cfg.probe_cap(slos, x, False, probes[-1] if probes else None, probes),
                               len(probes), "sweep")  # fmt: skip
        probes.append(p)
        if p.verdict == "fail" or x >= (cfg.max_concurrency if cfg.mode == "concurrency" else cfg.max_rate):
            return sum(q.seconds for q in probes), probes
        x += step
