"""What a load run was asked: :class:`RunOptions`, the one typed record of ``bench run``/``sweep``'s options,
which writes the ``config`` of ``run.json`` and says which of its fields make two runs comparable (``bench
gate``); :func:`option`, an options dataclass's field that is a command-line option (its help and spelling as
plain data: :func:`loadgen.cli.options.command` makes the typer command from them, so this module, which the
gate reads, imports no command-line package).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadgen.defaults import REQUEST_TIMEOUT_S, RESULTS_ROOT, STALL_TIMEOUT_S
from loadgen.exitcodes import UsageError
from loadgen.metrics.slo import SloError, parse_slos
from workloads.contracts import ARRIVAL_PROCESSES, OPEN_LOOP_PROCESSES

if TYPE_CHECKING:
    from workloads.base import Workload


def parse_list(text: str, kind: type[float] | type[int], what: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} must be a comma-separated list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise UsageError(f"{what} values must be > 0, got {text!r}")
    return values


def parse_slo(text: str | None) -> dict[str, float] | None:
    """Goodput's per-request limits (``ttft=500ms,tpot=50ms,e2e=10s``, :mod:`loadgen.metrics.slo`) in seconds."""
    if not text:
        return None
    try:
        return {s.metric: s.limit for s in parse_slos(text, percentiles=False)}
    except SloError as exc:
        raise UsageError(str(exc)) from None


# The help of options that calibrate shares with a load run (:class:`RunOptions`), through :func:`option`.
CLIENT = "HTTP transport: aiohttp or httpx."
OUTPUT_DIR = "Results root; the run goes to <output-dir>/<run-id>/."
RUN_ID = "Run id (default: a timestamp)."


