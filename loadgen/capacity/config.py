"""What a capacity search is asked (:class:`SearchConfig`), and how long its probes may run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.capacity.probe import Probe
from loadgen.capacity.stats import units_to_see
from loadgen.metrics.slo import ERROR_RATE, SLO

MODES = ("rate", "concurrency")
DEFAULT_PROBE_S = 60.0
MIN_PROBE_S = 10.0  # the shortest default closed-loop search probe (one sized to a fast server's pace)
PROBE_MARGIN = 1.25  # a probe sized to bring what its SLOs need runs this much longer (the estimate is rough)
PROBES_IN_BUDGET = 4  # a probe sized that way runs at most this share of the budget: the search needs several
# a closed-loop fit's interval needs loads (with the scatter's degrees of freedom alone its t quantile at 98.75 % is 25
# at 3 loads, 4.2 at 5, 3.5 at 6; :func:`loadgen.capacity.fit._crossing`); a probe for the fit runs at least its
# first wave and FIT_WAVES more
FIT_LOADS = 6
FIT_WAVES = 4
FIT_SPREAD = 0.2  # the fit's probes go this share either side of its estimate (the line's slope needs loads apart)
# a pilot probe whose percentiles all lie under this share of their limits multiplies its sessions by PILOT_LEAP
# instead of doubling them (0.4 x 4^0.66 = 1: at the log-log slopes of the reference server's TPOT, 0.54-0.79, the
# leap lands about at the limit, not past it): on that server the pilot's probes at 1, 2 and 4 sessions took 67-83
# s of a 480-s budget, far under the limits, where the search's fit does not use them
PILOT_FAR = 0.4
PILOT_LEAP = 4


@dataclass
class SearchConfig:
    mode: str = "rate"
    resolution: float = 0.05  # ± share of the capacity
    budget_s: float = 600.0  # probe-seconds, pilot included
    confidence: float = 0.95  # per probe verdict
    max_probe_s: float | None = None  # None: sized to the SLOs and the server's pace (probe_cap, pilot_cap)
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

    def probe_cap(self, slos: Sequence[SLO], load: float, pooled: bool, last: Probe | None,
                  probes: Sequence[Probe] = ()) -> float:  # fmt: skip
        """A search probe's time cap: ``max_probe_s`` when given. By default a probe runs long enough to bring the
        independent requests every latency SLO needs (:func:`units_to_see`), at the pace the probes so far measured,
        up to a quarter of the budget (the search needs several): a rate-mode probe that does not pool at its
        arrival rate and the correlation time ``last`` counted (at least 2: requests that share a queue count as
        fewer; at least 60 s); a closed-loop probe at its sessions' pace (:meth:`closed_cap`). A pooled probe runs
        60 s."""
        if self.max_probe_s is not None:
            return self.max_probe_s
        if self.mode == "concurrency":
            return self.closed_cap(slos, load, probes)
        if pooled:
            return DEFAULT_PROBE_S
        tau = max([2.0] + [c.tau for c in (last.checks if last is not None else [])])
        need = max([0.0] + [units_to_see(s, self.confidence) for s in slos if s.metric != ERROR_RATE])
        return max(DEFAULT_PROBE_S, min(self.longest_probe_s, PROBE_MARGIN * need * tau / load))

    def closed_cap(self, slos: Sequence[SLO], load: float, probes: Sequence[Probe]) -> float:
        """A closed-loop search probe at ``load`` sessions, sized to the server's own pace: the first wave (on the
        idle server, not judged: :meth:`Samples.steady`) and then the requests in which every latency SLO counts
        :func:`units_to_see` independent ones (a wave of ``c`` worth ``c / (1 + (c - 1)·icc)``, ``icc`` read off
        the correlation time that the search probe nearest in load counted, :func:`wave_icc`; 1, a wave counts
        once, before any), in waves of :func:`wave_s` each, x ``PROBE_MARGIN``; at least ``MIN_PROBE_S``, at
        most a quarter of the budget. A fast server gets short probes, a slow one long ones; before any probe
        finished a request, 60 s."""
        wave = wave_s(probes, load)
        if wave is None:
            return min(DEFAULT_PROBE_S, self.longest_probe_s)
        near = nearest([p for p in probes if p.phase == "search" and p.mode == "concurrency" and p.requests], load)
        waves = 1.0
        for s in slos:
            if s.metric == ERROR_RATE:
                continue
            icc = wave_icc(near, s.key)
            waves = max(waves, 1 + units_to_see(s, self.confidence) * (1 + (load - 1) * icc) / load)
        return min(self.longest_probe_s, max(MIN_PROBE_S, PROBE_MARGIN * math.ceil(waves) * wave))

    def fit_cap(self, slos: Sequence[SLO], load: float, probes: Sequence[Probe], left: float, loads: int) -> float:
        """A closed-loop probe that the fit placed near the crossing, or one below a failing load, where a closed loop
        seldom confirms a verdict within :meth:`closed_cap`: it serves the fit of ``loads`` loads so far, so the
        ``left`` seconds of the budget are shared among the ``FIT_LOADS`` the fit wants (each at least its first
        wave and ``FIT_WAVES`` more, x ``PROBE_MARGIN``), never longer than :meth:`closed_cap`. ``max_probe_s``
        wins."""
        if self.max_probe_s is not None:
            return self.max_probe_s
        full = self.closed_cap(slos, load, probes)
        wave, first = wave_s(probes, load), wave_s(probes, load, first=True)
        if wave is None or first is None:
            return full
        least = PROBE_MARGIN * (first + FIT_WAVES * wave)
        return min(full, max(least, MIN_PROBE_S, left / max(1, FIT_LOADS - loads)))

    def pilot_cap(self, load: float, probes: Sequence[Probe], requests: int) -> float:
        """A pilot probe's time cap: ``max_probe_s`` when given, else long enough for its ``requests`` in waves of
        :func:`wave_s` (x ``PROBE_MARGIN``; on a slow server 60 s would cut its waves, or end it before its first
        request), between 60 s and a quarter of the budget."""
        if self.max_probe_s is not None:
            return self.max_probe_s
        wave = wave_s(probes, load)
        need = PROBE_MARGIN * math.ceil(requests / max(load, 1.0)) * wave if wave is not None else 0.0
        return max(DEFAULT_PROBE_S, min(self.longest_probe_s, need))

    @property
    def longest_probe_s(self) -> float:
        """The longest probe: ``max_probe_s`` when given, else a quarter of the budget (at least 60 s)."""
        return self.max_probe_s if self.max_probe_s is not None else max(DEFAULT_PROBE_S, self.budget_s / PROBES_IN_BUDGET)

    @property
    def fixed_probe_s(self) -> float:
        """The time cap of a probe not sized to its SLOs (pooled): ``max_probe_s`` or 60 s."""
        return self.max_probe_s if self.max_probe_s is not None else DEFAULT_PROBE_S


def nearest(probes: Sequence[Probe], load: float) -> Probe | None:
    """The probe nearest to ``load`` (on a log scale), None when there is none."""
    return min(probes, key=lambda p: abs(math.log(p.load / load)), default=None)


def wave_s(probes: Sequence[Probe], load: float, first: bool = False) -> float | None:
    """The server's pace for a closed loop of ``load`` sessions: the seconds one wave takes, the mean E2E of the
    closed-loop probe (pilot or search) nearest in load that finished a request, longer in proportion above
    its load (a bigger batch or a queue), no shorter below it. ``first``: the first wave, sent at once, whose
    requests are all judged only when its slowest ended (that probe's slowest E2E). None before any finished."""
    near = nearest([p for p in probes if p.mode == "concurrency" and p.mean_e2e], load)
    if near is None or near.mean_e2e is None:
        return None
    return (near.max_e2e if first and near.max_e2e else near.mean_e2e) * max(1.0, load / near.load)


def wave_icc(probe: Probe | None, key: str) -> float:
    """The share of a wave's latency its sessions have in common (the intra-class correlation) as ``probe``'s
    verdict on SLO ``key`` counted it: ``(tau - 1) / (c - 1)`` from its correlation time ``tau`` (the design
    effect of a wave ``1 + (c - 1)·icc``, or more); 1, a wave counts once, without a probe or from one
    session."""
    c = next((c for c in probe.checks if c.key == key), None) if probe is not None else None
    if c is None or probe is None or probe.load <= 1:
        return 1.0
    return min(1.0, max(0.0, (c.tau - 1) / (probe.load - 1)))
