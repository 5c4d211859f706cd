"""``bench kv-budget``: its options, and the budget (:mod:`loadgen.experiments.kvbudget`) as tables or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from loadgen.cli.options import command
from loadgen.experiments.kvbudget import (
    DEFAULT_CONTEXTS,
    DTYPE_BYTES,
    KVBudget,
    ModelShape,
    kv_budget,
    parse_size,
    shape_from_gguf,
)
from loadgen.runoptions import option


def render(budget: KVBudget, console: Console) -> None:
    gb = 1e9
    console.print(
        f"[bold]{budget.model}[/]: {budget.memory_bytes / gb:.2f} GB memory - {budget.weight_bytes / gb:.2f} GB "
        f"weights = [bold]{budget.kv_bytes / gb:.2f} GB[/] for KV ({budget.dtype}, blocks of {budget.block_size})"
    )
    console.print(
        f"KV per token: {budget.bytes_per_token / 1024:.1f} KiB with GQA, "
        f"{budget.bytes_per_token_no_gqa / 1024:.1f} KiB without -> max tokens in KV: "
        f"[bold]{budget.max_tokens:,}[/] (without GQA {budget.max_tokens_no_gqa:,})"
    )
    table = Table(title="max concurrent requests per context length")
    table.add_column("context", justify="right")
    table.add_column("with GQA", justify="right")
    table.add_column("without GQA", justify="right")
    table.add_column(f"GQA + {budget.shared_prefix}-token shared prefix", justify="right")
    for r in budget.rows:
        table.add_row(f"{r.context:,}", f"{r.concurrent:,}", f"{r.concurrent_no_gqa:,}", f"{r.concurrent_shared_prefix:,}")
    console.print(table)
    choices = Table(title="each KV cache dtype in the same memory (with GQA): max concurrent requests per context")
    for col in ("KV dtype", "bytes/token", "max tokens", *(f"{r.context:,}" for r in budget.rows)):
        choices.add_column(col, justify="right")
    for d in budget.dtypes:
        choices.add_row(d.dtype, f"{d.bytes_per_token:,.0f}", f"{d.max_tokens:,}", *(f"{c:,}" for c in d.concurrent))
    console.print(choices)


@dataclass(frozen=True)
class KVBudgetOptions:
    """What ``bench kv-budget`` was asked; each field is one of its options (:func:`loadgen.runoptions.option`)."""

    memory: str = option(help="Accelerator/host memory, e.g. 80GB, 24GiB (bare number = GB).")
    gguf: Path | None = option(None, "Read layers/heads/KV heads/head dim from this GGUF.")
    weights: str | None = option(None, "Weight size, e.g. 40GB (default with --gguf: its tensor data size).")
    layers: int | None = option(None, "Number of layers (without --gguf).")
    heads: int | None = option(None, "Query heads (without --gguf).")
    kv_heads: int | None = option(None, "KV heads (default: = heads, i.e. no GQA).")
    head_dim: int | None = option(None, "Head dimension (without --gguf).")
    dtype: str = option("bf16", f"KV cache dtype: {', '.join(DTYPE_BYTES)}.")
    context: list[int] | None = option(None, "Context length (repeat); default a range.", "--context", "-c")
    block_size: int = option(16, "KV block size in tokens (paged allocation).")
    shared_prefix: int = option(0, "Tokens of a prefix shared by all requests.")
    utilization: float = option(1.0, "Fraction of memory the server may use.")
    as_json: bool = option(False, "Print JSON instead of tables.", "--json")


def _kv_budget(**options: Any) -> None:
    """How many tokens and concurrent requests fit in the KV cache (with/without GQA, prefix sharing)."""
    o = KVBudgetOptions(**options)
    try:
        if o.gguf is not None:
            shape, gguf_weights = shape_from_gguf(o.gguf)
            weight_bytes = parse_size(o.weights) if o.weights else gguf_weights
        else:
            if o.layers is None or o.heads is None or o.head_dim is None or o.weights is None:
                raise ValueError("give --gguf PATH, or --layers, --heads, --head-dim and --weights")
            shape = ModelShape(o.layers, o.heads, o.kv_heads or o.heads, o.head_dim)
            weight_bytes = parse_size(o.weights)
        budget = kv_budget(
            shape,
            parse_size(o.memory),
            weight_bytes,
            dtype=o.dtype,
            contexts=tuple(o.context) if o.context else DEFAULT_CONTEXTS,
            block_size=o.block_size,
            shared_prefix=o.shared_prefix,
            utilization=o.utilization,
        )
    except ValueError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    if o.as_json:
        print(json.dumps(asdict(budget), indent=2))
    else:
        render(budget, Console())


kv_budget_command = command(_kv_budget, options=KVBudgetOptions)
