"""The options of a load run: :class:`RunOptions`, the one typed record of what ``bench run``/``sweep`` was
asked, which validates itself, writes the ``config`` of ``run.json`` and says which of its fields make two
runs comparable (``bench gate``); the command-line spelling of options shared by several commands; and
:func:`command`, which makes a typer command whose options are an options dataclass's fields (``RunOptions``'s
for run, sweep and capacity; gate, calibrate and kv-budget each have their own small one).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from backends.launcher import GridPoint, LaunchError, server_grid
from loadgen import metrics
from loadgen.client import CLIENT_KINDS
from loadgen.defaults import REQUEST_TIMEOUT_S, RESULTS_ROOT, STALL_TIMEOUT_S
from loadgen.exitcodes import UsageError
from loadgen.fleet import Fleet
from loadgen.sidecars import telemetry
from loadgen.slo import SloError, parse_slos
from workloads.base import Workload
from workloads.contracts import APIS, ARRIVAL_PROCESSES, OPEN_LOOP_PROCESSES


def parse_list(text: str, kind: type[float] | type[int], what: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be a comma-separated list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise UsageError(f"{what} values must be > 0, got {text!r}")
    return values


def parse_slo(text: str | None) -> dict[str, float] | None:
    """Goodput's per-request limits (``ttft=500ms,tpot=50ms,e2e=10s``, :mod:`loadgen.slo`) in seconds."""
    if not text:
        return None
    try:
        return {s.metric: s.limit for s in parse_slos(text, percentiles=False)}
    except SloError as exc:
        raise UsageError(str(exc)) from None


# The command-line spelling of options several commands share.
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
Seed = Annotated[int | None, typer.Option(help="Seed for arrivals and workload sampling (default: derived from "
                                           "the run id, so runs send fresh prompts; run.json records it: pass "
                                           "it again to repeat a run's prompts).")]
Slo = Annotated[str | None, typer.Option(help="Goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=10s (bare = ms).")]
SloFrom = Annotated[str, typer.Option(help="Judge the SLOs' TTFT and E2E from the request's actual send "
                    "(sent) or its intended send time (intended: a client running late cannot flatter goodput).")]
Repeat = Annotated[int, typer.Option(help="Repeat each point N times as separate trials.")]
OutputDir = Annotated[Path, typer.Option(help="Results root; the run goes to <output-dir>/<run-id>/.")]
RunId = Annotated[str | None, typer.Option(help="Run id (default: a timestamp).")]
ApiKeyEnv = Annotated[str | None, typer.Option(help="Name of the env var holding the API key (never stored).")]
ContinuousUsage = Annotated[bool, typer.Option(help="Ask for per-chunk usage (vLLM continuous_usage_stats).")]
ExtraBody = Annotated[str | None, typer.Option(help="JSON object merged into every request body.")]
Client = Annotated[str, typer.Option(help="HTTP transport: aiohttp or httpx.")]
Timeout = Annotated[float, typer.Option(help="Per-request limit, seconds.")]
StallTimeout = Annotated[float, typer.Option(help="Longest silence within a response, seconds.")]
Speedup = Annotated[float, typer.Option(help="Trace replay speed-up (send at at/speedup).")]
PollHz = Annotated[float, typer.Option(help="Server-state poller rate (/metrics, /slots), Hz; 0 = off.")]
TelemetryHz = Annotated[float, typer.Option(help="Telemetry rate (NVML GPUs, host, server process), Hz; 0 = off.")]
TokenizerOpt = Annotated[str | None, typer.Option(
    help="The target model's tokenizer for exact prompt lengths: a tokenizer.json or .gguf file, a model folder, or "
         "a Hugging Face id such as HuggingFaceTB/SmolLM2-135M-Instruct (through the HF cache; HF_HUB_OFFLINE=1 "
         "keeps to it). Default: the served model's where its id (GET /v1/models) names one this machine has (a "
         "folder, a file, a cached hub id), else the bundled model's.")]
Workers = Annotated[int, typer.Option(help="Load processes on this machine (or Ray actors with --ray), each with "
                                      "its own event loop and HTTP client; the load of each point is split over them.")]
Ray = Annotated[str | None, typer.Option(help="Run the workers as Ray actors: 'local' (start Ray here), 'auto' or "
                                         "a cluster address (needs pip install 'servelab[ray]').")]
ResetCache = Annotated[bool, typer.Option(help="Empty the server's prefix cache before each point (vLLM "
                      "/reset_prefix_cache with VLLM_SERVER_DEV_MODE=1, SGLang /flush_cache, the reference server).")]
DatasetField = Annotated[str | None, typer.Option(help="A JSONL dataset of text as --workload: the key holding each "
                        "line's prompt (ShareGPT .json and request-body .jsonl need none; workloads/datasets.py).")]
