"""``bench run`` and ``bench sweep``: load points against one server (or a grid of started ones) into one
results directory, a summary table, a report, and an exit code that says whether every point passed.

Size: the two commands' option lists (typer needs each spelled out) and the one body they share."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from backends.launcher import GridPoint, RunInner, sweep_servers
from backends.profile import profile_of
from loadgen.cli.exits import console, guard
from loadgen.cli.live import LiveDisplay
from loadgen.cli.options import WorkloadOpt, check, command, param
from loadgen.cli.targets import (
    check_pooling_slos,
    detect_server,
    embedded_server,
    is_finite,
    load_workload,
    make_backend,
    read_api_key,
    reset_cache_path,
    resolve_tokenizer,
    server_counts,
)
from loadgen.defaults import RUN_FILE
from loadgen.dispatch.engine import PointOptions
from loadgen.dispatch.fleet import Fleet
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.dispatch.sweep import PointPlan, loads_from, plan_points, run_seed, run_sweep
from loadgen.exitcodes import ExitCode, UsageError, worst
from loadgen.metrics import definitions as metrics
from loadgen.metrics import pointsummary
from loadgen.records.results import ResultsDir, new_run_id
from loadgen.records.writer import write_json
from loadgen.report.cli import auto_report
from loadgen.runoptions import RunOptions, parse_list, parse_slo
from loadgen.sidecars import telemetry
from loadgen.sidecars.poller import ServerStatePoller
from loadgen.timing.clock import RunClock, Sidecar

# The RunOptions fields both commands take as they are, in --help order; concurrency, rate and workload are each
# command's own (one value for run, lists for sweep).
SHARED = ("url", "backend", "api", "model", "concurrency", "rate", "arrival", "burstiness", "workload", "num_requests",
          "duration", "warmup", "seed", "slo", "repeat", "output_dir", "run_id", "api_key_env", "continuous_usage",
          "extra_body", "client", "timeout", "stall_timeout", "speedup", "poll_hz", "telemetry_hz", "telemetry_url",
          "tokenizer", "dataset_field", "max_error_rate", "slo_from", "workers", "ray", "reset_cache")  # fmt: skip
SWEEP_ONLY = ("server", "grid", "server_timeout", "wait_for_server")


def _run(concurrency: int | None, rate: float | None, workload: str, **options: Any) -> None:
    """Run one load point (closed loop at --concurrency or open loop at --rate)."""
    if concurrency is not None and rate is not None:
        console.print("[red]error[/]: bench run takes --concurrency or --rate, not both (use bench sweep)")
        raise typer.Exit(ExitCode.USAGE)
    if concurrency is not None and concurrency < 1 or rate is not None and rate <= 0:
        console.print("[red]error[/]: --concurrency must be >= 1 and --rate > 0")
        raise typer.Exit(ExitCode.USAGE)
    guard(execute, opts=RunOptions(command="run", workloads=[workload], concurrency=[concurrency] if concurrency else [],
                                   rate=[rate] if rate else [], default_num_requests=100, **options))  # fmt: skip


def _sweep(concurrency: str | None, rate: str | None, workload: str, grid: list[str] | None, **options: Any) -> None:
    """Run a list of load points (concurrencies and/or rates × workloads) into one results directory."""

    def body() -> ExitCode:
        conc = parse_list(concurrency, int, "--concurrency") if concurrency else []
        rates = parse_list(rate, float, "--rate") if rate else []
        if not conc and not rates and options["arrival"] != "trace":
            conc = [1, 4, 16]
        return execute(RunOptions(command="sweep", workloads=[w for w in workload.split(",") if w], concurrency=conc,
                                  rate=rates, grid=[axis for g in grid or [] for axis in g.split()],
                                  default_num_requests=32, **options))  # fmt: skip

    guard(body)


run = command(_run, SHARED, own={
    "concurrency": param("concurrency", Annotated[int | None, typer.Option(help="Closed-loop concurrency.")], None),
    "rate": param("rate", Annotated[float | None, typer.Option(help="Open-loop rate, req/s.")], None),
    "workload": param("workload", WorkloadOpt, "chat-short"),
})  # fmt: skip
sweep = command(_sweep, (*SHARED, *SWEEP_ONLY), defaults={"warmup": 2}, own={
    "concurrency": param("concurrency", Annotated[str | None, typer.Option(help="Closed-loop concurrencies, e.g. 1,4,16.")], None),
    "rate": param("rate", Annotated[str | None, typer.Option(help="Open-loop rates in req/s, e.g. 2,4,8.")], None),
    "workload": param("workload", Annotated[str, typer.Option(help="Workload name(s) or TOML path(s), comma-separated.")],
                      "chat-short"),
})  # fmt: skip


def execute(opts: RunOptions) -> ExitCode:
    """The body of run and sweep: check, plan, (start the server), run, report; returns the exit code (the
    worst of the points')."""
    grid_points = check(opts)
    api_key = read_api_key(opts.api_key_env)
    tokenizer = resolve_tokenizer(opts.tokenizer, opts.url, opts.model, api_key)  # type: ignore[arg-type]
    opts = replace(opts, tokenizer=tokenizer.spec)
    wls = [load_workload(w, opts.tokenizer, opts.dataset_field) for w in opts.workloads]
    check_pooling_slos(list(parse_slo(opts.slo) or {}), opts.api, wls)
    run_id = opts.run_id or new_run_id()
    opts = opts.resolve(wls, finite=all(map(is_finite, wls)))
    if opts.seed is None:
        opts = replace(opts, seed=run_seed(run_id))
    open_process = opts.arrival if opts.arrival not in (None, "closed") else "poisson"
    try:
        trace = opts.arrival == "trace"
        base = LoadSpec(process="trace" if trace else "closed", concurrency=None if trace else 1,
                        num_requests=opts.num_requests, duration=opts.duration, warmup=opts.warmup, seed=opts.seed,
                        burstiness=opts.burstiness, timeout=opts.timeout, stall_timeout=opts.stall_timeout,
                        speedup=opts.speedup)  # fmt: skip
        loads = [base] if trace else loads_from(base, opts.concurrency, opts.rate, open_process)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plans = plan_points(wls, loads, opts.repeat)
    results = ResultsDir(opts.output_dir / run_id)
    config = opts.config()
    clock = RunClock()
    display = LiveDisplay(console, clock)
    console.print(f"[dim]{telemetry.header_line(opts.telemetry_hz, opts.telemetry_url)}[/]")

    def go(target: str, gp: GridPoint | None = None, previous: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        det = detect_server(target, api_key)
        if opts.backend == "auto":
            name, how = det.backend, f"auto: {det.server}" if det.server else "auto: unknown server, plain OpenAI"
        else:
            name, how = opts.backend, f"forced; the server looks like {det.server}" if det.server else "forced"
        console.print(f"[dim]backend: {name} ({how}; {det.evidence})[/]")
        be = make_backend(name, target, opts.model, opts.api, api_key, opts.continuous_usage, opts.extra_body)
        for warning in server_counts(be, wls, opts.seed, tokenizer.unconfirmed):  # type: ignore[arg-type]
            console.print(f"[yellow]warning[/]: {warning}")
        reset_path = reset_cache_path(be) if opts.reset_cache else None
        todo = plans if gp is None else on_server(plans, gp)

        def pollers(plan: PointPlan) -> list[Sidecar]:
            polls = [ServerStatePoller(target, profile_of(be), opts.poll_hz)] if opts.poll_hz > 0 else []
            return [*polls, *telemetry.sidecars(target, opts.telemetry_hz, opts.telemetry_url)]

        where = grid_position(grid_points, gp)
        options = PointOptions(slo=config["slo"], slo_from=opts.slo_from, client_kind=opts.client,
                               fleet=Fleet(opts.workers, opts.ray))
        return run_async(run_sweep(be, todo, results, clock, config, pollers, options=options,
                                   live=display.points(todo, where), previous=previous or [],
                                   wait_for_server=0 if gp else opts.wait_for_server, reset_path=reset_path,
                                   run_extra={"backend_detection": {"requested": opts.backend, **det.describe()}}))  # fmt: skip

    log = results.path / "server.log" if opts.url is None and not opts.server else None  # the embedded server's
    try:
        if opts.server:
            summaries = sweep_grid(opts, grid_points, results, config, clock, go)
        elif opts.url is None:
            with embedded_server(log) as target:  # type: ignore[arg-type]
                summaries = go(target)
        else:
            summaries = go(opts.url)
    except KeyboardInterrupt:  # outside the load loop (e.g. while a server starts): nothing to summarise
        console.print(f"[yellow]interrupted[/]: finished requests are in {results.path}/points/*/requests.jsonl")
        return ExitCode.INTERRUPTED
    failed = [s for s in summaries if "failed" in s]
    summaries = [s for s in summaries if "counts" in s]
    _report(summaries, results)
    Console().print(auto_report(results.path))
    codes = server_failures(failed)
    for s in summaries:
        code, message = point_outcome(s, opts.max_error_rate, log)
        if message:
            console.print(message)
        codes.append(code)
    return worst(codes)


def on_server(plans: list[PointPlan], gp: GridPoint) -> list[PointPlan]:
    """``plans`` on one server configuration: point ids under its label, its parameters among the labels."""
    return [replace(p, point_id=f"{gp.label}/{p.point_id}", labels={**p.labels, **gp.params}) for p in plans]


def grid_position(grid_points: list[GridPoint], gp: GridPoint | None) -> tuple[int, int, str] | None:
    """Where ``gp`` is in the grid, for the live display (None without a grid)."""
    return (grid_points.index(gp) + 1, len(grid_points), gp.label) if gp is not None else None


def sweep_grid(opts: RunOptions, grid_points: list[GridPoint], results: ResultsDir, config: dict[str, Any],
               clock: RunClock, go: RunInner) -> list[dict[str, Any]]:  # fmt: skip
    """Start each configuration of ``--server``/``--grid`` in turn and run ``go`` against it; run.json and
    summary.json list every point, with the launch info and the launch failures."""
    console.print(f"[dim]server sweep: {len(grid_points)} server configuration(s)[/]")
    summaries = sweep_servers(opts.server or "", grid_points, results.path, go, health_timeout_s=opts.server_timeout,
                              stop_on_abort=opts.wait_for_server == 0)  # fmt: skip
    run_path = results.path / RUN_FILE  # written by run_sweep unless every server failed
    run_meta = json.loads(run_path.read_text()) if run_path.exists() else results.write_run(config, clock.t0_unix, [])
    run_meta["points"] = [s["point_id"] for s in summaries]
    write_json(run_path, run_meta)
    results.write_summary(run_meta, summaries)  # adds the launch info and launch failures
    return summaries


def server_failures(failed: list[dict[str, Any]]) -> list[ExitCode]:
    """Say why each failed server configuration failed; its exit codes."""
    for s in failed:
        console.print(f"[red]failed[/] {s['point_id']}: {s['failed']['message']}")
    return [ExitCode.SERVER_GONE for _ in failed]


def point_outcome(s: dict[str, Any], max_error_rate: float, log: Path | None = None) -> tuple[ExitCode, str | None]:
    """A point's exit code and the line that explains it (None when it passed)."""
    pid = s["point_id"]
    if lost := (s.get("workers") or {}).get("lost"):  # first: the figures miss what dead workers would have sent
        return ExitCode.FAILED, f"[red]worker lost[/] {pid}: " + "; ".join(w["reason"] for w in lost)
    if s.get("status") == "interrupted":
        i = s["interrupted"]
        code = ExitCode.INTERRUPTED if i["signal"] == "SIGINT" else ExitCode.TERMINATED
        return code, (f"[yellow]interrupted[/] {pid}: {i['signal']} after {i['t_rel']:.1f} s; {i['finished']} "
                      f"requests finished, {i['cancelled']} cancelled (partial summary and report written)")  # fmt: skip
    if s.get("status") == "aborted":
        log_path = (s.get("server_launch") or {}).get("log") or log
        where = f"; server log: {log_path}" if log_path else ""
        return ExitCode.SERVER_GONE, (f"[red]server gone[/] {pid}: {s['aborted']['reason']}, "
                                      f"{s['aborted']['t_rel']:.1f} s into the point{where}")  # fmt: skip
    kinds = sorted(s["errors"]["by_kind"].items(), key=lambda kv: -kv[1])
    top = ", ".join(f"{k}: {n}" for k, n in kinds[:3])
    if s["counts"]["ok"] == 0:
        return ExitCode.FAILED, f"[red]failed[/] {pid}: no request succeeded ({top or 'no requests'})"
    if s["errors"]["rate"] > max_error_rate:
        return ExitCode.FAILED, (f"[red]failed[/] {pid}: error rate {s['errors']['rate']:.1%} is above "
                                 f"--max-error-rate {max_error_rate:.1%} (top errors: {top})")  # fmt: skip
    return ExitCode.OK, None


def _fmt(v: float | None, scale: float = 1e3, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


# The table's metric columns: a registry metric, its stat (a distribution's) and the digits shown.
COLUMNS: tuple[tuple[metrics.Metric, str | None, int], ...] = (
    (metrics.REQ_S, None, 2), (metrics.OUTPUT_TOK_S, None, 0),
    *((m, stat, 1) for m in (metrics.TTFT, metrics.TPOT, metrics.ITL, metrics.E2E) for stat in ("p50", "p99")),
    (metrics.SCHEDULE_LAG, "p99", 2), (metrics.CACHE_HIT_RATE, None, 0),
)  # fmt: skip
# ... and a pooling run's (embeddings, rerank: no tokens generated, so no TTFT, TPOT or ITL)
POOLING_COLUMNS: tuple[tuple[metrics.Metric, str | None, int], ...] = (
    (metrics.REQ_S, None, 2), (metrics.INPUTS_S, None, 1), (metrics.TOTAL_TOK_S, None, 0),
    *((metrics.E2E, stat, 1) for stat in ("p50", "p90", "p99")), (metrics.SCHEDULE_LAG, "p99", 2),
)  # fmt: skip


def _cell(s: dict[str, Any], m: metrics.Metric, stat: str | None, digits: int) -> str:
    """A metric's cell: scaled to its shown unit; a throughput over the whole run (no steady state) marked ``*``."""
    v = m.of(s, stat)
    if m is metrics.CACHE_HIT_RATE:  # no prefix_cache: "-"; one without a hit rate: "-%"
        return _fmt(v, m.scale, digits) + m.shown_unit if s.get("prefix_cache") else "-"
    mark = "*" if m.path[0] == "throughput" and not s["throughput"]["steady"].get("valid", True) else ""
    return _fmt(v, m.scale, digits) + mark


def summary_table(summaries: list[dict[str, Any]]) -> Table:
    t = Table(title=f"results (latencies in {metrics.TTFT.shown_unit}; throughput over the steady-state window, * = "
                    "whole run: no steady state; ! = the client may be limiting the point: its warning follows; "
                    f"{metrics.CACHE_HIT_RATE.label} = prompt tokens the server's prefix cache served)")  # fmt: skip
    columns = POOLING_COLUMNS if summaries and all(map(pointsummary.pooling, summaries)) else COLUMNS
    for col in ("point", "ok", "err", "inc", *(f"{m.label} {stat}" if stat else m.label for m, stat, _ in columns)):
        t.add_column(col, justify="left" if col == "point" else "right")
    for s in summaries:
        n = s["counts"]
        t.add_row(s["point_id"] + (" !" if s["client"]["limited"] else ""), str(n["ok"]), str(n["errors"]),
                  str(n.get("incomplete", 0)), *(_cell(s, m, stat, digits) for m, stat, digits in columns))  # fmt: skip
    return t


def _wide_median(st: dict[str, Any]) -> str | None:
    """Why a rerun's TTFT p50 may differ by more than :data:`metrics.RERUN_SPREAD`: its 95 % interval is wider
    (``st``: the point's TTFT stats)."""
    p50, lo, hi = st["p50"], st.get("p50_lo"), st.get("p50_hi")
    if not p50 or lo is None or hi is None or (1 - metrics.RERUN_SPREAD) * p50 <= lo <= hi <= (1 + metrics.RERUN_SPREAD) * p50:
        return None
    m, k = metrics.TTFT, metrics.TTFT.scale
    return (f"{m.label} p50 {p50 * k:,.1f} {m.shown_unit} rests on {st['count']} requests: its 95 % interval is "
            f"{lo * k:,.1f}-{hi * k:,.1f} {m.shown_unit}, so a rerun may differ by more than {metrics.RERUN_SPREAD:.0%}; "
            "more requests (--num-requests) narrow it")  # fmt: skip


def notes(s: dict[str, Any]) -> list[str]:
    """What a reader of the table must know about a point: no steady state, unsteady load, cancelled requests."""
    thr, n = s["throughput"]["steady"], s["counts"]
    out = [f"no steady state: {thr['reason']}"] if thr.get("reason") else []
    out += [w["note"]] if (w := s.get("workers") or {}).get("note") else []
    out += [thr["note"]] if thr.get("note") else []
    out += [pc["warning"]] if (pc := s.get("prefix_cache") or {}).get("warning") else []
    out += [pl["warning"]] if (pl := s.get("prompt_lengths") or {}).get("warning") else []
    out += [r] if (r := pointsummary.reasoning_note(s)) else []
    if (wide := _wide_median(s["latency"]["ttft"])) is not None:
        out.append(wide)
    if (reset := s.get("cache_reset")) and not reset["ok"]:
        out.append(f"the prefix cache was not reset before this point (POST {reset['path']}: "
                   f"{reset.get('status') or reset.get('error')})")  # fmt: skip
    if n.get("incomplete"):
        out.append(f"{n['incomplete']} request(s) cancelled by the harness (run end or interrupt): counted as "
                   "incomplete, not as errors; latency percentiles leave them out")  # fmt: skip
    return out


def _report(summaries: list[dict[str, Any]], results: ResultsDir) -> None:
    out = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets the whole table
    out.print(summary_table(summaries))
    for s in summaries:
        for w in s["client"]["warnings"]:
            out.print(f"[yellow]warning[/] {s['point_id']}: the client may be limiting this run: {w}")
        for line in notes(s):
            out.print(f"[yellow]note[/] {s['point_id']}: {line}")
        if s["errors"]["by_kind"]:
            kinds = ", ".join(f"{k}: {n}" for k, n in s["errors"]["by_kind"].items())
            out.print(f"[red]errors[/] {s['point_id']}: {kinds}")
    out.print(f"results: {results.path}")


