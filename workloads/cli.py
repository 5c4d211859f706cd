"""``bench workloads list|show|validate``."""

from __future__ import annotations

import json
from itertools import islice
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from workloads.loader import builtin_names, load_spec_for, load_workload
from workloads.spec import BUILTIN_DIR, WorkloadSpec
from workloads.synthetic import spec_dict
from workloads.validation import WorkloadError

app = typer.Typer(
    help="Workload files: list the built-ins, show one, validate your own.", no_args_is_help=True
)
console = Console()
err = Console(stderr=True)


def _classes(spec: WorkloadSpec) -> str:
    if spec.trace is not None:
        return f"trace ({spec.trace.format})"
    return ", ".join(f"{c.name}×{c.weight:g}" for c in spec.classes)


DatasetField = Annotated[str | None, typer.Option(help="a JSONL dataset of text: the key holding each prompt")]


def _load(name: str, field: str | None = None) -> WorkloadSpec:
    try:
        return load_spec_for(name, field=field)
    except WorkloadError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc


@app.command("list")
def list_() -> None:
    """The built-in workloads."""
    table = Table("name", "classes", "arrival", "description")
    for name in builtin_names():
        spec = load_spec_for(name)
        a = spec.arrival
        arrival = a.process or ""
        arrival += f" c={a.concurrency}" if a.concurrency else ""
        arrival += f" r={a.rate:g}/s" if a.rate else ""
        table.add_row(name, _classes(spec), arrival, spec.description)
    console.print(table)
    console.print(f"[dim]files: {BUILTIN_DIR}[/]")


@app.command()
def show(
    name: Annotated[
        str, typer.Argument(help="built-in name, workload .toml, trace (.jsonl Mooncake, .csv Azure) or dataset "
                                 "(.json ShareGPT, .jsonl request bodies or text)")
    ],
    sample: Annotated[int, typer.Option(help="also generate this many requests and show them")] = 3,
    seed: Annotated[int, typer.Option(help="seed for the sample")] = 0,
    dataset_field: DatasetField = None,
) -> None:
    """A workload's settings (as parsed) and a sample of the requests it generates."""
    spec = _load(name, dataset_field)
    if spec.trace is None:
        console.print_json(json.dumps(spec_dict(spec)))
        console.print(f"[dim]file: {spec.source}[/]")
    if sample <= 0:
        return
    try:
        wl = load_workload(name, field=dataset_field)
        sessions = list(islice(wl.sessions(seed), sample))
    except (WorkloadError, FileNotFoundError, ValueError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc
    if spec.trace is not None:
        console.print_json(json.dumps(wl.describe()))
    table = Table("id", "class", "at", "prompt tokens", "max_tokens", "turns", "prompt (start)")
    for sess in sessions:
        req = sess.first()
        text = req.prompt if isinstance(req.prompt, str) else json.dumps(req.prompt, ensure_ascii=False)
        turns = getattr(sess, "turns", 1)
        turns = str(len(turns) if isinstance(turns, list) else turns)
        at = "" if sess.at is None else f"{sess.at:.3f}"
        shown = text[:80].replace("\n", "⏎")
        table.add_row(
            req.request_id, req.workload_class, at, str(req.prompt_tokens), str(req.max_tokens), turns, shown
        )
    console.print(table)


@app.command()
def validate(
    files: Annotated[list[str], typer.Argument(help="workload .toml files, built-in names, trace or dataset files")],
    dataset_field: DatasetField = None,
) -> None:
    """Check workload files (schema, and that prompts can be built); non-zero exit when any fails."""
    failed = 0
    for name in files:
        try:
            wl = load_workload(name, field=dataset_field)
            next(iter(wl.sessions(0))).first()
        except (WorkloadError, FileNotFoundError, ValueError) as exc:
            err.print(f"[red]✗[/] {exc}")
            failed += 1
            continue
        console.print(f"[green]✓[/] {name}: {wl.name}")
    if failed:
        raise typer.Exit(1)
