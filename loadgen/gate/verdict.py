"""The gate's verdict: one :class:`Check` per point and rule, the :class:`GateReport` with its exit code, and
how it is shown: :func:`to_markdown` for CI summaries (on the terminal: :func:`loadgen.gate.cli.print_report`).

Exit codes: 0 pass, 1 regression, 2 inconclusive or invalid comparison."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

EXIT = {"pass": 0, "regression": 1, "inconclusive": 2, "invalid": 2}


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


def fmt_value(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"


def fmt_ci(c: Check) -> str:
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
                f"| {c.point} | {c.metric} | `{c.rule}` | {fmt_value(c.baseline_mean)} | {fmt_value(c.candidate_mean)} | "
                f"{fmt_value(c.ratio)} | {fmt_ci(c)} | {c.n_baseline}/{c.n_candidate} | {_ICON[c.verdict]} |"
            )
        notes = [f"- {c.point} {c.metric}: {c.reason}" for c in rep.checks if c.verdict != "pass"]
        if notes:
            lines += ["", *notes]
    lines += [f"- ⛔ {e}" for e in rep.errors]
    lines += [f"- ⚠️ {w}" for w in rep.warnings]
    return "\n".join(lines) + "\n"
