"""``bench gate`` and ``bench baseline save``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from loadgen.cli.exits import console, exits
from loadgen.cli.options import command
from loadgen.defaults import RESULTS_ROOT, SUMMARY_FILE
from loadgen.exitcodes import UsageError
from loadgen.gate.compare import compare
from loadgen.gate.resultset import load, save_baseline
from loadgen.gate.rules import GateError, MetricRule
from loadgen.gate.verdict import GateReport, fmt_ci, fmt_value, to_markdown
from loadgen.metrics.definitions import OUTPUT_TOK_S
from loadgen.records.writer import write_json
from loadgen.runoptions import option


@dataclass(frozen=True)
class GateOptions:
    """What ``bench gate`` was asked; each field is one of its options (:func:`loadgen.runoptions.option`)."""

    baseline: str = option(help="Baseline result dir or baseline .json (with --ab: server command).")
    candidate: str = option(help="Candidate result dir (with --ab: server command, {port}).")
    metric: list[str] = option(help="NAME:-X% (higher is better) or NAME:+X% (lower is better); repeat.")
    confidence: float = option(0.95, "Confidence level of the bootstrap interval.")
    min_trials: int = option(5, "Fewer trials per side (pairs with --ab) -> inconclusive.")
    point: list[str] | None = option(None, "Only these point ids (without /t<k>); repeat.")
    markdown: Path | None = option(None, "Write the Markdown summary here (also appended to $GITHUB_STEP_SUMMARY "
                                   "when set).")  # fmt: skip
    json_out: Path | None = option(None, "Write the verdict as JSON here.", "--json")
    ab: bool = option(False, "Start both servers and run interleaved A/B trials first.", "--ab")
    trials: int = option(6, "--ab: trials per side.")
    workload: str = option("chat-short", "--ab: workload name or TOML path.")
    concurrency: int = option(4, "--ab: closed-loop concurrency.")
    num_requests: int = option(16, "--ab: measured requests per trial.")
    warmup: int = option(2, "--ab: warm-up requests per trial.")
    seed: int = option(0, "--ab: seed (trial k uses seed + k on both sides).")
    backend: str = option("auto", "--ab: server dialect (auto: ask the server).")
    model: str | None = option(None, "--ab: model name (default: GET /v1/models).")
    output_dir: Path = option(RESULTS_ROOT, "--ab: results root.")
    run_id: str | None = option(None, "--ab: run id (default: gate-<timestamp>).")


def _gate(**options: Any) -> None:
    """Compare a candidate with a baseline: exit 0 pass, 1 regression, 2 inconclusive or invalid."""
    o = GateOptions(**options)
    baseline, candidate, confidence = o.baseline, o.candidate, o.confidence
    with exits():
        try:
            rules = [MetricRule.parse(m) for m in o.metric]
        except GateError as exc:
            raise UsageError(str(exc)) from None
        if not 0.5 < confidence < 1:
            raise UsageError(f"--confidence must be in (0.5, 1), got {confidence}")
        if o.min_trials < 2:
            raise UsageError("--min-trials must be >= 2 (a bootstrap needs spread)")
        if o.ab:
            baseline, candidate = _run_ab(o)
        for side in (baseline, candidate):
            if Path(side).is_dir() and not (Path(side) / SUMMARY_FILE).is_file():
                console.print(f"[yellow]note[/]: {side} has no summary.json (the run ended before writing it): "
                              "recomputing it from requests.jsonl")  # fmt: skip
        try:
            if any(r.metric == "capacity" for r in rules):
                from loadgen.capacity.gate import gate_capacity

                rep = gate_capacity(baseline, candidate, rules)
            else:
                rep = compare(load(baseline), load(candidate), rules, confidence, o.min_trials, o.point or None)
        except GateError as exc:
            rep = GateReport(
                "invalid", errors=[str(exc)], baseline=baseline, candidate=candidate, confidence=confidence
            )
        print_report(rep)
        md = to_markdown(rep)
        if o.markdown:
            o.markdown.parent.mkdir(parents=True, exist_ok=True)
            o.markdown.write_text(md, encoding="utf-8")
        if step_summary := os.environ.get("GITHUB_STEP_SUMMARY"):
            with open(step_summary, "a", encoding="utf-8") as f:
                f.write(md)
        if o.json_out:
            o.json_out.parent.mkdir(parents=True, exist_ok=True)
            write_json(o.json_out, rep.to_dict())
        raise typer.Exit(rep.exit_code)


gate = command(_gate, options=GateOptions)


def _run_ab(o: GateOptions) -> tuple[str, str]:
    """Run the interleaved trials (``--baseline`` and ``--candidate`` are server commands); returns the two
    result directories."""
    from backends.launcher import LaunchError
    from loadgen.cli.targets import load_workload, make_backend
    from loadgen.dispatch.loadspec import LoadSpec
    from loadgen.experiments.ab import run_ab
    from loadgen.records.results import new_run_id

    if o.trials < 2 or o.concurrency < 1 or o.num_requests < 1 or o.warmup < 0:
        raise UsageError("--ab needs --trials >= 2, --concurrency >= 1, --num-requests >= 1, --warmup >= 0")
    for name, cmd in (("--baseline", o.baseline), ("--candidate", o.candidate)):
        if "{port}" not in cmd:
            raise UsageError(f"with --ab, {name} is a server command with a {{port}} placeholder, got {cmd!r}")
    try:
        wl = load_workload(o.workload)
        load_spec = LoadSpec(
            "closed", concurrency=o.concurrency, num_requests=o.num_requests, warmup=o.warmup, seed=o.seed
        )
    except (UsageError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    config = {
        "command": "gate --ab", "backend": o.backend, "api": None, "model": o.model, "workloads": [o.workload],
        "concurrency": [o.concurrency], "rate": [], "arrival": "closed", "num_requests": o.num_requests,
        "warmup": o.warmup, "seed": o.seed, "repeat": o.trials,
    }  # fmt: skip
    rid = o.run_id or f"gate-{new_run_id()}"

    def progress(k: int, side: str, s: dict) -> None:  # type: ignore[type-arg]
        console.print(f"[dim]trial {k} {side:9s} {OUTPUT_TOK_S.of(s) or 0:8.1f} {OUTPUT_TOK_S.label}  "
                      f"errors {s['counts']['errors']}[/]")  # fmt: skip

    console.print(f"A/B: {o.trials} interleaved trials per side, c={o.concurrency}, {o.num_requests} requests each")
    try:
        dirs = run_ab(
            {"baseline": o.baseline, "candidate": o.candidate},
            lambda url: make_backend(o.backend, url, o.model, None, None, False, None),
            wl, load_spec, o.trials, o.output_dir, rid, config, on_trial=progress,
        )  # fmt: skip
    except (LaunchError, UsageError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return str(dirs["baseline"]), str(dirs["candidate"])


baseline_app = typer.Typer(no_args_is_help=True, help="Save results as baselines for bench gate.")


@baseline_app.command("save")
def baseline_save(
    result: Annotated[Path, typer.Argument(help="A results/<run_id>/ directory (ideally from --repeat N).")],
    out: Annotated[
        Path, typer.Option("-o", "--out", help="Baseline file to write, e.g. results/baselines/NAME.json.")
    ],
) -> None:
    """Write a result's fingerprints and point summaries as a baseline file."""
    with exits():
        try:
            doc = save_baseline(result, out)
        except GateError as exc:
            raise UsageError(str(exc)) from None
        rs = load(out)
        for pid, pts in rs.points.items():
            note = "" if len(pts) >= 5 else "  [yellow](fewer than 5 trials: the gate will say inconclusive)[/]"
            console.print(f"{pid}: {len(pts)} trial(s){note}")
        console.print(f"baseline of run {doc.get('run_id')} written to {out}")


def print_report(rep: GateReport) -> None:
    """The verdict table on the terminal."""
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
                c.point, c.rule, fmt_value(c.baseline_mean), fmt_value(c.candidate_mean), fmt_value(c.ratio), fmt_ci(c),
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