TelemetryUrl = Annotated[str | None, typer.Option(help="Prometheus URL of a DCGM/node exporter on the server's host.")]
ServerCmd = Annotated[str | None, typer.Option("--server", help="Start this server command for each grid point, "
                     "e.g. 'llama-server -m {model} -np {np} --port {port}' ({model}: bundled GGUF, {port}: free port).")]
Grid = Annotated[list[str] | None, typer.Option(help="Server grid axis NAME=V1,V2 (repeat for a product).")]
ServerTimeout = Annotated[float, typer.Option(help="Seconds to wait for a started server's health.")]


def _not_config() -> Any:
    return {"config": False}


def _incomparable() -> Any:
    return {"comparable": False}


@dataclass(frozen=True)
class RunOptions:
    """What a load run was asked. Every field but those marked ``config: False`` goes into ``run.json``
    (in this order); fields marked ``comparable: False`` do not change what is measured (where the server
    is, how many trials, limits that matter only on failure), so ``bench gate`` compares runs that differ
    only in them. The server command is not compared either: comparing two servers is the point."""

    command: str = field(metadata=_incomparable())
    url: str | None = field(default=None, metadata={**_incomparable(), "cli": Url})
    backend: str = field(default="auto", metadata={"cli": BackendOpt})
    api: str | None = field(default=None, metadata={"cli": ApiOpt})
    model: str | None = field(default=None, metadata={"cli": Model})
    workloads: list[str] = field(default_factory=lambda: ["chat-short"])
    concurrency: list[int] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    arrival: str | None = field(default=None, metadata={"cli": Arrival})
    burstiness: float = field(default=1.0, metadata={"cli": Burstiness})
    num_requests: int | None = field(default=None, metadata={"cli": NumRequests})
    duration: float | None = field(default=None, metadata={"cli": Duration})
    warmup: int = field(default=0, metadata={"cli": Warmup})
    # None: derived from the run id (execute); run.json records the one used. Not part of what makes runs
    # comparable: other prompts of the same workload are another sample of it
    seed: int | None = field(default=None, metadata={**_incomparable(), "cli": Seed})
    slo: str | None = field(default=None, metadata={"cli": Slo})  # as given; run.json holds it in seconds (:func:`parse_slo`)
    repeat: int = field(default=1, metadata={**_incomparable(), "cli": Repeat})
    api_key_env: str | None = field(default=None, metadata={**_incomparable(), "cli": ApiKeyEnv})
    continuous_usage: bool = field(default=False, metadata={"cli": ContinuousUsage})
    extra_body: str | None = field(default=None, metadata={"cli": ExtraBody})
    client: str = field(default="aiohttp", metadata={"cli": Client})
    timeout: float = field(default=REQUEST_TIMEOUT_S, metadata={**_incomparable(), "cli": Timeout})
    stall_timeout: float = field(default=STALL_TIMEOUT_S, metadata={**_incomparable(), "cli": StallTimeout})
    speedup: float = field(default=1.0, metadata={"cli": Speedup})
    poll_hz: float = field(default=10.0, metadata={**_incomparable(), "cli": PollHz})
    server: str | None = field(default=None, metadata={**_incomparable(), "cli": ServerCmd})
    grid: list[str] | None = field(default=None, metadata={"cli": Grid})
    tokenizer: str | None = field(default=None, metadata={"cli": TokenizerOpt})
    dataset_field: str | None = field(default=None, metadata={"cli": DatasetField})  # a JSONL dataset of text: the key holding each prompt
    max_error_rate: float = field(default=0.05, metadata={"cli": MaxErrorRate})
    wait_for_server: float = field(default=0.0, metadata={"cli": WaitForServer})
    slo_from: str = field(default="sent", metadata={"cli": SloFrom})
    reset_cache: bool = field(default=False, metadata={"cli": ResetCache})  # empty the server's prefix cache before each point
    workers: int = field(default=1, metadata={**_incomparable(), "cli": Workers})
    ray: str | None = field(default=None, metadata={**_incomparable(), "cli": Ray})
    # how the run is carried out, not what it measures: not in run.json
    output_dir: Path = field(default=RESULTS_ROOT, metadata={**_not_config(), "cli": OutputDir})
    run_id: str | None = field(default=None, metadata={**_not_config(), "cli": RunId})
    telemetry_hz: float = field(default=10.0, metadata={**_not_config(), "cli": TelemetryHz})
    telemetry_url: str | None = field(default=None, metadata={**_not_config(), "cli": TelemetryUrl})
    server_timeout: float = field(default=300.0, metadata={**_not_config(), "cli": ServerTimeout})
    default_num_requests: int = field(default=100, metadata=_not_config())

    @classmethod
    def config_defaults(cls) -> dict[str, Any]:
        """Each ``run.json`` config key's default: what a result written before the key existed ran with."""
        return {f.name: _default(f) for f in fields(cls) if f.metadata.get("config", True) and f.name != "command"}

    @classmethod
    def incomparable(cls) -> frozenset[str]:
        """The ``run.json`` config keys that two comparable runs may differ in."""
        return frozenset(f.name for f in fields(cls) if not f.metadata.get("comparable", True))

    def check(self) -> list[GridPoint]:
        """Every check that needs no server and no workload; returns the server grid (empty without --server)."""
        if self.slo_from not in metrics.SLO_FROM:
            raise UsageError(f"--slo-from must be one of {', '.join(metrics.SLO_FROM)}, got {self.slo_from!r}")
        if self.api not in (None, *APIS):
            raise UsageError(f"--api must be completions or chat, got {self.api!r}")
        if self.client not in CLIENT_KINDS:
            raise UsageError(f"--client must be aiohttp or httpx, got {self.client!r}")
        if self.arrival is not None and self.arrival not in ARRIVAL_PROCESSES:
            raise UsageError(f"--arrival must be one of {', '.join(ARRIVAL_PROCESSES)}, got {self.arrival!r}")
        if self.repeat < 1 or self.warmup < 0:
            raise UsageError("--repeat must be >= 1 and --warmup >= 0")
        if not 0 <= self.max_error_rate <= 1 or self.wait_for_server < 0:
            raise UsageError("--max-error-rate must be within 0..1 and --wait-for-server >= 0")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise UsageError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.workers < 1:
            raise UsageError(f"--workers must be >= 1, got {self.workers}")
        if self.poll_hz < 0:
            raise UsageError("--poll-hz must be >= 0 (0 turns the server-state poller off)")
        try:
            telemetry.check_options(self.telemetry_hz, self.telemetry_url)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if self.grid and not self.server:
            raise UsageError("--grid needs --server (the command template the grid fills in)")
        if self.server and self.url:
            raise UsageError("--server starts the target itself; drop --url")
        try:
            grid_points = server_grid(self.server, self.grid or []) if self.server else []
        except (ValueError, LaunchError) as exc:
            raise UsageError(f"--server/--grid: {exc}") from None
        parse_slo(self.slo)
        return grid_points

    def resolve(self, wls: list[Workload], finite: bool) -> RunOptions:
        """The options with the workload's own arrival settings filled in (concurrency 1 when it has none)
        and the default request cap unless the load ends by itself (``finite``: every workload a trace)."""
        opts = self
        if not self.concurrency and not self.rate:
            spec = wls[0].arrival
            arrival = self.arrival or spec.process
            opts = replace(opts, arrival=arrival, burstiness=spec.burstiness or self.burstiness)
            if spec.rate:
                opts = replace(opts, rate=[spec.rate])
            elif arrival != "trace":
                opts = replace(opts, concurrency=[spec.concurrency or 1])
        if opts.num_requests is None and opts.duration is None and not (opts.arrival == "trace" and finite):
            opts = replace(opts, num_requests=opts.default_num_requests)
        if opts.arrival == "closed" and opts.rate:
            raise UsageError("--arrival closed takes --concurrency, not --rate")
        if opts.arrival in OPEN_LOOP_PROCESSES and opts.concurrency and not opts.rate:
            raise UsageError(f"--arrival {opts.arrival} needs --rate")
        return opts

    def fleet(self) -> Fleet:
        return Fleet(self.workers, self.ray)

    def config(self) -> dict[str, Any]:
        """The ``config`` of ``run.json``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("config", True)}
        out["url"] = self.url or "embedded reference server"
        out["slo"] = parse_slo(self.slo)
        return out




def _default(f: Field[Any]) -> Any:
    """A dataclass field's default value (its factory's, for a list; ``inspect.Parameter.empty`` for a field
    without one: a required option)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else inspect.Parameter.empty


