"""Service-level objectives: one grammar for every command that takes ``--slo``.

    ttft=500ms,tpot=50ms,e2e=10s        per-request limits: bench run/sweep's goodput counts the requests
                                        within all of them (vLLM's --goodput spelling)
    ttft_p99=1s,tpot_p90=60ms           a percentile of a point within a limit (bench capacity)
    error_rate=1%                       the share of failed requests within a limit (bench capacity)

Keys are ``ttft``, ``tpot``, ``e2e`` (:data:`loadgen.metrics.definitions.SLO_KEYS`), each optionally ``_pNN``, and
``error_rate``; durations take ``us``, ``ms`` or ``s`` (bare: milliseconds), an error rate ``%`` (bare: a
fraction). Each command says which form it takes, and a key in the other form is an error that says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loadgen.metrics import definitions as metrics
from loadgen.metrics.definitions import SLO_KEYS

UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
ERROR_RATE = metrics.ERROR_RATE.tag


class SloError(ValueError):
    """A malformed ``--slo``; the message names the bad key and how to write it."""


@dataclass(frozen=True)
class SLO:
    """``metric <= limit`` (seconds) per request, or at percentile ``quantile`` of a point; with metric
    ``error_rate``, the share of failed requests <= limit (``quantile`` is that share too)."""

    metric: str
    quantile: float | None
    limit: float

    @property
    def definition(self) -> metrics.Metric:
        return metrics.REGISTRY[self.metric]

    @property
    def key(self) -> str:
        return self.metric if self.quantile is None or self.metric == ERROR_RATE else f"{self.metric}_p{self.quantile * 100:g}"

    @property
    def q(self) -> float:
        """The percentile (as a fraction) of a point-level SLO."""
        if self.quantile is None:
            raise ValueError(f"{self.key} is a per-request limit, not a percentile of a point")
        return self.quantile

    @property
    def allowed(self) -> float:
        """The largest share of requests that may miss it."""
        return self.limit if self.metric == ERROR_RATE else 1.0 - self.q

    def describe(self) -> str:
        if self.metric == ERROR_RATE:
            return f"{ERROR_RATE} <= {self.limit:.2%}"
        m = self.definition
        return f"{self.key} <= {self.limit * m.scale:g} {m.shown_unit}" if self.limit < 1 else f"{self.key} <= {self.limit:g} {m.unit}"


def metric_of(key: str) -> metrics.Metric:
    """The registry's metric an SLO key limits: ``ttft_p99`` and ``ttft`` -> TTFT, ``error_rate`` -> the error rate."""
    return metrics.REGISTRY[key if key == ERROR_RATE else key.rpartition("_p")[0] or key]


def parse_slos(text: str | None, percentiles: bool) -> list[SLO]:
    """The SLOs of ``text``: with ``percentiles`` every latency key names its percentile and ``error_rate``
    may appear (bench capacity); without, every key is a per-request limit (goodput)."""
    if not text or not text.strip():
        raise SloError(f"--slo is empty; give e.g. {'ttft_p99=1s,tpot_p99=60ms' if percentiles else 'ttft=500ms,tpot=50ms'}")
    slos = [_one(part, percentiles) for part in text.split(",")]
    keys = [s.key for s in slos]
    if len(set(keys)) != len(keys):
        raise SloError(f"--slo: a key appears twice in {keys}")
    return slos


def _one(part: str, percentiles: bool) -> SLO:
    key, eq, value = (s.strip() for s in part.partition("="))
    key = key.lower()
    if not eq or not value:
        raise SloError(f"--slo: {key or part!r} has no value (write {key or 'ttft'}=1s)")
    if key == ERROR_RATE:
        if not percentiles:
            raise SloError("--slo: error_rate is a limit of a point (bench capacity); bench run/sweep stop on "
                           "errors with --max-error-rate")  # fmt: skip
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%?)", value)
        if not m:
            raise SloError(f"--slo: error_rate={value!r} is not a share (write error_rate=1% or 0.01)")
        share = float(m.group(1)) / (100 if m.group(2) else 1)
        if not 0 < share < 1:
            raise SloError(f"--slo: error_rate={value} must be above 0 (no finite probe can confirm 0 %) and below 100 %")
        return SLO(ERROR_RATE, share, share)
    m = re.fullmatch(r"([a-z][a-z0-9]*?)(?:_p([0-9]+(?:\.[0-9]+)?))?", key)
    if not m or m.group(1) not in SLO_KEYS:
        form = f"{'|'.join(SLO_KEYS)}_pNN (e.g. ttft_p99) and error_rate" if percentiles else "|".join(SLO_KEYS)
        raise SloError(f"--slo: unknown key {key!r}; keys are {form}")
    if percentiles and m.group(2) is None:
        raise SloError(f"--slo: {key} needs its percentile here, e.g. {key}_p99={value}")
    if not percentiles and m.group(2) is not None:
        raise SloError(f"--slo: {key} is a percentile of a point (bench capacity); goodput counts each request "
                       f"within a limit: write {m.group(1)}={value}")  # fmt: skip
    q = None if m.group(2) is None else float(m.group(2)) / 100
    if q is not None and not 0 < q < 1:
        raise SloError(f"--slo: {key}: the percentile must be between 0 and 100")
    v = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s)?", value)
    if not v or float(v.group(1)) <= 0:
        raise SloError(f"--slo: {key}={value!r} is not a positive duration (write e.g. {key}=500ms)")
    return SLO(m.group(1), q, float(v.group(1)) * UNITS[v.group(2) or "ms"])
