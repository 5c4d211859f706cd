"""``bench verify``: the same prompts alone and under load, answers compared (:mod:`loadgen.experiments.verify`),
on one server or on each configuration of ``--server``/``--grid`` (every one against the first's reference);
the performance table as ``bench run`` prints it, a quality table, the report, and exit 1 when a point fails."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from backends.launcher import GridPoint
from loadgen.cli.exits import console, guard
from loadgen.cli.live import LiveDisplay
from loadgen.cli.options import check, command, param
from loadgen.cli.run import (
    grid_position,
    on_server,
    point_outcome,
    server_failures,
    summary_table,
    sweep_grid,
)
from loadgen.cli.targets import (
    detect_server,
    embedded_server,
    is_finite,
    load_workload,
    make_backend,
    pooling_run,
    read_api_key,
    resolve_tokenizer,
)
from loadgen.dispatch.engine import PointOptions
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.dispatch.sweep import PointPlan, loads_from, run_seed
from loadgen.exitcodes import ExitCode, UsageError, worst
from loadgen.experiments.verify import NEAR_TIE, FirstTokens, Tolerance, plan_verify, run_verify
from loadgen.metrics import pointsummary
from loadgen.records.results import ResultsDir, new_run_id
from loadgen.report.cli import auto_report
from loadgen.runoptions import RunOptions, parse_list
from loadgen.timing.clock import RunClock

# The RunOptions fields bench verify takes as they are, in --help order (concurrency, rate and workload are its own).
NAMES = ("url", "backend", "api", "model", "workload", "concurrency", "rate", "arrival", "num_requests", "seed",
         "repeat", "output_dir", "run_id", "api_key_env", "extra_body", "client", "timeout", "stall_timeout",
         "tokenizer", "max_error_rate", "server", "grid", "server_timeout")  # fmt: skip
DEFAULT_CONCURRENCY = "1,8,32"
DEFAULT_NUM_REQUESTS = 32


def _verify(workload: str, concurrency: str | None, rate: str | None, min_identical: float, near_tie: float,
            max_tokens: int | None, temperature: float, draws: int, confidence: float, grid: list[str] | None,
            **options: Any) -> None:  # fmt: skip
    """Send the same prompts alone (greedy, concurrency 1) and under load; compare the answers prompt by prompt
    (with --server/--grid: every configuration's with the first configuration's reference)."""

    def body() -> ExitCode:
        try:
            tol = Tolerance(min_identical, near_tie, confidence)
        except ValueError as exc:
            raise UsageError(f"--min-identical/--near-tie/--confidence: {exc}") from None
        if max_tokens is not None and max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
        if temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {temperature}")
        if draws < 1 or (draws > 1 and not temperature):
            raise UsageError(f"--draws must be >= 1, and more than 1 only with --temperature > 0 (greedy answers "
                             f"have one outcome), got --draws {draws} at --temperature {temperature:g}")
        conc = parse_list(concurrency, int, "--concurrency") if concurrency else []
        rates = parse_list(rate, float, "--rate") if rate else []
        opts = RunOptions(command="verify", workloads=[workload], concurrency=conc or ([] if rates else
                          parse_list(DEFAULT_CONCURRENCY, int, "--concurrency")), rate=rates, poll_hz=0,
                          telemetry_hz=0, default_num_requests=DEFAULT_NUM_REQUESTS,
                          grid=[axis for g in grid or [] for axis in g.split()], **options)  # fmt: skip
        return execute(opts, tol, max_tokens, temperature, draws)

    guard(body)


verify = command(_verify, (*NAMES, "min_identical", "near_tie", "max_tokens", "temperature", "draws", "confidence"), own={
    "workload": param("workload", Annotated[str, typer.Option(help="Workload name or TOML path; its first "
                      "--num-requests prompts are sent at every point.")], "shared-system-prompt"),
    "concurrency": param("concurrency", Annotated[str | None, typer.Option(
        help=f"Closed-loop concurrencies to compare with the reference (default {DEFAULT_CONCURRENCY}).")], None),
    "rate": param("rate", Annotated[str | None, typer.Option(help="Open-loop rates in req/s, e.g. 2,4,8.")], None),
    "min_identical": param("min_identical", Annotated[float, typer.Option(
        help="A point passes with at least this share of answers identical to the reference's (0..1).")], 1.0),
    "near_tie": param("near_tie", Annotated[float, typer.Option(
        help="... or when every divergence is a near-tie: the top-two logprob margin (nats) at the divergent token below "
             "this.")], NEAR_TIE),
    "max_tokens": param("max_tokens", Annotated[int | None, typer.Option(
        help="Cap every answer at this many tokens (default: the workload's lengths).")], None),
    "temperature": param("temperature", Annotated[float, typer.Option(
        help="Sample at this temperature, one seed per prompt (the workload's, else one made from the request id): "
             "the answers compare only where the server honours the seed (the reference server, vLLM, "
             "llama-server). 0: greedy.")], 0.0),
    "draws": param("draws", Annotated[int, typer.Option(
        help="With --temperature: send every prompt this many times (each draw its own seed, each pass its own "
             "seeds: independent samples) and compare the answers' first tokens' distributions with the reference's "
             "(mean TVD, stratified permutation test); the point's verdict. 1: the seeded draws compared exactly.")], 1),
    "confidence": param("confidence", Annotated[float, typer.Option(
        help="With --draws > 1: a point fails when its first tokens' distributions differ from the reference's at "
             "this confidence (the permutation test's p < 1 - confidence).")], 0.95),
})  # fmt: skip


def execute(opts: RunOptions, tol: Tolerance, max_tokens: int | None, temperature: float, draws: int = 1) -> ExitCode:
    """Check, plan, run the reference and the load points (on each server configuration), compare, print;
    returns the exit code."""
    grid_points = check(opts)
    api_key = read_api_key(opts.api_key_env)
    opts = replace(opts, tokenizer=resolve_tokenizer(opts.tokenizer, opts.url, opts.model, api_key).spec)  # type: ignore[arg-type]
    wl = load_workload(opts.workloads[0], opts.tokenizer, opts.dataset_field)
    if pooling_run(opts.api, [wl]):
        raise UsageError("bench verify compares generated text; an embeddings or rerank run generates none")
    run_id = opts.run_id or new_run_id()
    opts = opts.resolve([wl], finite=is_finite(wl))
    if opts.seed is None:
        opts = replace(opts, seed=run_seed(run_id))
    try:
        base = LoadSpec(concurrency=1, num_requests=opts.num_requests, seed=opts.seed, timeout=opts.timeout,
                        stall_timeout=opts.stall_timeout, burstiness=opts.burstiness)  # fmt: skip
        loads = loads_from(base, opts.concurrency, opts.rate, opts.arrival if opts.arrival not in (None, "closed") else "poisson")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    results = ResultsDir(opts.output_dir / run_id)
    config = {**opts.config(), "verify": {"max_tokens": max_tokens, "temperature": temperature, "draws": draws}}
    clock = RunClock()
    display = LiveDisplay(console, clock)
    first: list[PointPlan] = []  # the reference point of the first configuration that ran

    def go(target: str, gp: GridPoint | None = None, previous: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        det = detect_server(target, api_key)
        name = det.backend if opts.backend == "auto" else opts.backend
        console.print(f"[dim]backend: {name} ({det.evidence})[/]")
        be = make_backend(name, target, opts.model, opts.api, api_key, opts.continuous_usage, opts.extra_body)
        plans = plan_verify(wl, base, loads, opts.repeat, max_tokens, temperature, draws)  # fresh answers per configuration
        plans = plans if gp is None else on_server(plans, gp)
        against = first[0] if first else None
        if not first:
            first.append(plans[0])
        return run_async(run_verify(be, plans, results, clock, config, tol, against=against, previous=previous or [],
                                    live=display.points(plans, grid_position(grid_points, gp)),
                                    options=PointOptions(client_kind=opts.client)))  # fmt: skip

    if draws > 1:
        console.print(f"[yellow]note[/]: sampled at temperature {temperature:g}, {draws} draws per prompt (one seed "
                      "each, each pass its own seeds): the verdict compares the answers' first tokens' distributions "
                      f"with the reference's (tokenizer: {FirstTokens.of(wl).name}), not the draws one by one")  # fmt: skip
    elif temperature:
        console.print(f"[yellow]note[/]: sampled at temperature {temperature:g}, one seed per prompt: the answers "
                      "compare only where the server's sampling honours the seed")  # fmt: skip
    if opts.server:
        summaries = sweep_grid(opts, grid_points, results, config, clock, go)
    elif opts.url is None:
        with embedded_server(results.path / "server.log") as target:
            summaries = go(target)
    else:
        summaries = go(opts.url)
    failed = [s for s in summaries if "failed" in s]
    summaries = [s for s in summaries if "counts" in s]
    out = Console(width=None if sys.stdout.isatty() else 200)
    out.print(summary_table(summaries))
    out.print(quality_table(summaries, temperature, draws))
    Console().print(auto_report(results.path))
    codes = server_failures(failed)
    for s in summaries:
        code, message = point_outcome(s, opts.max_error_rate)
        if message:
            console.print(message)
        q = s.get("quality")
        if q is not None and q["margins_unknown"] and "distribution" not in q:
            why = next(d["margin_unknown"] for d in q["diverged"] if d["margin"] is None)
            console.print(f"[yellow]note[/] {s['point_id']}: {q['margins_unknown']} margin(s) unknown ({why}): the "
                          "verdict rests on the identical share alone")  # fmt: skip
        if q is not None and q["verdict"] != "pass":
            console.print(f"[red]fail[/] {s['point_id']}: {q['reason']}")
            code = worst([code, ExitCode.FAILED])
        codes.append(code)
    out.print(f"results: {results.path}")
    return worst(codes)


def quality_table(summaries: list[dict[str, Any]], temperature: float = 0.0, draws: int = 1) -> Table:
    """One row per point compared: its answers against the reference's (:func:`pointsummary.quality_cells`)."""
    how = f"sampled at temperature {temperature:g} with one seed per prompt" if temperature else "greedy"
    how = f"sampled at temperature {temperature:g}, {draws} independent draws per prompt" if draws > 1 else how
    t = Table(title=f"answers against the reference (the same prompts alone, {how}); {pointsummary.QUALITY_NOTE}")
    for col in pointsummary.QUALITY_HEADER:
        t.add_column(col, justify="left" if col in ("point", "against", "verdict") else "right")
    for s in summaries:
        if (q := s.get("quality")) is not None:
            *cells, verdict = pointsummary.quality_cells(s["point_id"], q)
            t.add_row(*cells, f"[green]{verdict}[/]" if verdict == "pass" else f"[red]{verdict}[/]")
    return t
