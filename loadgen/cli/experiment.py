"""``bench experiment NAME``: run one of the named experiments (:mod:`loadgen.experiments.catalog`) and print
its table and verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from loadgen.defaults import RESULTS_ROOT
from loadgen.experiments.catalog import EXPERIMENTS
from loadgen.experiments.experiment import cell, run_experiment, write_experiment_report
from loadgen.records.results import new_run_id


def experiment_command(
    name: Annotated[str, typer.Argument(help="batching, chunked-prefill, scheduling, prefix-cache, speculative or quantization.")],
    quick: Annotated[bool, typer.Option("--quick", help="Smaller traffic: under 2 minutes.")] = False,
    out: Annotated[Path | None, typer.Option(help="Results directory (default results/exp-NAME-<id>).")] = None,
    model: Annotated[Path | None, typer.Option(help="GGUF model (default: the bundled SmolLM2).")] = None,
) -> None:
    """Run a named experiment: the reference server in each configuration, the same traffic, one table."""
    if name not in EXPERIMENTS:
        Console(stderr=True).print(f"[red]error:[/] unknown experiment {name!r}: choose one of {', '.join(EXPERIMENTS)}")
        raise typer.Exit(2)
    exp = EXPERIMENTS[name]()
    out = out or RESULTS_ROOT / f"exp-{name}-{new_run_id()}"
    console = Console()
    comparison = run_experiment(exp, out, quick, model, console.print)
    print_comparison(comparison, console)
    write_experiment_report(exp, out, comparison, console.print)


def print_comparison(c: dict[str, Any], console: Console) -> None:
    """An experiment's table (its columns, one row per configuration and point) and verdict."""
    table = Table(title=f"{c['experiment']}: {c['claim']}")
    for col in c["columns"]:
        table.add_column(col, justify="left" if col in ("config", "point") else "right")
    for r in c["rows"]:
        table.add_row(*(cell(r[k], c["formats"].get(k, "{}")) for k in c["columns"]))
    console.print(table)
    console.print(f"[bold]verdict:[/] {c['verdict']}")
