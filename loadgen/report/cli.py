"""``bench report RESULTS_DIR... [-o report.html]`` and the report written after every run/sweep; ``bench trace``
(the timeline itself: :mod:`loadgen.report.trace`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from loadgen.defaults import REPORT_FILE, SUMMARY_FILE
from loadgen.report.builder import PLOTLY_MODES, write_report
from loadgen.report.load import ReportInputError
from loadgen.report.trace import build_trace, check, write_trace

console = Console(stderr=True)


def default_output(result_dirs: list[Path]) -> Path:
    """``<dir>/report.html`` for one run, ``./report.html`` for a comparison."""
    return result_dirs[0] / REPORT_FILE if len(result_dirs) == 1 else Path(REPORT_FILE)


def report_command(
    results_dirs: Annotated[
        list[Path], typer.Argument(help="results/<run_id> directories; several are compared in one report.")
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="HTML file (default: <dir>/report.html, ./report.html for several)."
        ),
    ] = None,
    plotly: Annotated[
        str, typer.Option(help="plotly.js: inline (self-contained, works offline) or cdn (smaller file, needs "
                          "the network to draw the charts).")
    ] = "inline",
) -> None:  # fmt: skip
    """Write one HTML report (summary first, then sweep curves, timelines, distributions)."""
    if plotly not in PLOTLY_MODES:
        console.print(f"[red]error[/]: --plotly must be one of {', '.join(PLOTLY_MODES)}, got {plotly!r}")
        raise typer.Exit(2)
    for d in results_dirs:
        if d.is_dir() and not (d / SUMMARY_FILE).is_file() and (d / "points").is_dir():
            console.print(f"[yellow]note[/]: {d} has no summary.json (the run ended before writing it): "
                          "recomputing it from requests.jsonl")  # fmt: skip
    try:
        out = write_report(results_dirs, output or default_output(results_dirs), plotly)
    except ReportInputError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(2) from None
    print(f"report: {out} ({out.stat().st_size / 1e6:.1f} MB)")


def auto_report(run_dir: Path) -> str:
    """The report of a run that just finished, as a line to print; a failure here never fails the run."""
    try:
        return f"report: {write_report([run_dir], run_dir / 'report.html')}"
    except Exception as exc:  # the results are already safe on disk: say why and go on
        return f"[yellow]warning[/]: no report ({type(exc).__name__}: {exc}); retry with `bench report {run_dir}`"


def trace_command(
    results_dir: Annotated[Path, typer.Argument(help="A results directory of bench run / bench sweep.")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Trace file, .json or .json.gz "
                      "(default: RESULTS_DIR/trace.json).")] = None,
    point: Annotated[list[str] | None, typer.Option(help="Only this point id (repeat for several).")] = None,
    tokens: Annotated[bool, typer.Option(help="An instant per streamed chunk (--no-tokens: smaller file for "
                      "long runs).")] = True,
) -> None:  # fmt: skip
    """Write a Perfetto / chrome://tracing timeline of a run: requests, engine steps, server and host series."""
    out = output or results_dir / "trace.json"
    if not out.name.endswith((".json", ".json.gz")):
        typer.echo(f"error: -o must end in .json or .json.gz (Chrome JSON trace format), got {out.name}", err=True)
        raise typer.Exit(2)
    try:
        trace, counts = build_trace(results_dir, point, tokens)
    except (FileNotFoundError, KeyError) as exc:
        typer.echo(f"error: {exc.args[0] if exc.args else exc}", err=True)
        raise typer.Exit(2) from None
    check(trace)
    write_trace(trace, out)
    for pid, c in counts.items():
        typer.echo(f"{pid}: {c['requests']} requests, {c['tokens']} token events, {c['engine_steps']} engine steps, "
                   f"{c['server_samples']} server and {c['telemetry_samples']} telemetry values")
    typer.echo(f"trace: {out} (open in https://ui.perfetto.dev or chrome://tracing)")
