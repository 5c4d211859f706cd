"""The ``bench`` command: ``bench run``, ``bench sweep``, ``bench calibrate`` (+ other areas' commands).

Other areas add their subcommands at the bottom of this file, one line each::

    app.command("report")(report_command)        # a function with typer-annotated parameters
    app.add_typer(server_app, name="server")     # a whole typer sub-app
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from backends.base import Backend
from backends.detect import Detection, ServerUnreachable, detect
from backends.launcher import GridPoint, LaunchError, free_port, server_grid, sweep_servers
from backends.profile import profile_of
from backends.registry import available, get_backend
from contracts import ARRIVAL_PROCESSES
from loadgen import metrics, telemetry
from loadgen.client import CLIENT_KINDS
from loadgen.clock import RunClock, Sidecar
from loadgen.engine import LoadSpec, run_async
from loadgen.exitcodes import ExitCode, worst
from loadgen.live import LiveDisplay
from loadgen.poller import ServerStatePoller
from loadgen.results import ResultsDir, new_run_id
from loadgen.sweep import PointPlan, loads_from, plan_points, run_sweep
from workloads.base import Workload

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="servelab: load-test and benchmark LLM inference servers.",
)  # fmt: skip
console = Console(stderr=True)


class UsageError(Exception):
    """Bad input: printed as a one-line error, exit status 2."""


class ServerGone(Exception):
    """The target cannot be reached: printed as a one-line error, exit status 3."""


def parse_list(text: str, kind: type[float] | type[int], what: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be a comma-separated list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise UsageError(f"{what} values must be > 0, got {text!r}")
    return values


_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def parse_slo(text: str | None) -> dict[str, float] | None:
    """``ttft=500ms,tpot=50ms,e2e=10s`` → seconds; a bare number is milliseconds (as vLLM's --goodput)."""
    if not text:
        return None
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|us)?\s*", value)
        if key not in metrics.SLO_KEYS or not m:
            raise UsageError(f"--slo wants ttft=..,tpot=..,e2e=.. (e.g. ttft=500ms,tpot=50ms), got {part!r}")
        try:
            slo[key] = float(m.group(1)) * _UNITS[m.group(2) or "ms"]
        except ValueError:
            raise UsageError(f"--slo: {value!r} is not a number") from None
    return slo


def load_workload(name: str, tokenizer: str | None = None) -> Workload:
    try:
        from workloads import load_workload as _load
    except ImportError:
        raise UsageError("workloads.load_workload is not available in this install") from None
    try:
        return _load(name, tokenizer=tokenizer)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise UsageError(f"workload {name!r}: {exc}") from None


def check_tokenizer(path: str | None) -> None:
    """``--tokenizer``: an existing tokenizer.json (or .gguf) file, checked before anything starts."""
    if path is None:
        return
    if not Path(path).is_file():
        raise UsageError(f"--tokenizer: {path!r} not found (give the path of the model's tokenizer.json)")
    from workloads.text import load_tokenizer

    try:
        load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--tokenizer: {exc}") from None


def is_finite(workload: Workload) -> bool:
    """A trace ends by itself; synthetic workloads are infinite."""
    from workloads.traces import TraceWorkload

    return isinstance(workload, TraceWorkload)


def read_api_key(api_key_env: str | None) -> str | None:
    """The API key from the environment variable named by --api-key-env (the key itself is never stored)."""
    if not api_key_env:
        return None
    api_key = os.environ.get(api_key_env)
    if not api_key:
        raise UsageError(f"--api-key-env {api_key_env}: that environment variable is not set")
    return api_key


def detect_server(url: str, api_key: str | None) -> Detection:
    """What the server at ``url`` is (backends.detect); an unreachable one is :class:`ServerGone`."""
    try:
        return detect(url, api_key)
    except ServerUnreachable as exc:
        raise ServerGone(f"{exc}\n  is the server running? (bench run without --url starts the bundled one)") from None


