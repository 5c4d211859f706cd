"""``bench gate`` and ``bench baseline save``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from loadgen.defaults import RESULTS_ROOT, SUMMARY_FILE
from loadgen.exitcodes import UsageError, console, exits
from loadgen.gate import (
    GateError,
    GateReport,
    MetricRule,
    compare,
    load,
    print_report,
    save_baseline,
    to_markdown,
)
from loadgen.records import write_json


def gate(
    baseline: Annotated[
        str, typer.Option(help="Baseline result dir or baseline .json (with --ab: server command).")
    ],
    candidate: Annotated[str, typer.Option(help="Candidate result dir (with --ab: server command, {port}).")],
    metric: Annotated[
        list[str], typer.Option(help="NAME:-X% (higher is better) or NAME:+X% (lower is better); repeat.")
    ],
    confidence: Annotated[float, typer.Option(help="Confidence level of the bootstrap interval.")] = 0.95,
    min_trials: Annotated[
        int, typer.Option(help="Fewer trials per side (pairs with --ab) -> inconclusive.")
    ] = 5,
    point: Annotated[
        list[str] | None, typer.Option(help="Only these point ids (without /t<k>); repeat.")
    ] = None,
    markdown: Annotated[
        Path | None,
        typer.Option(
            help="Write the Markdown summary here (also appended to $GITHUB_STEP_SUMMARY when set)."
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the verdict as JSON here.")] = None,
    ab: Annotated[
        bool, typer.Option("--ab", help="Start both servers and run interleaved A/B trials first.")
    ] = False,
    trials: Annotated[int, typer.Option(help="--ab: trials per side.")] = 6,
    workload: Annotated[str, typer.Option(help="--ab: workload name or TOML path.")] = "chat-short",
    concurrency: Annotated[int, typer.Option(help="--ab: closed-loop concurrency.")] = 4,
    num_requests: Annotated[int, typer.Option(help="--ab: measured requests per trial.")] = 16,
    warmup: Annotated[int, typer.Option(help="--ab: warm-up requests per trial.")] = 2,
    seed: Annotated[int, typer.Option(help="--ab: seed (trial k uses seed + k on both sides).")] = 0,
    backend: Annotated[str, typer.Option(help="--ab: server dialect (auto: ask the server).")] = "auto",
    model: Annotated[str | None, typer.Option(help="--ab: model name (default: GET /v1/models).")] = None,
    output_dir: Annotated[Path, typer.Option(help="--ab: results root.")] = RESULTS_ROOT,
    run_id: Annotated[str | None, typer.Option(help="--ab: run id (default: gate-<timestamp>).")] = None,
) -> None:
    """Compare a candidate with a baseline: exit 0 pass, 1 regression, 2 inconclusive or invalid."""
    with exits():
        try:
            rules = [MetricRule.parse(m) for m in metric]
        except GateError as exc:
            raise UsageError(str(exc)) from None
        if not 0.5 < confidence < 1:
            raise UsageError(f"--confidence must be in (0.5, 1), got {confidence}")
        if min_trials < 2:
            raise UsageError("--min-trials must be >= 2 (a bootstrap needs spread)")
        if ab:
            baseline, candidate = _run_ab(
                baseline, candidate, trials, workload, concurrency, num_requests, warmup, seed, backend, model,
                output_dir, run_id,
            )  # fmt: skip
        for side in (baseline, candidate):
            if Path(side).is_dir() and not (Path(side) / SUMMARY_FILE).is_file():
                console.print(f"[yellow]note[/]: {side} has no summary.json (the run ended before writing it): "
                              "recomputing it from requests.jsonl")  # fmt: skip
        try:
            if any(r.metric == "capacity" for r in rules):
                from loadgen.capacity import gate_capacity

                rep = gate_capacity(baseline, candidate, rules)
            else:
                rep = compare(load(baseline), load(candidate), rules, confidence, min_trials, point or None)
        except GateError as exc:
            rep = GateReport(
                "invalid", errors=[str(exc)], baseline=baseline, candidate=candidate, confidence=confidence
            )
        print_report(rep)
        md = to_markdown(rep)
        if markdown:
            markdown.parent.mkdir(parents=True, exist_ok=True)
            markdown.write_text(md, encoding="utf-8")
        if step_summary := os.environ.get("GITHUB_STEP_SUMMARY"):
            with open(step_summary, "a", encoding="utf-8") as f:
                f.write(md)
        if json_out:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            write_json(json_out, rep.to_dict())
        raise typer.Exit(rep.exit_code)


def _run_ab(
    baseline_cmd: str, candidate_cmd: str, trials: int, workload: str, concurrency: int, num_requests: int,
    warmup: int, seed: int, backend: str, model: str | None, output_dir: Path, run_id: str | None,
) -> tuple[str, str]:  # fmt: skip
    """Run the interleaved trials; returns the two result directories."""
    from backends.launcher import LaunchError
    from loadgen.ab import run_ab
    from loadgen.engine import LoadSpec
    from loadgen.results import new_run_id
    from loadgen.targets import load_workload, make_backend

    if trials < 2 or concurrency < 1 or num_requests < 1 or warmup < 0:
        raise UsageError("--ab needs --trials >= 2, --concurrency >= 1, --num-requests >= 1, --warmup >= 0")
    for name, cmd in (("--baseline", baseline_cmd), ("--candidate", candidate_cmd)):
        if "{port}" not in cmd:
            raise UsageError(f"with --ab, {name} is a server command with a {{port}} placeholder, got {cmd!r}")
    try:
        wl = load_workload(workload)
        load_spec = LoadSpec(
            "closed", concurrency=concurrency, num_requests=num_requests, warmup=warmup, seed=seed
        )
    except (UsageError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    config = {
        "command": "gate --ab", "backend": backend, "api": None, "model": model, "workloads": [workload],
        "concurrency": [concurrency], "rate": [], "arrival": "closed", "num_requests": num_requests,
        "warmup": warmup, "seed": seed, "repeat": trials,
    }  # fmt: skip
    rid = run_id or f"gate-{new_run_id()}"

    def progress(k: int, side: str, s: dict) -> None:  # type: ignore[type-arg]
        thr = s["throughput"]["steady"]["output_tok_per_s"]
        console.print(
            f"[dim]trial {k} {side:9s} {thr or 0:8.1f} out tok/s  errors {s['counts']['errors']}[/]"
        )

    console.print(f"A/B: {trials} interleaved trials per side, c={concurrency}, {num_requests} requests each")
    try:
        dirs = run_ab(
            {"baseline": baseline_cmd, "candidate": candidate_cmd},
            lambda url: make_backend(backend, url, model, None, None, False, None),
            wl, load_spec, trials, output_dir, rid, config, on_trial=progress,
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