def option(default: Any = MISSING, help: str = "", *decls: str, meta: Mapping[str, Any] | None = None) -> Any:
    """An options dataclass's field that is a command-line option (:func:`loadgen.cli.options.command`): its
    ``default`` (none: a required option), its ``help``, its spelling where it is not the field's name
    (``"--json"``); ``meta``: the field's other metadata (:class:`RunOptions`'s ``config``, ``comparable``).
    Its type is the field's own annotation."""
    return field(default=default, metadata={**(meta or {}), "cli": (help, decls)})


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
    url: str | None = option(None, "Target base URL (default: start the bundled reference server).", meta=_incomparable())
    backend: str = option("auto", "Server dialect: auto (ask the server: llama.cpp, vLLM, TGI, SGLang, reference; else "
                          "plain OpenAI) or one of backends.registry.", "--backend")  # fmt: skip
    api: str | None = option(None, "completions, chat, embeddings or rerank (default: the workload's).")
    model: str | None = option(None, "Model name sent to the server (default: GET /v1/models).")
    workloads: list[str] = field(default_factory=lambda: ["chat-short"])
    concurrency: list[int] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    arrival: str | None = option(None, f"Arrival process: {', '.join(ARRIVAL_PROCESSES)} (default: closed with "
                                 "--concurrency, poisson with --rate).")  # fmt: skip
    burstiness: float = option(1.0, "Gamma shape: 1 = Poisson, < 1 burstier.")
    num_requests: int | None = option(None, "Measured requests per point (default: run 100, sweep 32; a replayed "
                                      "trace runs to its end).")  # fmt: skip
    duration: float | None = option(None, "Seconds of dispatch per point.")
    warmup: int = option(0, "Warm-up sessions per point (excluded from metrics).")
    # None: derived from the run id (execute); run.json records the one used. Not part of what makes runs
    # comparable: other prompts of the same workload are another sample of it
    seed: int | None = option(None, "Seed for arrivals and workload sampling (default: derived from the run id, so "
                              "runs send fresh prompts; run.json records it: pass it again to repeat a run's "
                              "prompts).", meta=_incomparable())  # fmt: skip
    # as given; run.json holds it in seconds (:func:`parse_slo`)
    slo: str | None = option(None, "Goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=10s (bare = ms).")
    repeat: int = option(1, "Repeat each point N times as separate trials.", meta=_incomparable())
    api_key_env: str | None = option(None, "Name of the env var holding the API key (never stored).",
                                     meta=_incomparable())  # fmt: skip
    continuous_usage: bool = option(False, "Ask for per-chunk usage (vLLM continuous_usage_stats).")
    extra_body: str | None = option(None, "JSON object merged into every request body.")
    client: str = option("aiohttp", CLIENT)
    timeout: float = option(REQUEST_TIMEOUT_S, "Per-request limit, seconds.", meta=_incomparable())
    stall_timeout: float = option(STALL_TIMEOUT_S, "Longest silence within a response, seconds.", meta=_incomparable())
    speedup: float = option(1.0, "Trace replay speed-up (send at at/speedup).")
    poll_hz: float = option(2.0, "Server-state poller rate (/metrics, /slots), Hz; 0 = off. Every scrape costs the "
                            "server CPU (docs/telemetry.md: 10 Hz slowed a CPU server's decode ~8 %).",
                            meta=_incomparable())  # fmt: skip
    server: str | None = option(None, "Start this server command for each grid point, e.g. 'llama-server -m {model} "
                                "-np {np} --port {port}' ({model}: bundled GGUF, {port}: free port).", "--server",
                                meta=_incomparable())  # fmt: skip
    grid: list[str] | None = option(None, "Server grid axis NAME=V1,V2 (repeat for a product).")
    # run.json records what auto resolved to (None: each workload's own tokenizer)
    tokenizer: str | None = option("auto", "The target model's tokenizer for exact prompt lengths: auto, bundled, a "
                                   "tokenizer.json or .gguf file, a model folder, or a Hugging Face id such as "
                                   "HuggingFaceTB/SmolLM2-135M-Instruct (through the HF cache; HF_HUB_OFFLINE=1 keeps "
                                   "to it). auto: the served model's where its id (GET /v1/models) names one (a "
                                   "folder, a file, a hub id), else the workload's own (bundled), with a warning "
                                   "unless the server's tokenize endpoint counts the first prompt as meant.")  # fmt: skip
    # a JSONL dataset of text: the key holding each prompt
    dataset_field: str | None = option(None, "A JSONL dataset of text as --workload: the key holding each line's "
                                       "prompt (ShareGPT .json and request-body .jsonl need none; "
                                       "workloads/datasets.py).")  # fmt: skip
    max_error_rate: float = option(0.05, "Exit 1 when a point's error rate is above this (0..1).")
    wait_for_server: float = option(0.0, "When the server goes away mid-point, wait up to this many seconds for it and "
                                    "go on with the next point (0: stop).")  # fmt: skip
    slo_from: str = option("sent", "Judge the SLOs' TTFT and E2E from the request's actual send (sent) or its "
                           "intended send time (intended: a client running late cannot flatter goodput).")  # fmt: skip
    # empty the server's prefix cache before each point
    reset_cache: bool = option(False, "Empty the server's prefix cache before each point (vLLM /reset_prefix_cache "
                               "with VLLM_SERVER_DEV_MODE=1, SGLang /flush_cache, the reference server).")  # fmt: skip
    workers: int = option(1, "Load processes on this machine (or Ray actors with --ray), each with its own event loop "
                          "and HTTP client; the load of each point is split over them.", meta=_incomparable())  # fmt: skip
    ray: str | None = option(None, "Run the workers as Ray actors: 'local' (start Ray here), 'auto' or a cluster "
                             "address (needs pip install 'servelab[ray]').", meta=_incomparable())  # fmt: skip
    # how the run is carried out, not what it measures: not in run.json
    output_dir: Path = option(RESULTS_ROOT, OUTPUT_DIR, meta=_not_config())
    run_id: str | None = option(None, RUN_ID, meta=_not_config())
    telemetry_hz: float = option(10.0, "Telemetry rate (NVML GPUs, host, server process), Hz; 0 = off.",
                                 meta=_not_config())  # fmt: skip
    telemetry_url: str | None = option(None, "Prometheus URL of a DCGM/node exporter on the server's host.",
                                       meta=_not_config())  # fmt: skip
    server_timeout: float = option(300.0, "Seconds to wait for a started server's health.", meta=_not_config())
    default_num_requests: int = field(default=100, metadata=_not_config())

    @classmethod
    def config_defaults(cls) -> dict[str, Any]:
        """Each ``run.json`` config key's default: what a result written before the key existed ran with."""
        return {f.name: field_default(f) for f in fields(cls) if f.metadata.get("config", True) and f.name != "command"}

    @classmethod
    def incomparable(cls) -> frozenset[str]:
        """The ``run.json`` config keys that two comparable runs may differ in."""
        return frozenset(f.name for f in fields(cls) if not f.metadata.get("comparable", True))

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

    def config(self) -> dict[str, Any]:
        """The ``config`` of ``run.json``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("config", True)}
        out["url"] = self.url or "embedded reference server"
        out["slo"] = parse_slo(self.slo)
        return out


def field_default(f: Field[Any]) -> Any:
    """A dataclass field's default value (its factory's, for a list; ``inspect.Parameter.empty`` for a field
    without one: a required option)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else inspect.Parameter.empty