def make_backend(
    name: str, url: str, model: str | None, api: str | None, api_key: str | None, continuous_usage: bool,
    extra_body: str | None,
) -> Backend:  # fmt: skip
    """The backend ``name`` for ``url``; ``auto`` asks the server (:func:`detect_server`)."""
    if name == "auto":
        name = detect_server(url, api_key).backend
    try:
        extra = json.loads(extra_body) if extra_body else {}
    except json.JSONDecodeError as exc:
        raise UsageError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise UsageError("--extra-body must be a JSON object")
    try:
        cls = get_backend(name)
    except KeyError:
        raise UsageError(f"unknown backend {name!r}; available: auto, {', '.join(available())}") from None
    opts: dict[str, Any] = {"api": api, "extra_body": extra}
    if continuous_usage:
        opts["continuous_usage"] = True
    try:
        return cls(url, model=model or _first_model(url, api_key), api_key=api_key, **opts)  # type: ignore[call-arg]
    except (TypeError, ValueError) as exc:
        raise UsageError(f"backend {name!r}: {exc}") from None


def _first_model(url: str, api_key: str | None) -> str | None:
    """The server's first model from GET /v1/models; None when it has no such endpoint."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10, trust_env=False)
        data = r.json().get("data") or []
        return str(data[0]["id"]) if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


@contextmanager
def embedded_server(log_path: Path, timeout: float = 600.0) -> Iterator[str]:
    """Start the bundled reference server on a free loopback port; yields its URL; stops it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        # its own session: a terminal's Ctrl-C is bench's to handle (it stops the server after the summary)
        proc = subprocess.Popen([sys.executable, "-m", "reference_server", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        try:
            console.print(f"[dim]starting the reference server on {url} (log: {log_path})[/]")
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise UsageError(f"the reference server exited with status {proc.returncode}; see {log_path}")
                try:
                    if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise UsageError(f"the reference server did not become healthy in {timeout:.0f} s; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _fmt(v: float | None, scale: float = 1e3, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def summary_table(summaries: list[dict[str, Any]]) -> Table:
    t = Table(title="results (latencies in ms; throughput over the steady-state window, * = whole run: no steady state)")
    for col in ("point", "ok", "err", "inc", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "ITL p50", "ITL p99", "E2E p50", "E2E p99", "lag p99"):  # fmt: skip
        t.add_column(col, justify="left" if col == "point" else "right")
    for s in summaries:
        lat, thr, n = s["latency"], s["throughput"]["steady"], s["counts"]
        mark = "" if thr.get("valid", True) else "*"
        t.add_row(
            s["point_id"], str(n["ok"]), str(n["errors"]), str(n.get("incomplete", 0)),
            _fmt(thr["req_per_s"], 1, 2) + mark, _fmt(thr["output_tok_per_s"], 1, 0) + mark,
            _fmt(lat["ttft"]["p50"]), _fmt(lat["ttft"]["p99"]), _fmt(lat["tpot"]["p50"]), _fmt(lat["tpot"]["p99"]),
            _fmt(lat["itl"]["p50"]), _fmt(lat["itl"]["p99"]), _fmt(lat["e2e"]["p50"]), _fmt(lat["e2e"]["p99"]),
            _fmt(s["client"]["schedule_lag"]["p99"], 1e3, 2),
        )  # fmt: skip
    return t


def notes(s: dict[str, Any]) -> list[str]:
    """What a reader of the table must know about a point: no steady state, unsteady load, cancelled requests."""
    thr, n = s["throughput"]["steady"], s["counts"]
    out = [f"no steady state: {thr['reason']}"] if thr.get("reason") else []
    out += [thr["note"]] if thr.get("note") else []
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


# Shared options of `bench run` and `bench sweep`.
Url = Annotated[str | None, typer.Option(help="Target base URL (default: start the bundled reference server).")]
BackendOpt = Annotated[str, typer.Option("--backend", help="Server dialect: auto (ask the server: llama.cpp, vLLM, "
                                          "TGI, SGLang, reference; else plain OpenAI) or one of backends.registry.")]
MaxErrorRate = Annotated[float, typer.Option(help="Exit 1 when a point's error rate is above this (0..1).")]
WaitForServer = Annotated[float, typer.Option(help="When the server goes away mid-point, wait up to this many "
                                              "seconds for it and go on with the next point (0: stop).")]
ApiOpt = Annotated[str | None, typer.Option(help="completions or chat (default: the workload's).")]
Model = Annotated[str | None, typer.Option(help="Model name sent to the server (default: GET /v1/models).")]
Arrival = Annotated[str | None, typer.Option(help=f"Arrival process: {', '.join(ARRIVAL_PROCESSES)} (default: closed with"
                                             " --concurrency, poisson with --rate).")]  # fmt: skip
Burstiness = Annotated[float, typer.Option(help="Gamma shape: 1 = Poisson, < 1 burstier.")]
WorkloadOpt = Annotated[str, typer.Option(help="Workload name or TOML path.")]
NumRequests = Annotated[int | None, typer.Option(
    help="Measured requests per point (default: run 100, sweep 32; a replayed trace runs to its end).")]
Duration = Annotated[float | None, typer.Option(help="Seconds of dispatch per point.")]
Warmup = Annotated[int, typer.Option(help="Warm-up sessions per point (excluded from metrics).")]
Seed = Annotated[int, typer.Option(help="Seed for arrivals and workload sampling.")]
Slo = Annotated[str | None, typer.Option(help="Goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=10s (bare = ms).")]
SloFrom = Annotated[str, typer.Option(help="Judge the SLOs' TTFT and E2E from the request's actual send "
                    "(sent) or its intended send time (intended: a client running late cannot flatter goodput).")]
Repeat = Annotated[int, typer.Option(help="Repeat each point N times as separate trials.")]
OutputDir = Annotated[Path, typer.Option(help="Results root; the run goes to <output-dir>/<run-id>/.")]
RunId = Annotated[str | None, typer.Option(help="Run id (default: a timestamp).")]
ApiKeyEnv = Annotated[str | None, typer.Option(help="Name of the env var holding the API key (never stored).")]
ContinuousUsage = Annotated[bool, typer.Option(help="Ask for per-chunk usage (vLLM continuous_usage_stats).")]
ExtraBody = Annotated[str | None, typer.Option(help="JSON object merged into every request body.")]
Client = Annotated[str, typer.Option(help="HTTP transport: aiohttp (httpx-aiohttp) or httpx.")]
Timeout = Annotated[float, typer.Option(help="Per-request limit, seconds.")]
StallTimeout = Annotated[float, typer.Option(help="Longest silence within a response, seconds.")]
Speedup = Annotated[float, typer.Option(help="Trace replay speed-up (send at at/speedup).")]
PollHz = Annotated[float, typer.Option(help="Server-state poller rate (/metrics, /slots), Hz; 0 = off.")]
TelemetryHz = Annotated[float, typer.Option(help="Telemetry rate (NVML GPUs, host, server process), Hz; 0 = off.")]
TokenizerOpt = Annotated[str | None, typer.Option(
    help="tokenizer.json of the target model for exact prompt lengths (default: the bundled model's).")]
TelemetryUrl = Annotated[str | None, typer.Option(help="Prometheus URL of a DCGM/node exporter on the server's host.")]


def _go(
    *, url: str | None, backend: str, api: str | None, model: str | None, workloads: list[str],
    concurrency: list[int], rate: list[float], arrival: str | None, burstiness: float,
    num_requests: int | None, duration: float | None, warmup: int, seed: int, slo: str | None, repeat: int,
    output_dir: Path, run_id: str | None, api_key_env: str | None, continuous_usage: bool,
    extra_body: str | None, client: str, timeout: float, stall_timeout: float, speedup: float,
    command: str, default_num_requests: int, poll_hz: float = 10.0, server: str | None = None,
    grid: list[str] | None = None, server_timeout: float = 300.0, telemetry_hz: float = 10.0,
    telemetry_url: str | None = None, tokenizer: str | None = None, max_error_rate: float = 0.05,
    wait_for_server: float = 0.0, slo_from: str = "sent",
) -> ExitCode:  # fmt: skip
    """The common body of run and sweep: validate, plan, (start the server), run, report; returns the
    exit code (the worst of the points')."""
    if slo_from not in metrics.SLO_FROM:
        raise UsageError(f"--slo-from must be one of {', '.join(metrics.SLO_FROM)}, got {slo_from!r}")
    if api not in (None, "completions", "chat"):
        raise UsageError(f"--api must be completions or chat, got {api!r}")
    if client not in CLIENT_KINDS:
        raise UsageError(f"--client must be aiohttp or httpx, got {client!r}")
    if arrival is not None and arrival not in ARRIVAL_PROCESSES:
        raise UsageError(f"--arrival must be one of {', '.join(ARRIVAL_PROCESSES)}, got {arrival!r}")
    if repeat < 1 or warmup < 0:
        raise UsageError("--repeat must be >= 1 and --warmup >= 0")
    if not 0 <= max_error_rate <= 1 or wait_for_server < 0:
        raise UsageError("--max-error-rate must be within 0..1 and --wait-for-server >= 0")
    if url is not None and not re.match(r"^https?://", url):
        raise UsageError(f"--url must start with http:// or https://, got {url!r}")
    if poll_hz < 0:
        raise UsageError("--poll-hz must be >= 0 (0 turns the server-state poller off)")
    try:
        telemetry.check_options(telemetry_hz, telemetry_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if grid and not server:
        raise UsageError("--grid needs --server (the command template the grid fills in)")
    if server and url:
        raise UsageError("--server starts the target itself; drop --url")
    try:
        grid_points = server_grid(server, grid or []) if server else []
    except (ValueError, LaunchError) as exc:
        raise UsageError(f"--server/--grid: {exc}") from None
    slo_s = parse_slo(slo)
    api_key = read_api_key(api_key_env)
    check_tokenizer(tokenizer)
    wls = [load_workload(w, tokenizer) for w in workloads]
    if not concurrency and not rate:  # the workload file's arrival settings, else concurrency 1
        spec = wls[0].arrival
        arrival = arrival or spec.process
        if spec.rate:
            rate = [spec.rate]
        elif arrival != "trace":
            concurrency = [spec.concurrency or 1]
        burstiness = spec.burstiness or burstiness
    if num_requests is None and duration is None and not (arrival == "trace" and all(map(is_finite, wls))):
        num_requests = default_num_requests  # a replayed trace runs to its end; synthetic load needs a cap
    open_process = arrival if arrival not in (None, "closed") else "poisson"
    if arrival == "closed" and rate:
        raise UsageError("--arrival closed takes --concurrency, not --rate")
    if arrival in ("constant", "poisson", "gamma") and concurrency and not rate:
        raise UsageError(f"--arrival {arrival} needs --rate")
    try:
        trace = arrival == "trace"
        base = LoadSpec(process="trace" if trace else "closed", concurrency=None if trace else 1,
                        num_requests=num_requests, duration=duration, warmup=warmup, seed=seed,
                        burstiness=burstiness, timeout=timeout, stall_timeout=stall_timeout,
                        speedup=speedup)  # fmt: skip
        loads = [base] if trace else loads_from(base, concurrency, rate, open_process)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plans = plan_points(wls, loads, repeat)
    results = ResultsDir(output_dir / (run_id or new_run_id()))
    config = {
        "command": command, "url": url or "embedded reference server", "backend": backend, "api": api,
        "model": model, "workloads": workloads, "concurrency": concurrency, "rate": rate, "arrival": arrival,
        "burstiness": burstiness, "num_requests": num_requests, "duration": duration, "warmup": warmup,
        "seed": seed, "slo": slo_s, "repeat": repeat, "api_key_env": api_key_env,
        "continuous_usage": continuous_usage, "extra_body": extra_body, "client": client, "timeout": timeout,
        "stall_timeout": stall_timeout, "speedup": speedup, "poll_hz": poll_hz, "server": server, "grid": grid,
        "tokenizer": tokenizer, "max_error_rate": max_error_rate, "wait_for_server": wait_for_server,
        "slo_from": slo_from,
    }  # fmt: skip
    clock = RunClock()
    display = LiveDisplay(console, clock)
    console.print(f"[dim]{telemetry.header_line(telemetry_hz, telemetry_url)}[/]")

    def go(target: str, gp: GridPoint | None = None, previous: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        det = detect_server(target, api_key)
        if backend == "auto":
            name, how = det.backend, f"auto: {det.server}" if det.server else "auto: unknown server, plain OpenAI"
        else:
            name, how = backend, f"forced; the server looks like {det.server}" if det.server else "forced"
        console.print(f"[dim]backend: {name} ({how}; {det.evidence})[/]")
        be = make_backend(name, target, model, api, api_key, continuous_usage, extra_body)
        todo = plans if gp is None else [
            replace(p, point_id=f"{gp.label}/{p.point_id}", labels={**p.labels, **gp.params}) for p in plans
        ]  # fmt: skip

        def pollers(plan: PointPlan) -> list[Sidecar]:
            polls = [ServerStatePoller(target, profile_of(be), poll_hz)] if poll_hz > 0 else []
            return [*polls, *telemetry.sidecars(target, telemetry_hz, telemetry_url)]

        where = (grid_points.index(gp) + 1, len(grid_points), gp.label) if gp is not None else None
        return run_async(run_sweep(be, todo, results, clock, config, pollers, slo=slo_s, slo_from=slo_from,
                                   client_kind=client, live=display.points(todo, where), previous=previous or [],
                                   wait_for_server=0 if gp else wait_for_server,
                                   run_extra={"backend_detection": {"requested": backend, **det.describe()}}))  # fmt: skip

    log = results.path / "server.log" if url is None and not server else None  # the embedded server's
    try:
        if server:
            console.print(f"[dim]server sweep: {len(grid_points)} server configuration(s)[/]")
            summaries = sweep_servers(server, grid_points, results.path, go, health_timeout_s=server_timeout,
                                      stop_on_abort=wait_for_server == 0)  # fmt: skip
            run_path = results.path / "run.json"  # written by run_sweep unless every server failed
            run_meta = json.loads(run_path.read_text()) if run_path.exists() else results.write_run(config, clock.t0_unix, [])
            run_meta["points"] = [s["point_id"] for s in summaries]
            run_path.write_text(json.dumps(run_meta, indent=1, default=str))
            results.write_summary(run_meta, summaries)  # adds the launch info and launch failures
        elif url is None:
            with embedded_server(log) as target:  # type: ignore[arg-type]
                summaries = go(target)
        else:
            summaries = go(url)
    except KeyboardInterrupt:  # outside the load loop (e.g. while a server starts): nothing to summarise
        console.print(f"[yellow]interrupted[/]: finished requests are in {results.path}/points/*/requests.jsonl")
        return ExitCode.INTERRUPTED
    failed = [s for s in summaries if "failed" in s]
    summaries = [s for s in summaries if "counts" in s]
    _report(summaries, results)
    Console().print(auto_report(results.path))
    codes = []
    for s in failed:
        console.print(f"[red]failed[/] {s['point_id']}: {s['failed']['message']}")
        codes.append(ExitCode.SERVER_GONE)
    for s in summaries:
        code, message = point_outcome(s, max_error_rate, log)
        if message:
            console.print(message)
        codes.append(code)
    return worst(codes)


def point_outcome(s: dict[str, Any], max_error_rate: float, log: Path | None = None) -> tuple[ExitCode, str | None]:
    """A point's exit code and the line that explains it (None when it passed)."""
    pid = s["point_id"]
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


def _guard(fn: Any, **kwargs: Any) -> None:
    """Run a command body; its exit code (or a usage error's 2, an unreachable server's 3) ends bench."""
    try:
        code = fn(**kwargs)
    except UsageError as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    except ServerGone as exc:
        console.print(f"[red]error[/]: {exc}")
        raise typer.Exit(ExitCode.SERVER_GONE) from None
    if code:
        raise typer.Exit(int(code))


@app.command()
def run(
    url: Url = None, backend: BackendOpt = "auto", api: ApiOpt = None, model: Model = None,
    concurrency: Annotated[int | None, typer.Option(help="Closed-loop concurrency.")] = None,
    rate: Annotated[float | None, typer.Option(help="Open-loop rate, req/s.")] = None,
    arrival: Arrival = None, burstiness: Burstiness = 1.0, workload: WorkloadOpt = "chat-short",
    num_requests: NumRequests = None, duration: Duration = None, warmup: Warmup = 0, seed: Seed = 0,
    slo: Slo = None, repeat: Repeat = 1, output_dir: OutputDir = Path("results"), run_id: RunId = None,
    api_key_env: ApiKeyEnv = None, continuous_usage: ContinuousUsage = False, extra_body: ExtraBody = None,
    client: Client = "aiohttp", timeout: Timeout = 600.0, stall_timeout: StallTimeout = 60.0,
    speedup: Speedup = 1.0, poll_hz: PollHz = 10.0, telemetry_hz: TelemetryHz = 10.0,
    telemetry_url: TelemetryUrl = None, tokenizer: TokenizerOpt = None, max_error_rate: MaxErrorRate = 0.05,
    slo_from: SloFrom = "sent",
) -> None:  # fmt: skip
    """Run one load point (closed loop at --concurrency or open loop at --rate)."""
    if concurrency is not None and rate is not None:
        console.print("[red]error[/]: bench run takes --concurrency or --rate, not both (use bench sweep)")
        raise typer.Exit(ExitCode.USAGE)
    if concurrency is not None and concurrency < 1 or rate is not None and rate <= 0:
        console.print("[red]error[/]: --concurrency must be >= 1 and --rate > 0")
        raise typer.Exit(ExitCode.USAGE)
    _guard(
        _go, url=url, backend=backend, api=api, model=model, workloads=[workload],
        concurrency=[concurrency] if concurrency else [], rate=[rate] if rate else [], arrival=arrival,
        burstiness=burstiness, num_requests=num_requests, duration=duration, warmup=warmup, seed=seed, slo=slo,
        repeat=repeat, output_dir=output_dir, run_id=run_id, api_key_env=api_key_env,
        continuous_usage=continuous_usage, extra_body=extra_body, client=client, timeout=timeout,
        stall_timeout=stall_timeout, speedup=speedup, command="run", default_num_requests=100, poll_hz=poll_hz,
        telemetry_hz=telemetry_hz, telemetry_url=telemetry_url, tokenizer=tokenizer, max_error_rate=max_error_rate,
        slo_from=slo_from,
    )  # fmt: skip


@app.command()
def sweep(
    url: Url = None, backend: BackendOpt = "auto", api: ApiOpt = None, model: Model = None,
    concurrency: Annotated[str | None, typer.Option(help="Closed-loop concurrencies, e.g. 1,4,16.")] = None,
    rate: Annotated[str | None, typer.Option(help="Open-loop rates in req/s, e.g. 2,4,8.")] = None,
    arrival: Arrival = None, burstiness: Burstiness = 1.0,
    workload: Annotated[str, typer.Option(help="Workload name(s) or TOML path(s), comma-separated.")] = "chat-short",
    num_requests: NumRequests = None, duration: Duration = None, warmup: Warmup = 2, seed: Seed = 0,
    slo: Slo = None, repeat: Repeat = 1, output_dir: OutputDir = Path("results"), run_id: RunId = None,
    api_key_env: ApiKeyEnv = None, continuous_usage: ContinuousUsage = False, extra_body: ExtraBody = None,
    client: Client = "aiohttp", timeout: Timeout = 600.0, stall_timeout: StallTimeout = 60.0,
    speedup: Speedup = 1.0, poll_hz: PollHz = 10.0, telemetry_hz: TelemetryHz = 10.0,
    telemetry_url: TelemetryUrl = None,
    server: Annotated[str | None, typer.Option(help="Start this server command for each grid point, e.g. "
                      "'llama-server -m {model} -np {np} --port {port}' ({model}: bundled GGUF, {port}: free port).")] = None,
    grid: Annotated[list[str] | None, typer.Option(help="Server grid axis NAME=V1,V2 (repeat for a product).")] = None,
    server_timeout: Annotated[float, typer.Option(help="Seconds to wait for a started server's health.")] = 300.0,
    tokenizer: TokenizerOpt = None, max_error_rate: MaxErrorRate = 0.05, wait_for_server: WaitForServer = 0.0,
    slo_from: SloFrom = "sent",
) -> None:  # fmt: skip
    """Run a list of load points (concurrencies and/or rates × workloads) into one results directory."""

    def body() -> ExitCode:
        conc = parse_list(concurrency, int, "--concurrency") if concurrency else []
        rates = parse_list(rate, float, "--rate") if rate else []
        if not conc and not rates and arrival != "trace":
            conc = [1, 4, 16]
        return _go(
            url=url, backend=backend, api=api, model=model, workloads=[w for w in workload.split(",") if w],
            concurrency=conc, rate=rates, arrival=arrival, burstiness=burstiness, num_requests=num_requests,
            duration=duration, warmup=warmup, seed=seed, slo=slo, repeat=repeat, output_dir=output_dir,
            run_id=run_id, api_key_env=api_key_env, continuous_usage=continuous_usage, extra_body=extra_body,
            client=client, timeout=timeout, stall_timeout=stall_timeout, speedup=speedup, command="sweep",
            default_num_requests=32, poll_hz=poll_hz, server=server,
            grid=[axis for g in grid or [] for axis in g.split()], server_timeout=server_timeout,
            telemetry_hz=telemetry_hz, telemetry_url=telemetry_url, tokenizer=tokenizer,
            max_error_rate=max_error_rate, wait_for_server=wait_for_server, slo_from=slo_from,
        )  # fmt: skip

    _guard(body)


@app.command()
def calibrate(
    concurrency: Annotated[int, typer.Option(help="Closed-loop concurrency.")] = 512,
    events: Annotated[int, typer.Option(help="Stream events per response.")] = 200,
    num_requests: Annotated[int, typer.Option(help="Closed-loop measured requests.")] = 20000,
    rate: Annotated[float, typer.Option(help="Open-loop Poisson rate, req/s.")] = 300.0,
    duration: Annotated[float, typer.Option(help="Open-loop seconds.")] = 30.0,
    client: Client = "aiohttp", output_dir: OutputDir = Path("results"), run_id: RunId = None,
) -> None:  # fmt: skip
    """Measure this client's own ceiling against the null SSE server (run in a separate process)."""
    from loadgen.calibrate import calibrate as _calibrate

    if concurrency < 1 or events < 1 or num_requests < 1 or rate <= 0 or duration <= 0:
        console.print("[red]error[/]: all calibrate options must be positive")
        raise typer.Exit(ExitCode.USAGE)
    if client not in CLIENT_KINDS:
        console.print(f"[red]error[/]: --client must be aiohttp or httpx, got {client!r}")
        raise typer.Exit(ExitCode.USAGE)
    out_dir = output_dir / (run_id or f"calibrate-{new_run_id()}")
    console.print(f"calibrating: closed loop c={concurrency}, {events} events/stream; open loop Poisson {rate:g}/s")
    res = run_async(_calibrate(out_dir, concurrency, events, num_requests, rate, duration, client))
    t = Table(title=f"client ceiling ({client}; load average {res['load_average'][0]:.2f})")
    for col in ("point", "req/s", "events/s", "conc. achieved/req.", "rate achieved/req.", "lag p50 ms",
                "lag p99 ms", "client CPU"):  # fmt: skip
        t.add_column(col, justify="right")
    for name in ("closed", "open"):
        r = res[name]
        conc = f"{r['achieved_concurrency']:.1f}/{r['requested_concurrency']}" if r["requested_concurrency"] else "-"
        rt = f"{r['achieved_rate']:.1f}/{r['requested_rate']:g}" if r["requested_rate"] else "-"
        t.add_row(name, f"{r['req_per_s']:,.0f}", f"{r['events_per_s']:,.0f}", conc, rt,
                  f"{r['lag_p50_ms']:.2f}", f"{r['lag_p99_ms']:.2f}", f"{r['client_cpu']:.0%}")  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 200).print(Group(t, Text(f"results: {out_dir}")))


def main() -> None:
    # SIGTERM outside a load loop (e.g. while a server starts) unwinds like Ctrl-C, so a server bench
    # started is stopped; inside one, run_async turns it into an interrupted point.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(ExitCode.TERMINATED))
    app()


# Other areas' subcommands (one line each):
from loadgen.experiments import experiment_command  # noqa: E402, I001
from loadgen.kvbudget import kv_budget_command  # noqa: E402, I001

app.command("kv-budget")(kv_budget_command)
app.command("experiment")(experiment_command)
from loadgen.gate_cli import baseline_app, gate  # noqa: E402, I001

app.command("gate")(gate)
app.add_typer(baseline_app, name="baseline")
from workloads.cli import app as workloads_app  # noqa: E402, I001

app.add_typer(workloads_app, name="workloads")
from loadgen.report.cli import auto_report, report_command  # noqa: E402, I001

app.command("report")(report_command)
from loadgen.trace import trace_command  # noqa: E402, I001

app.command("trace")(trace_command)
from loadgen.capacity_cli import capacity_command  # noqa: E402, I001

app.command("capacity")(capacity_command)


@app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def serve_command(ctx: typer.Context) -> None:
    """Start the bundled reference server; all flags go to it (bench serve --help lists them)."""
    from reference_server.server import serve  # torch loads only for this command

    serve(ctx.args, prog="bench serve")
