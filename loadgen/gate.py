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

Exit codes: 0 pass, 1 regression, 2 inconclusive or invalid comparison.

Size: the comparison and its statistics (t quantile, expanded-percentile bootstrap of a ratio, verdicts) are
one argument, documented in docs/ci-gate.md; the statistics are used nowhere else.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.defaults import RUN_FILE, SUMMARY_FILE
from loadgen.metrics import LATENCIES
from loadgen.options import RunOptions
from loadgen.percentiles import STAT_KEYS
from loadgen.records import write_json
from loadgen.results import leaves, lookup, read_summary

EXIT = {"pass": 0, "regression": 1, "inconclusive": 2, "invalid": 2}
BASELINE_FORMAT = "servelab-baseline/1"

# Short metric names -> path in a PointSummary (loadgen.metrics); any dotted path is accepted too.
_THROUGHPUT = {"output_tok_s": "output_tok_per_s", "total_tok_s": "total_tok_per_s", "req_s": "req_per_s"}
_TRIAL = re.compile(r"/t(\d+)$")


class GateError(ValueError):
    """The comparison cannot be made (bad input, differing fingerprints): exit 2."""


def metric_path(name: str) -> tuple[str, ...]:
    """``output_tok_s`` -> throughput.steady.output_tok_per_s, ``ttft_p99`` -> latency.ttft.p99, a dotted
    path -> itself."""
    if name in _THROUGHPUT:
        return ("throughput", "steady", _THROUGHPUT[name])
    if name == "error_rate":
        return ("errors", "rate")
    if name == "goodput":
        return ("goodput", "req_per_s")
    if name == "capacity":  # a `bench capacity` result: loadgen.capacity.gate_capacity compares it
        return ("capacity",)
    for lat in LATENCIES:
        for st in STAT_KEYS:
            if name == f"{lat}_{st}":
                return ("latency", lat, st)
    if "." in name:
        return tuple(name.split("."))
    known = sorted([*_THROUGHPUT, "error_rate", "goodput"]) + [f"{lat}_p99" for lat in LATENCIES[:3]]
    raise GateError(f"unknown metric {name!r}: use e.g. {', '.join(known)}, or a dotted summary path")


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


@dataclass
class ResultSet:
    """One side of a comparison: trial values per point, with the fingerprints they ran under."""

    source: str
    fingerprint: dict[str, Any]
    environment: dict[str, Any]
    points: dict[str, list[dict[str, Any]]]  # base point id -> PointSummary per trial, in trial order
    paired: bool = False


