"""The gate's rules: ``NAME:-X%`` / ``NAME:+X%`` (:class:`MetricRule`), NAME a tag of the metric registry
(:data:`loadgen.metrics.definitions.REGISTRY`) or a dotted PointSummary path (:func:`metric_path`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from loadgen.metrics import definitions as metrics


class GateError(ValueError):
    """The comparison cannot be made (bad input, differing fingerprints): exit 2."""


def metric_path(name: str) -> tuple[str, ...]:
    """A registry tag (:data:`loadgen.metrics.definitions.REGISTRY`) -> its PointSummary path: ``output_tok_s`` ->
    throughput.steady.output_tok_per_s, ``ttft_p99`` -> latency.ttft.p99; a dotted path -> itself."""
    if name == "capacity":  # a `bench capacity` result: loadgen.capacity.gate.gate_capacity compares it
        return ("capacity",)
    if "." in name:
        return tuple(name.split("."))
    try:
        m, stat = metrics.resolve(name)
    except KeyError:
        raise GateError(f"unknown metric {name!r}: use e.g. {', '.join(metrics.examples())}, or a dotted summary path") from None
    return (*m.path, stat) if stat else m.path


@dataclass(frozen=True)
class MetricRule:
    """``output_tok_s:-5%``: the metric, and how far the ratio may move in the bad direction."""

    metric: str
    tolerance: float  # fraction the ratio may move in the bad direction: 0.05
    higher_is_better: bool  # "-X%": a fall is bad; "+X%": a rise is bad

    @property
    def limit(self) -> float:
        return 1.0 - self.tolerance if self.higher_is_better else 1.0 + self.tolerance

    @classmethod
    def parse(cls, spec: str) -> MetricRule:
        m = re.fullmatch(r"\s*([\w.]+)\s*:\s*([+-])\s*(\d+(?:\.\d+)?)\s*%\s*", spec)
        if not m:
            raise GateError(
                f"bad --metric {spec!r}: expected NAME:-X% (higher is better, may fall X%) "
                "or NAME:+X% (lower is better, may rise X%), e.g. output_tok_s:-5% or ttft_p99:+10%"
            )
        metric_path(m.group(1))  # validate the name now
        return cls(m.group(1), float(m.group(3)) / 100.0, higher_is_better=m.group(2) == "-")

    def __str__(self) -> str:
        return f"{self.metric}:{'-' if self.higher_is_better else '+'}{self.tolerance * 100:g}%"
