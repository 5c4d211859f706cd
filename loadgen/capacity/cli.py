"""``bench capacity``: the highest load at which every SLO holds, with its interval (see search.py).

Writes ``<output-dir>/<run-id>/capacity.json`` (one entry per server configuration with ``--server``/``--grid``),
each probe's records under ``probes/``, and ``capacity.html`` (the report section). Exit codes: 0 found
(or the budget ran out: the bracket is stated), 2 bad input, 3 server unreachable, 4 the SLOs fail at the
lowest load, 5 they still hold at the highest load searched.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from backends.launcher import GridPoint, LaunchError, server_grid, sweep_servers
from loadgen.capacity.config import MODES, SearchConfig
from loadgen.capacity.live import LiveProber
from loadgen.capacity.result import CapacityResult
from loadgen.capacity.search import search
from loadgen.cli.exits import console, exits
from loadgen.cli.options import (
    WorkloadOpt,
    command,
    param,
)
from loadgen.cli.targets import (
    check_pooling_slos,
    embedded_server,
    load_workload,
    make_backend,
    read_api_key,
    resolve_tokenizer,
    server_counts,
)
from loadgen.defaults import CAPACITY_FILE
from loadgen.dispatch.fleet import Fleet
from loadgen.dispatch.signals import run_async
from loadgen.dispatch.sweep import run_seed
from loadgen.exitcodes import ExitCode, UsageError
from loadgen.metrics import definitions as metrics
from loadgen.metrics.slo import SloError, metric_of, parse_slos
from loadgen.records.results import new_run_id
from loadgen.records.writer import write_json
from loadgen.timing.clock import RunClock

EXIT = {"unreachable": ExitCode.SLO_UNREACHABLE, "not_saturated": ExitCode.NOT_SATURATED, "server_gone": ExitCode.SERVER_GONE}


def probe_table(res: CapacityResult, title: str) -> Table:
    unit = "conc." if res.mode == "concurrency" else "req/s"
    t = Table(title=title)
    for col in ("#", "phase", unit, "n", "err", *(c.key for c in res.probes[0].checks), "verdict", "s"):
        t.add_column(col, justify="right")
    for p in res.probes:
        cells = []
        for c in p.checks:
            if (m := metric_of(c.key)) is metrics.ERROR_RATE:
                cells.append(f"{c.misses}/{c.n}")
            else:
                cells.append(f"{_shown(m, c.value)} [{_shown(m, c.value_lo)}, {_shown(m, c.value_hi)}]")
        verdict = p.verdict + ("" if p.confident else "?")
        colour = "green" if p.verdict == "pass" else "red"
        load = f"{int(p.load)}" if p.phase == "pilot" or res.mode == "concurrency" else f"{p.load:.3g}"
        t.add_row(str(p.index), p.phase, load, str(p.requests), str(p.errors), *cells,
                  f"[{colour}]{verdict}[/] {p.reason}", f"{p.seconds:.1f}")  # fmt: skip
    return t


def _shown(m: metrics.Metric, v: float | None) -> str:
    return "∞" if v is None else f"{v * m.scale:,.1f}"


def _check_reachable(url: str) -> None:
    try:
        httpx.get(url.rstrip("/") + "/v1/models", timeout=10, trust_env=False)
    except httpx.HTTPError as exc:
        console.print(f"[red]error[/]: the server at {url} is unreachable ({type(exc).__name__}: {exc})")
        raise typer.Exit(ExitCode.SERVER_GONE) from None


SEARCH = ("resolution", "budget", "confidence", "max_probe_s", "max_samples", "max_concurrency", "max_rate")
OWN = {  # bench capacity's own options (the RunOptions ones it shares are spelled there)
    "slo": param("slo", Annotated[str, typer.Option(help="SLOs, e.g. ttft_p99=1s,tpot_p99=60ms,e2e_p90=10s,error_rate=1% "
                                                     "(bare numbers are ms).")], inspect.Parameter.empty),
    "mode": param("mode", Annotated[str, typer.Option(help="rate: open-loop req/s; concurrency: closed-loop sessions.")],
                  "rate"),
    "workload": param("workload", WorkloadOpt, "chat-short"),
    "arrival": param("arrival", Annotated[str, typer.Option(help="Rate mode arrivals: poisson or constant.")], "poisson"),
    "resolution": param("resolution", Annotated[float, typer.Option(help="Target half-width of the interval, share of "
                                                                         "the capacity.")], 0.05),
    "budget": param("budget", Annotated[float, typer.Option(help="Probe-seconds the whole search may take.")], 600.0),
    "confidence": param("confidence", Annotated[float, typer.Option(help="Confidence of each probe's verdict.")], 0.95),
    "max_probe_s": param("max_probe_s", Annotated[float | None, typer.Option(help="Longest probe, seconds [default: as long as the "
                         "independent requests the SLOs need take at the server's measured pace, up to a quarter of the "
                         "budget: docs/capacity.md].")], None),
    "max_samples": param("max_samples", Annotated[int, typer.Option(help="Most requests one probe measures.")], 2000),
    "max_concurrency": param("max_concurrency", Annotated[int, typer.Option(help="Highest concurrency searched.")], 256),
    "max_rate": param("max_rate", Annotated[float, typer.Option(help="Highest rate searched, req/s.")], 1000.0),
}  # fmt: skip
OPTIONS = ("slo", "mode", "url", "backend", "api", "model", "workload", "arrival", *SEARCH, "seed", "output_dir", "run_id",
           "api_key_env", "extra_body", "client", "timeout", "server", "grid", "server_timeout", "workers", "ray",
           "tokenizer")  # fmt: skip


def _capacity(slo: str, mode: str, workload: str, arrival: str, **options: Any) -> None:
    """Find the highest load (rate or concurrency) at which every SLO holds, with its interval."""
    o = SimpleNamespace(**options)
    try:
        slos = parse_slos(slo, percentiles=True)
        if mode not in MODES:
            raise UsageError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        if arrival not in ("poisson", "constant"):
            raise UsageError(f"--arrival must be poisson or constant, got {arrival!r}")
        if o.url is not None and not re.match(r"^https?://", o.url):
            raise UsageError(f"--url must start with http:// or https://, got {o.url!r}")
        if o.server and o.url:
            raise UsageError("--server starts the target itself; drop --url")
        if o.grid and not o.server:
            raise UsageError("--grid needs --server (the command template the grid fills in)")
        if o.max_samples < 30 or o.max_concurrency < 1 or o.max_rate <= 0:
            raise UsageError("--max-samples must be >= 30, --max-concurrency >= 1 and --max-rate > 0")
        try:
            fleet = Fleet(o.workers, o.ray)
            cfg = SearchConfig(mode=mode, resolution=o.resolution, budget_s=o.budget, confidence=o.confidence,
                               max_probe_s=o.max_probe_s, max_samples=o.max_samples, max_concurrency=o.max_concurrency,
                               max_rate=o.max_rate)  # fmt: skip
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        grid_points = server_grid(o.server, [a for g in o.grid or [] for a in g.split()]) if o.server else []
        api_key = read_api_key(o.api_key_env)
        tokenizer = resolve_tokenizer(o.tokenizer, o.url, o.model, api_key)
        wl = load_workload(workload, tokenizer.spec)
        check_pooling_slos([s.metric for s in slos], o.api, [wl])
    except SloError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    except (UsageError, ValueError, LaunchError) as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    run_id = o.run_id or f"capacity-{new_run_id()}"
    # fresh prompts for every run, as `bench run`: with one seed for all, a second run against the same server read
    # its prompts from the server's cache (llama-server: TTFT 17 ms at one session instead of 370, TPOT halved)
    seed = o.seed if o.seed is not None else run_seed(run_id)
    out = o.output_dir / run_id
    out.mkdir(parents=True, exist_ok=True)
    config = {"command": "capacity", "slo": slo, "mode": mode, "url": o.url, "backend": o.backend, "workload": workload,
              "tokenizer": tokenizer.spec, "arrival": arrival, "seed": seed, "server": o.server, "grid": o.grid,
              "search": cfg.__dict__, **fleet.describe()}  # fmt: skip
    entries: list[dict[str, Any]] = []
    stdout = Console(width=None if sys.stdout.isatty() else 200)

    def one(target: str, gp: GridPoint | None = None, previous: Any = None) -> list[dict[str, Any]]:
        _check_reachable(target)
        be = make_backend(o.backend, target, o.model, o.api, api_key, False, o.extra_body)
        for warning in server_counts(be, [wl], seed, tokenizer.unconfirmed):
            console.print(f"[yellow]warning[/]: {warning}")
        where = out / gp.label if gp else out
        prober = LiveProber(be, wl, slos, where, RunClock(), process=arrival, seed=seed, timeout=o.timeout,
                            client_kind=o.client, fleet=fleet)  # fmt: skip
        label = gp.label if gp else "server"
        console.print(f"[dim]{label}: searching the {mode} capacity under {', '.join(s.describe() for s in slos)}[/]")
        res = run_async(search(prober, slos, cfg))
        stdout.print(probe_table(res, f"probes: {label}"))
        for p in res.probes:
            for w in p.warnings:
                stdout.print(f"[yellow]warning[/] probe {p.index}: {w}")
        colour = "green" if res.status == "ok" else "yellow" if res.status in ("budget", "unresolved") else "red"
        stdout.print(f"[{colour}]{label}[/]: {res.message}")
        if res.goodput is not None:
            stdout.print(f"  goodput at capacity: {res.goodput:.2f} req/s; probe-seconds {res.probe_seconds:.0f}")
        entry = {"point_id": label, "labels": dict(gp.params) if gp else {}, **res.to_json()}
        entries.append(entry)
        _write(out, config, entries)
        if res.status == "interrupted":  # the finished probes are in capacity.json; no further configuration
            raise typer.Exit(ExitCode.TERMINATED if "SIGTERM" in res.message else ExitCode.INTERRUPTED)
        return [entry]

    with exits(interrupted=f"probes so far are in {out}"):
        if o.server:
            results = sweep_servers(o.server, grid_points, out, one, health_timeout_s=o.server_timeout)
            for r in results:
                if "failed" in r:
                    console.print(f"[red]failed[/] {r['point_id']}: {r['failed']['message']}")
                    entries.append(r)
            _write(out, config, entries)
        elif o.url is None:
            with embedded_server(out / "server.log") as target:
                one(target)
        else:
            one(o.url)
    from loadgen.report.capacity import write_report

    html = write_report(out)
    stdout.print(f"{CAPACITY_FILE}: {out / CAPACITY_FILE}\nreport: {html}")
    done = [e for e in entries if "status" in e]
    if len(done) < len(entries):
        raise typer.Exit(ExitCode.FAILED)
    codes = [EXIT[e["status"]] for e in done if e["status"] in EXIT]
    if codes:
        raise typer.Exit(codes[0])


capacity_command = command(_capacity, OPTIONS, own=OWN)


def _write(out: Path, config: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    doc = {"config": config, "configs": entries, **({"result": entries[0]} if len(entries) == 1 else {})}
    write_json(out / CAPACITY_FILE, doc)
