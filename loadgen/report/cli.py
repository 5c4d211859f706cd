"""``bench report RESULTS_DIR... [-o report.html]`` and the report written after every run/sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from loadgen.defaults import REPORT_FILE, SUMMARY_FILE
from loadgen.report.builder import PLOTLY_MODES, write_report
from loadgen.report.load import ReportInputError

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