def load(path: str | Path) -> ResultSet:
    """A result directory (its ``summary.json``), a ``summary.json`` or a saved baseline file."""
    p = Path(path)
    file = p / SUMMARY_FILE if p.is_dir() else p
    run_json = p / RUN_FILE if p.is_dir() else p.with_name(RUN_FILE)
    if p.is_dir() and not file.is_file():  # a run killed before its summary: recomputed from its records
        try:
            doc: Any = read_summary(p)[0]
        except (FileNotFoundError, ValueError) as exc:
            raise GateError(f"{path}: {exc}") from None
    elif not file.is_file():
        raise GateError(
            f"{path}: no such result (expected a results/<run_id>/ directory or a baseline .json)"
        )
    else:
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise GateError(f"{file}: not a readable JSON result: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
        raise GateError(f"{file}: no 'points' list; is this a servelab summary.json or baseline?")
    points: dict[str, list[dict[str, Any]]] = {}
    for pt in doc["points"]:
        pid = str(pt.get("point_id", ""))
        points.setdefault(_TRIAL.sub("", pid), []).append(pt)
    if not points:
        raise GateError(f"{file}: the result has no points")
    for trials in points.values():
        trials.sort(key=_trial_index)
    return ResultSet(
        source=str(path),
        fingerprint=comparable_config(doc),
        environment={k: v for k, v in (doc.get("environment") or {}).items() if k not in ENV_IGNORED},
        points=points,
        paired=bool(doc.get("ab_paired", False)) or _run_flag(run_json, "ab_paired"),
    )


def _run_flag(run_json: Path, key: str) -> bool:
    """A flag from the ``run.json`` beside a ``summary.json`` (interleaved A/B runs mark themselves there)."""
    try:
        return bool(json.loads(run_json.read_text(encoding="utf-8")).get(key, False))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


# Config keys that do not change what is measured (loadgen.options.RunOptions marks them). Everything else in
# ``config`` (workload, load, model, API, client) must match; the seed need not (another sample of the same workload).
CONFIG_IGNORED = RunOptions.incomparable() | {"run_id"}  # run_id: results written before RunOptions
CONFIG_DEFAULTS = RunOptions.config_defaults()
ENV_IGNORED = frozenset({"load_average"})


def comparable_config(doc: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for two results to be compared: the run config without :data:`CONFIG_IGNORED`
    (so a refusal can name the field), or the bare ``fingerprint`` when a result has no config."""
    config = doc.get("config")
    if isinstance(config, dict):  # a key newer than the result: it ran with that option's default
        return {k: v for k, v in {**CONFIG_DEFAULTS, **config}.items() if k not in CONFIG_IGNORED}
    fp = doc.get("fingerprint")
    return fp if isinstance(fp, dict) else {"fingerprint": fp}


def _trial_index(pt: dict[str, Any]) -> int:
    if isinstance(pt.get("trial"), int):
        return int(pt["trial"])
    m = _TRIAL.search(str(pt.get("point_id", "")))
    return int(m.group(1)) if m else 0


def save_baseline(result: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the result's fingerprints and point summaries as a baseline file; returns it."""
    rs = load(result)  # validates the result
    src = Path(result)
    doc = json.loads((src / SUMMARY_FILE if src.is_dir() else src).read_text(encoding="utf-8"))
    baseline = {
        "format": BASELINE_FORMAT,
        "run_id": doc.get("run_id"),
        "fingerprint": doc.get("fingerprint"),
        "environment": doc.get("environment"),
        "config": doc.get("config"),
        "ab_paired": rs.paired,
        "points": doc["points"],
    }
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json(dest, baseline, sort_keys=True)
    return baseline


# --- fingerprints --------------------------------------------------------------------------------------


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human-readable ``field: A != B`` for every leaf that differs."""
    la, lb = leaves(a), leaves(b)
    return [f"{k}: {la.get(k, '<absent>')!r} != {lb.get(k, '<absent>')!r}" for k in sorted(set(la) | set(lb))
            if la.get(k, "<absent>") != lb.get(k, "<absent>")]  # fmt: skip


# --- statistics ----------------------------------------------------------------------------------------


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


# --- the comparison ------------------------------------------------------------------------------------


@dataclass
class Check:
    point: str
    metric: str
    rule: str
    verdict: str  # pass | regression | inconclusive
    baseline_mean: float | None = None
    candidate_mean: float | None = None
    ratio: float | None = None
    ci: tuple[float, float] | None = None
    limit: float | None = None
    n_baseline: int = 0
    n_candidate: int = 0
    reason: str = ""


@dataclass
class GateReport:
    verdict: str  # pass | regression | inconclusive | invalid
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    baseline: str = ""
    candidate: str = ""
    confidence: float = 0.95

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return d


def _values(trials: list[dict[str, Any]], path: tuple[str, ...]) -> dict[int, float]:
    """Trial index -> the metric's value, for the trials that have a finite value."""
    out = {}
    for pt in trials:
        v = lookup(pt, path)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[_trial_index(pt)] = float(v)
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
    for pid in common:
        for rule in rules:
            path = metric_path(rule.metric)
            base, cand = _values(baseline.points[pid], path), _values(candidate.points[pid], path)
            if not base and not cand:
                rep.errors.append(f"{pid}: metric {rule.metric} ({'.'.join(path)}) is in neither result")
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


# --- output --------------------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def _ci(c: Check) -> str:
    return f"[{c.ci[0]:.3f}, {c.ci[1]:.3f}]" if c.ci else "-"


_ICON = {
    "pass": "✅ pass",
    "regression": "❌ regression",
    "inconclusive": "⚠️ inconclusive",
    "invalid": "⛔ invalid",
}


def to_markdown(rep: GateReport) -> str:
    """A summary for CI job summaries and PR comments."""
    lines = [
        f"### servelab gate: {_ICON[rep.verdict]}",
        "",
        f"baseline `{rep.baseline}` vs candidate `{rep.candidate}`, {rep.confidence:.0%} bootstrap interval of "
        "candidate/baseline",
        "",
    ]
    if rep.checks:
        lines += [
            "| point | metric | rule | baseline | candidate | ratio | interval | trials | verdict |",
            "|---|---|---|---:|---:|---:|---|---:|---|",
        ]
        for c in rep.checks:
            lines.append(
                f"| {c.point} | {c.metric} | `{c.rule}` | {_fmt(c.baseline_mean)} | {_fmt(c.candidate_mean)} | "
                f"{_fmt(c.ratio)} | {_ci(c)} | {c.n_baseline}/{c.n_candidate} | {_ICON[c.verdict]} |"
            )
        notes = [f"- {c.point} {c.metric}: {c.reason}" for c in rep.checks if c.verdict != "pass"]
        if notes:
            lines += ["", *notes]
    lines += [f"- ⛔ {e}" for e in rep.errors]
    lines += [f"- ⚠️ {w}" for w in rep.warnings]
    return "\n".join(lines) + "\n"


def print_report(rep: GateReport) -> None:
    """The verdict table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # CI logs: no terminal width to fit, keep the table readable
        console.width = 120
    style = {"pass": "green", "regression": "bold red", "inconclusive": "yellow", "invalid": "bold red"}
    if rep.checks:
        table = Table(title=f"gate: {rep.baseline} -> {rep.candidate}")
        for col in ("point", "rule", "baseline", "candidate", "ratio", f"{rep.confidence:.0%} CI", "n", "verdict"):
            table.add_column(col, justify="right" if col in ("baseline", "candidate", "ratio", "n") else "left")
        for c in rep.checks:
            table.add_row(
                c.point, c.rule, _fmt(c.baseline_mean), _fmt(c.candidate_mean), _fmt(c.ratio), _ci(c),
                f"{c.n_baseline}/{c.n_candidate}", f"[{style[c.verdict]}]{c.verdict}[/]",
            )  # fmt: skip
        console.print(table)
        for c in rep.checks:
            if c.verdict != "pass":
                console.print(f"  {c.point} {c.metric}: {c.reason}")
    for e in rep.errors:
        console.print(f"[bold red]error:[/] {e}")
    for w in rep.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    console.print(f"verdict: [{style[rep.verdict]}]{rep.verdict}[/] (exit {rep.exit_code})")
