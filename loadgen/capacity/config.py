"""What a capacity search is asked (:class:`SearchConfig`), and how long its probes may run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.capacity.probe import Probe
from loadgen.capacity.stats import units_to_see
from loadgen.metrics.slo import ERROR_RATE, SLO

MODES = ("rate", "concurrency")
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
        pass, and a lower rate brings even fewer requests (a closed loop goes to fewer sessions:
        :func:`loadgen.capacity.search._reach`)."""
        if self.max_probe_s is not None or self.mode != "rate" or pooled:
            return self.fixed_probe_s
        tau = max([2.0] + [c.tau for c in (last.checks if last is not None else [])])
        need = max([0.0] + [units_to_see(s, self.confidence) for s in slos if s.metric != ERROR_RATE])
        return max(DEFAULT_PROBE_S, min(self.budget_s / PROBES_IN_BUDGET, PROBE_MARGIN * need * tau / load))

    @property
    def fixed_probe_s(self) -> float:
        """The time cap of a probe not sized to its SLOs (pilot, closed loop, pooled): ``max_probe_s`` or 60 s."""
        return self.max_probe_s if self.max_probe_s is not None else DEFAULT_PROBE_S
