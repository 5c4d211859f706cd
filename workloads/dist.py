"""Distributions of positive numbers in workload files (token counts, turns, seconds): a number or a table."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from workloads.validation import Table, WorkloadError, type_name

DISTS = ("fixed", "uniform", "normal", "lognormal", "empirical")


@dataclass(frozen=True)
class Dist:
    """A distribution of positive numbers (token counts, turns, seconds)."""

    kind: str = "fixed"
    value: float = 0.0  # fixed
    low: float = 0.0  # uniform
    high: float = 0.0
    mean: float = 0.0  # normal
    std: float = 0.0
    median: float = 0.0  # lognormal: exp(mu)
    sigma: float = 0.0  # lognormal shape
    values: tuple[float, ...] = ()  # empirical
    weights: tuple[float, ...] = ()
    clip_min: float | None = None
    clip_max: float | None = None

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            x = self.value
        elif self.kind == "uniform":
            x = rng.uniform(self.low, self.high)
        elif self.kind == "normal":
            x = rng.gauss(self.mean, self.std)
        elif self.kind == "lognormal":
            x = rng.lognormvariate(math.log(self.median), self.sigma)
        else:
            x = rng.choices(self.values, weights=self.weights or None)[0]
        if self.clip_min is not None:
            x = max(x, self.clip_min)
        if self.clip_max is not None:
            x = min(x, self.clip_max)
        return x

    def sample_int(self, rng: random.Random, minimum: int = 1) -> int:
        return max(minimum, round(self.sample(rng)))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dist": self.kind}
        fields_by_kind = {"fixed": ("value",), "uniform": ("low", "high"), "normal": ("mean", "std"),
                          "lognormal": ("median", "sigma"), "empirical": ("values", "weights")}  # fmt: skip
        for name in fields_by_kind[self.kind]:
            out[name] = list(v) if isinstance(v := getattr(self, name), tuple) else v
        if self.clip_min is not None:
            out["min"] = self.clip_min
        if self.clip_max is not None:
            out["max"] = self.clip_max
        return out


def parse_dist(value: object, source: str, key: str, *, integer: bool = True) -> Dist:
    """A number (fixed) or a table ``{dist = "...", ...}``; see docs/workloads.md."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < (1 if integer else 0):
            raise WorkloadError(source, key, f"expected a number >= {1 if integer else 0}, got {value!r}")
        return Dist("fixed", value=float(value))
    if not isinstance(value, dict):
        raise WorkloadError(
            source, key, f"expected a number or a distribution table, got {type_name(value)} {value!r}"
        )
    t = Table(value, source, key)
    kind = t.choice("dist", DISTS, "fixed")
    lo = t.number("min", minimum=0)
    hi = t.number("max", minimum=0)
    if lo is not None and hi is not None and hi < lo:
        raise t.error("max", f"expected a number >= min ({lo:g}), got {hi:g}")
    if kind == "fixed":
        d = Dist("fixed", value=t.number("value", required=True, minimum=0) or 0.0)
    elif kind == "uniform":
        low, high = t.number("low", required=True, minimum=0), t.number("high", required=True, minimum=0)
        if high < low:  # type: ignore[operator]
            raise t.error("high", f"expected a number >= low ({low:g}), got {high:g}")
        d = Dist("uniform", low=low or 0.0, high=high or 0.0)
    elif kind == "normal":
        d = Dist(
            "normal",
            mean=t.number("mean", required=True) or 0.0,
            std=t.number("std", required=True, minimum=0) or 0.0,
        )
    elif kind == "lognormal":
        d = Dist("lognormal", median=t.number("median", required=True, positive=True) or 1.0,
                 sigma=t.number("sigma", required=True, minimum=0) or 0.0)  # fmt: skip
    else:
        values = t.get("values", list, required=True)
        weights = t.get("weights", list, [])
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise WorkloadError(source, f"{key}.values[{i}]", f"expected a number >= 0, got {v!r}")
        if not values:
            raise t.error("values", "expected a non-empty array of numbers")
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
                raise WorkloadError(source, f"{key}.weights[{i}]", f"expected a number >= 0, got {w!r}")
        if weights and (len(weights) != len(values) or sum(weights) <= 0):
            raise t.error(
                "weights", f"expected {len(values)} numbers >= 0 (one per value) with a positive sum"
            )
        d = Dist(
            "empirical", values=tuple(float(v) for v in values), weights=tuple(float(w) for w in weights)
        )
    t.done()
    return Dist(**{**d.__dict__, "clip_min": lo, "clip_max": hi})