def command(body: Callable[..., Any], names: Sequence[str] | None = None,
            own: Mapping[str, inspect.Parameter] | None = None, defaults: Mapping[str, Any] | None = None,
            options: type[Any] = RunOptions) -> Callable[..., None]:  # fmt: skip
    """A typer command that calls ``body(**options)``: its options are the fields ``names`` (default: every
    field with a ``cli`` annotation) of the dataclass ``options`` (:class:`RunOptions` unless given), in that
    order, each spelled once (the field's ``cli`` annotation) with the field's default or the command's own
    (``defaults``); a name in ``own`` is the command's own parameter instead (run's single ``--concurrency``
    and sweep's list of them). Its help is ``body``'s docstring."""
    by_name = {f.name: f for f in fields(options)}
    names = [f.name for f in fields(options) if "cli" in f.metadata] if names is None else names
    own, defaults = own or {}, defaults or {}
    params = []
    for name in names:
        if name in own:
            params.append(own[name])
            continue
        f = by_name[name]
        default = defaults.get(name, _default(f))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.metadata["cli"]))

    def cmd(**values: Any) -> None:
        body(**values)

    cmd.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cmd.__annotations__ = {p.name: p.annotation for p in params}
    cmd.__doc__, cmd.__name__ = body.__doc__, body.__name__.lstrip("_")
    return cmd


def param(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    """A command's own option (see :func:`command`)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
