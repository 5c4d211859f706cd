"""``bench gate --metric capacity:-X%``: two ``bench capacity`` results compared by their intervals."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.capacity.result import fmt_load
from loadgen.defaults import CAPACITY_FILE
from loadgen.gate.verdict import Check, GateReport


def load_capacity(path: str | Path) -> dict[str, Any]:
    """``capacity.json`` of a ``bench capacity`` result directory (or the file itself)."""
    import json

    p = Path(path)
    file = p / CAPACITY_FILE if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"{path}: no {CAPACITY_FILE} (expected a `bench capacity` result directory)")
    return dict(json.loads(file.read_text()))


def gate_capacity(baseline: str, candidate: str, rules: Sequence[Any]) -> Any:
    """``bench gate --metric capacity:-X%``: per server configuration, the capacity ratio candidate/baseline
    lies in [lo_c / hi_b, hi_c / lo_b] (both searches' intervals; an integer concurrency capacity is at most
    hi - 1); regression when that whole range is below ``1 - X``, pass when it is all at or above,
    inconclusive otherwise."""
    rep = GateReport("invalid", baseline=baseline, candidate=candidate)
    try:
        docs = [load_capacity(baseline), load_capacity(candidate)]
    except (ValueError, OSError) as exc:
        rep.errors.append(str(exc))
        return rep
    keys = ("slo", "mode", "workload", "arrival")
    diff = [f"{k}: {docs[0]['config'].get(k)!r} vs {docs[1]['config'].get(k)!r}" for k in keys
            if docs[0]["config"].get(k) != docs[1]["config"].get(k)]  # fmt: skip
    if diff:
        rep.errors.append("the searches measure different things: " + "; ".join(diff))
        return rep
    base, cand = ({e["point_id"]: e for e in d["configs"] if "status" in e} for d in docs)
    common = [p for p in base if p in cand]
    if not common:
        rep.errors.append(f"no server configuration in common: {sorted(base)} vs {sorted(cand)}")
        return rep
    for rule in rules:
        if rule.metric != "capacity" or not rule.higher_is_better:
            rep.errors.append(f"{rule}: with capacity results the gate takes capacity:-X% only")
            return rep
        step = 1.0 if docs[0]["config"].get("mode") == "concurrency" else 0.0  # an integer capacity is < hi
        for pid in common:
            b, c = base[pid]["interval"], cand[pid]["interval"]
            b_lo, b_hi = b[0] or 0.0, b[1] - step if b[1] is not None else math.inf
            c_lo, c_hi = c[0] or 0.0, c[1] - step if c[1] is not None else math.inf
            lo = c_lo / b_hi if b_hi > 0 else 0.0
            hi = c_hi / b_lo if b_lo > 0 else math.inf
            verdict = "regression" if hi < rule.limit else "pass" if lo >= rule.limit else "inconclusive"
            mid = [(x[0] + x[1]) / 2 if None not in x else x[0] for x in (b, c)]
            ratio = mid[1] / mid[0] if mid[0] and mid[1] is not None else None
            rep.checks.append(Check(
                pid, "capacity", str(rule), verdict, mid[0], mid[1], ratio, (lo, hi), rule.limit, 1, 1,
                reason=f"baseline [{fmt_load(b[0])}, {fmt_load(b[1])}], candidate [{fmt_load(c[0])}, {fmt_load(c[1])}]",
            ))  # fmt: skip
    verdicts = {c.verdict for c in rep.checks}
    rep.verdict = "regression" if "regression" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    return rep
