"""Named experiments: the reference server in several configurations, the same traffic against each.

``bench experiment NAME`` starts ``python -m reference_server`` once per configuration (through the
launcher), runs identical seeded traffic with the load engine into one results directory per
configuration, then writes ``comparison.json``/``comparison.md`` (one table) and ``report.html``.
Each experiment states the claim it tests and prints a verdict line computed from the measured table.

Size: a small framework and the experiments with their traffic and verdicts; experiments as data over the
workload system (instead of MixWorkload) is issue 21's next step here.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from backends.launcher import ServerProcess, bundled_model, free_port
from backends.profile import REFERENCE_SPEC
from backends.registry import get_backend
from loadgen.clock import RunClock
from loadgen.engine import LoadSpec, run_async
from loadgen.results import ResultsDir, lookup, new_run_id
from loadgen.sidecars.prometheus import parse_metrics
from loadgen.sweep import PointPlan, run_sweep
from workloads.base import ArrivalSpec, Session, SingleShot, Workload
from workloads.contracts import GenRequest

Summary = dict[str, Any]


@dataclass
class Config:
    """One server configuration: a label and the extra ``python -m reference_server`` flags."""

    label: str
    server_args: list[str]


@dataclass
class Column:
    header: str
    get: Callable[[Summary, dict[str, Any]], float | str | None]  # (point summary, server extras)
    fmt: str = "{:.1f}"


@dataclass
class Experiment:
    name: str
    claim: str
    configs: list[Config]
    traffic: Callable[[bool], list[PointPlan]]  # quick -> the points every configuration gets
    columns: list[Column]
    verdict: Callable[[dict[str, list[Summary]], dict[str, dict[str, Any]]], str]
    common_args: list[str] = field(default_factory=list)  # server flags shared by all configurations
    # extra measurement against a running server: (base URL, its reference_server flags) -> values
    probe: Callable[[str, list[str]], dict[str, Any]] | None = None


def _get(d: dict[str, Any], path: str) -> Any:
    return lookup(d, path.split("."))


def metric(path: str) -> Callable[[Summary, dict[str, Any]], Any]:
    return lambda s, _extra: _get(s, path)


# -- scraping the reference server ------------------------------------------------------------------

def scrape_metrics(base_url: str) -> dict[str, float]:
    """Unlabelled samples of the server's Prometheus ``/metrics`` (name -> value), read with the one parser."""
    values, _ = parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)
    return {k: v for k, v in values.items() if "{" not in k}


def greedy_outputs(base_url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Non-streamed greedy completions (for checking that a configuration changes no output)."""
    texts = []
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": False, "ignore_eos": True}
            resp = client.post("/v1/completions", json=body)
            resp.raise_for_status()
            texts.append(resp.json()["choices"][0]["text"])
    return texts


# -- running ----------------------------------------------------------------------------------------


def run_experiment(exp: Experiment, out: Path, quick: bool, model: Path | None, console: Console) -> dict[str, Any]:
    """Run every configuration of ``exp`` into ``out/<label>``; returns the comparison."""
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(model or bundled_model())
    per_config: dict[str, list[Summary]] = {}
    extras: dict[str, dict[str, Any]] = {}
    dirs: list[Path] = []
    for cfg in exp.configs:
        port = free_port()
        argv = [sys.executable, "-m", "reference_server", "--model", model_path, "--port", str(port),
                *exp.common_args, *cfg.server_args]  # fmt: skip
        run_dir = out / cfg.label
        dirs.append(run_dir)
        console.print(f"[bold]{exp.name}[/] / {cfg.label}: {' '.join(argv[3:])}")
        with ServerProcess(argv, port, run_dir / "server.log") as srv:
            served = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
            backend = get_backend("openai")(srv.base_url, model=served)
            config = {"experiment": exp.name, "configuration": cfg.label, "server_args": argv[3:], "quick": quick}
            t0 = time.monotonic()
            summaries = run_async(run_sweep(backend, exp.traffic(quick), ResultsDir(run_dir), RunClock(), config,
                                            lambda _plan: [SpecCounters(srv.base_url)]))
            extra: dict[str, Any] = {"seconds": time.monotonic() - t0, "metrics": scrape_metrics(srv.base_url)}
            if exp.probe is not None:
                extra.update(exp.probe(srv.base_url, argv[3:]))
        per_config[cfg.label] = summaries
        extras[cfg.label] = extra
    comparison = _comparison(exp, per_config, extras, quick)
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1, default=str))
    (out / "comparison.md").write_text(_markdown(comparison))
    _print(comparison, console)
    try:
        from loadgen.report import write_report

        write_report(dirs, out / "report.html")
        comparison["report"] = str(out / "report.html")
    except Exception as exc:  # the table is the result; a report failure must not lose it
        console.print(f"[yellow]report not written: {type(exc).__name__}: {exc}[/]")
    return comparison


def _comparison(exp: Experiment, per_config: dict[str, list[Summary]], extras: dict[str, dict[str, Any]],
                quick: bool) -> dict[str, Any]:  # fmt: skip
    rows = []
    for label, summaries in per_config.items():
        for s in summaries:
            cells = {c.header: c.get(s, extras[label]) for c in exp.columns}
            rows.append({"config": label, "point": s["point_id"], **cells})
    return {
        "experiment": exp.name, "claim": exp.claim, "quick": quick,
        "columns": ["config", "point", *(c.header for c in exp.columns)],
        "formats": {c.header: c.fmt for c in exp.columns}, "rows": rows,
        "verdict": exp.verdict(per_config, extras),
        "seconds": {label: e["seconds"] for label, e in extras.items()},
        "probes": {label: {k: v for k, v in e.items() if k not in ("seconds", "metrics")} for label, e in extras.items()},
    }  # fmt: skip


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float | int) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def _markdown(c: dict[str, Any]) -> str:
    cols = c["columns"]
    lines = [f"# experiment {c['experiment']}", "", c["claim"], "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    for r in c["rows"]:
        lines.append("| " + " | ".join(_cell(r[k], c["formats"].get(k, "{}")) for k in cols) + " |")
    lines += ["", f"**verdict**: {c['verdict']}", ""]
    return "\n".join(lines)


def _print(c: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{c['experiment']}: {c['claim']}")
    for col in c["columns"]:
        table.add_column(col, justify="left" if col in ("config", "point") else "right")
    for r in c["rows"]:
        table.add_row(*(_cell(r[k], c["formats"].get(k, "{}")) for k in c["columns"]))
    console.print(table)
    console.print(f"[bold]verdict:[/] {c['verdict']}")


# -- the experiments ---------------------------------------------------------------------------------

EXPERIMENTS: dict[str, Callable[[], Experiment]] = {}


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
    run_experiment(exp, out or Path("results") / f"exp-{name}-{new_run_id()}", quick, model, Console())


def _plans(workload: Workload, load: LoadSpec, prefix: str | None = None) -> list[PointPlan]:
    return [PointPlan(load.point_id() if prefix is None else f"{prefix}/{load.point_id()}", workload, load)]


# -- traffic -----------------------------------------------------------------------------------------

_WORDS = (
    "time people year way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force"
).split()  # each " word" is one token for the bundled model's tokenizer


def filler(tokens: int, seed: int) -> str:
    """Text of ``tokens`` space-separated common words (one token each for SmolLM2's BPE)."""
    rng = random.Random(seed)
    return "".join(" " + rng.choice(_WORDS) for _ in range(tokens))


@dataclass
class RequestClass:
    name: str
    max_tokens: int
    prompt: Callable[[int], str]  # request index -> prompt text
    weight: float = 1.0
    temperature: float = 0.0
    priority: int | None = None


class MixWorkload(Workload):
    """Requests drawn from weighted classes; with ``schedule`` the i-th session is sent at ``schedule[i]``."""

    def __init__(self, name: str, classes: list[RequestClass], schedule: list[tuple[float, str]] | None = None) -> None:
        self.name, self.classes, self.schedule = name, classes, schedule
        self.arrival = ArrivalSpec()

    def _request(self, i: int, cls: RequestClass, seed: int) -> GenRequest:
        extra = {} if cls.priority is None else {"priority": cls.priority}
        return GenRequest(
            request_id=f"{self.name}-{seed}-{i}", prompt=cls.prompt(seed * 100_003 + i), max_tokens=cls.max_tokens,
            workload_class=cls.name, temperature=cls.temperature, seed=seed * 100_003 + i if cls.temperature else None,
            extra_body=extra,
        )  # fmt: skip

    def sessions(self, seed: int) -> Iterator[Session]:
        by_name = {c.name: c for c in self.classes}
        if self.schedule is not None:
            for i, (at, name) in enumerate(self.schedule):
                yield SingleShot(self._request(i, by_name[name], seed), at=at)
            return
        rng = random.Random(seed)
        weights = [c.weight for c in self.classes]
        for i in itertools.count():
            yield SingleShot(self._request(i, rng.choices(self.classes, weights)[0], seed))

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "classes": [(c.name, c.max_tokens, c.weight, c.temperature, c.priority)
                                               for c in self.classes], "schedule": self.schedule}  # fmt: skip


class SpecCounters:
    """Sidecar: speculative-decoding counters of the server over one point (drafted, accepted, rate)."""

    name = "spec"

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.start_values: dict[str, float] = {}

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self.start_values = scrape_metrics(self.base_url)

    def stop(self, window: tuple[float, float] | None) -> dict[str, Any]:
        now = scrape_metrics(self.base_url)
        drafted, accepted = (now.get(k, 0.0) - self.start_values.get(k, 0.0) for k in REFERENCE_SPEC)
        return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def _short_prompt(i: int) -> str:
    return "Write about" + filler(24, i) + "."


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _first(per_config: dict[str, list[Summary]], label: str, path: str) -> Any:
    return _get(per_config[label][0], path)


OUT_TPS = "throughput.whole.output_tok_per_s"


def batching() -> Experiment:
    """Static vs dynamic vs continuous batching on a 50 % short / 50 % long output mix.

    Every configuration has the same KV pool. Static and dynamic batching reserve each request's whole
    span (prompt + max_tokens) up front, as padded batches do, and admit nobody until the batch ends."""

    def traffic(quick: bool) -> list[PointPlan]:
        mix = MixWorkload("short-long-50-50", [RequestClass("short", 8 if quick else 16, _short_prompt),
                                               RequestClass("long", 96 if quick else 256, _short_prompt)])  # fmt: skip
        return _plans(mix, LoadSpec(process="closed", concurrency=16, num_requests=40 if quick else 64, seed=1))

    def verdict(pc: dict[str, list[Summary]], _e: dict[str, dict[str, Any]]) -> str:
        speed = _ratio(_first(pc, "continuous", OUT_TPS), _first(pc, "static", OUT_TPS))
        p99c, p99s = _first(pc, "continuous", "latency.e2e.p99"), _first(pc, "static", "latency.e2e.p99")
        ok = speed is not None and speed >= 2.5 and p99c is not None and p99s is not None and p99c < p99s
        return (f"continuous / static output tok/s = {speed:.2f}x (target >= 2.5x); e2e p99 {p99c:.1f}s vs "
                f"{p99s:.1f}s -> {'PASS' if ok else 'FAIL'}") if speed else "incomplete"  # fmt: skip

    return Experiment(
        "batching", "continuous batching beats static batching (seed claim: 3-5x)",
        [Config("static", ["--batching", "static"]), Config("dynamic", ["--batching", "dynamic"]),
         Config("continuous", ["--batching", "continuous"])],  # fmt: skip
        traffic,
        [Column("out tok/s", metric(OUT_TPS)), Column("req/s", metric("throughput.whole.req_per_s"), "{:.2f}"),
         Column("e2e p50 s", metric("latency.e2e.p50"), "{:.2f}"), Column("e2e p99 s", metric("latency.e2e.p99"), "{:.2f}"),
         Column("ttft p99 s", metric("latency.ttft.p99"), "{:.2f}"),
         Column("short e2e p99 s", metric("per_class.short.latency.e2e.p99"), "{:.2f}")],  # fmt: skip
        verdict,
        common_args=["--max-num-seqs", "16", "--batch-size", "16", "--num-kv-blocks", "192", "--max-model-len", "512"],
    )


def chunked_prefill() -> Experiment:
    """Four streams decode while 2,000-token prompts arrive: the streams' ITL with and without chunking."""
    long_prompt = RequestClass("long-prompt", 1, lambda i: filler(2000, i))
    decode = RequestClass("decode", 160, _short_prompt)

    def traffic(quick: bool) -> list[PointPlan]:
        # The long prompts arrive 1 s apart, early enough that all of them land while the four streams
        # still decode (160 tokens take ~4.6 s here at 2 threads), and the stalls they cause stay above 1 %
        # of the streams' gaps, so the p99 sees them. (First spaced 6 s apart: once the engine got faster
        # the streams had finished before the later prompts arrived and the unchunked p99 missed the stalls.)
        n_long = 2 if quick else 4
        schedule = [(0.0, "decode")] * 4 + [(0.5 + 1.0 * j, "long-prompt") for j in range(n_long)]
        wl = MixWorkload("decode-plus-long-prefill", [decode, long_prompt], schedule)
        return _plans(wl, LoadSpec(process="trace", num_requests=len(schedule), seed=2, stall_timeout=300))

    def verdict(pc: dict[str, list[Summary]], _e: dict[str, dict[str, Any]]) -> str:
        key = "per_class.decode.latency.itl.p99"
        cut = _ratio(_first(pc, "unchunked", key), _first(pc, "chunked", key))
        return (f"decode ITL p99 without / with chunking = {cut:.2f}x (target >= 2x) -> "
                f"{'PASS' if cut >= 2 else 'FAIL'}") if cut else "incomplete"  # fmt: skip

    return Experiment(
        "chunked-prefill", "chunked prefill keeps decoding streams smooth while a long prompt is admitted",
        # unchunked: a budget that admits the whole prompt next to the decodes (one long step)
        [Config("unchunked", ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"]),
         Config("chunked", ["--max-num-batched-tokens", "128"])],
        traffic,
        [Column("decode ITL p50 ms", lambda s, _e: _ms(_get(s, "per_class.decode.latency.itl.p50"))),
         Column("decode ITL p99 ms", lambda s, _e: _ms(_get(s, "per_class.decode.latency.itl.p99"))),
         Column("decode ITL max ms", lambda s, _e: _ms(_get(s, "per_class.decode.latency.itl.max"))),
         Column("long TTFT p50 s", metric("per_class.long-prompt.latency.ttft.p50"), "{:.2f}"),
         Column("out tok/s", metric(OUT_TPS))],  # fmt: skip
        verdict,
        common_args=["--no-enable-prefix-caching"],
    )


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def scheduling() -> Experiment:
    """FIFO vs SJF vs priority on a queue of short, long and urgent requests arriving in a burst."""
    classes = [RequestClass("short", 8, _short_prompt, weight=2), RequestClass("long", 96, _short_prompt, weight=2),
               RequestClass("urgent", 32, _short_prompt, weight=1, priority=10)]  # fmt: skip
    wl = MixWorkload("mixed-queue", classes)

    def traffic(quick: bool) -> list[PointPlan]:
        return _plans(wl, LoadSpec(process="constant", rate=20.0, num_requests=20 if quick else 60, seed=3))

    def verdict(pc: dict[str, list[Summary]], _e: dict[str, dict[str, Any]]) -> str:
        mean = {k: _first(pc, k, "latency.e2e.mean") for k in pc}
        urgent = {k: _first(pc, k, "per_class.urgent.latency.e2e.mean") for k in pc}
        return (f"mean e2e fifo {mean['fifo']:.2f}s, sjf {mean['sjf']:.2f}s; urgent mean e2e fifo "
                f"{urgent['fifo']:.2f}s, priority {urgent['priority']:.2f}s")  # fmt: skip

    cols = [Column("e2e mean s", metric("latency.e2e.mean"), "{:.2f}"), Column("e2e p99 s", metric("latency.e2e.p99"), "{:.2f}")]
    for c in ("short", "long", "urgent"):
        cols += [Column(f"{c} mean s", metric(f"per_class.{c}.latency.e2e.mean"), "{:.2f}"),
                 Column(f"{c} p99 s", metric(f"per_class.{c}.latency.e2e.p99"), "{:.2f}")]  # fmt: skip
    return Experiment(
        "scheduling", "SJF lowers mean latency; priority serves urgent work first",
        [Config(p, ["--policy", p]) for p in ("fifo", "sjf", "priority")], traffic, cols, verdict,
        common_args=["--max-num-seqs", "4"],
    )


SYSTEM = filler(1000, 7)


def prefix_cache() -> Experiment:
    """A shared 1,000-token system prompt: TTFT with the prefix cache on and off."""
    wl = MixWorkload("shared-system-prompt", [RequestClass("q", 16, lambda i: SYSTEM + "\nQuestion:" + filler(12, i))])

    def traffic(quick: bool) -> list[PointPlan]:
        return _plans(wl, LoadSpec(process="closed", concurrency=4, num_requests=8 if quick else 32, seed=4))

    def verdict(pc: dict[str, list[Summary]], _e: dict[str, dict[str, Any]]) -> str:
        r = _ratio(_first(pc, "cache-off", "latency.ttft.p50"), _first(pc, "cache-on", "latency.ttft.p50"))
        return f"TTFT p50 off / on = {r:.1f}x" if r else "incomplete"

    return Experiment(
        "prefix-cache", "prefix caching multiplies effective capacity for shared prompts",
        [Config("cache-off", ["--no-enable-prefix-caching"]), Config("cache-on", [])], traffic,
        [Column("ttft p50 s", metric("latency.ttft.p50"), "{:.3f}"), Column("ttft p99 s", metric("latency.ttft.p99"), "{:.3f}"),
         Column("out tok/s", metric(OUT_TPS)), Column("req/s", metric("throughput.whole.req_per_s"), "{:.2f}")],  # fmt: skip
        verdict,
    )


CODE = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


def chunks(items: list[int], size: int) -> list[list[int]]:
    """Split items into chunks of at most size elements."""
    return [items[k : k + size] for k in range(0, len(items), size)]
'''


def _edit_prompt(i: int) -> str:
    """A code edit whose answer mostly repeats the prompt: the file, then the start of its edited copy."""
    name = ("merge_sorted", "chunks")[i % 2]
    return (f"File utils.py:\n\n```python\n{CODE}```\n\nThe same file after renaming `{name}` to `{name}_v2` "
            f"(everything else unchanged):\n\n```python\n{CODE[:CODE.index(name)]}{name}_v2")  # fmt: skip


def speculative() -> Experiment:
    """Speculation off / n-gram / self-draft on a predictable code-edit workload and a creative one."""

    def traffic(quick: bool) -> list[PointPlan]:
        n, out = (2, 64) if quick else (6, 128)  # quick: the self-draft config alone ran ~80 s at 128 tokens
        edit = MixWorkload("code-edit", [RequestClass("code-edit", out, _edit_prompt)])
        creative = MixWorkload("creative", [RequestClass("creative", out, lambda i: "Once upon a time, in a land of"
                                                         + filler(8, i) + ",", temperature=0.8)])  # fmt: skip
        load = LoadSpec(process="closed", concurrency=1, num_requests=n, seed=5)
        return _plans(edit, load, "code-edit") + _plans(creative, load, "creative")

    def probe(base_url: str, _args: list[str]) -> dict[str, Any]:
        return {"outputs": greedy_outputs(base_url, [_edit_prompt(0), _edit_prompt(1)], 48)}

    def verdict(pc: dict[str, list[Summary]], extras: dict[str, dict[str, Any]]) -> str:
        def tps(label: str, point: str) -> float | None:
            return next((_get(s, OUT_TPS) for s in pc[label] if s["point_id"].startswith(point)), None)

        speed = _ratio(tps("ngram", "code-edit"), tps("off", "code-edit"))
        same = all(extras[k]["outputs"] == extras["off"]["outputs"] for k in extras)
        creative_acc = next((_get(s, "spec.acceptance") for s in pc["ngram"] if s["point_id"].startswith("creative")), None)
        ok = speed is not None and speed >= 1.5 and same
        acc = f"{creative_acc:.0%}" if creative_acc is not None else "-"
        return (f"n-gram / off single-stream tok/s on code-edit = {speed or 0:.2f}x (target >= 1.5x); greedy outputs "
                f"identical across configurations: {same}; n-gram acceptance on creative: {acc} -> "
                f"{'PASS' if ok else 'FAIL'}")  # fmt: skip

    return Experiment(
        "speculative", "speculative decoding is a lossless speed-up on predictable text, not on creative text",
        [Config("off", []), Config("ngram", ["--spec", "ngram", "--spec-k", "8"]),
         Config("self", ["--spec", "self", "--spec-k", "4", "--self-draft-layers", "20"])],  # fmt: skip
        traffic,
        [Column("out tok/s", metric(OUT_TPS)), Column("tpot ms", lambda s, _e: _ms(_get(s, "latency.tpot.mean"))),
         Column("acceptance", lambda s, _e: _get(s, "spec.acceptance"), "{:.0%}"),
         Column("drafted", lambda s, _e: _get(s, "spec.drafted"), "{:.0f}")],  # fmt: skip
        verdict,
        # fp32: bf16 rounding differs between a 1-token decode and a (k+1)-token verification pass, which
        # can flip a near-tie argmax; in fp32 greedy speculation is token-for-token identical
        common_args=["--dtype", "fp32"],
        probe=probe,
    )


def quantization() -> Experiment:
    """Quantisation: bf16 vs int8 vs int4 linears, and an int8 KV cache; decode speed at c = 1 and 16, the
    KV pool's capacity in tokens (``/metrics`` blocks x 16, the default block size; the CPU's default pool
    is a fixed memory, so a smaller cache dtype holds more tokens) and the accuracy cost.

    The accuracy columns come from ``python -m reference_server.accuracy`` (teacher-forced top-1 agreement
    and mean logit error against the float32 model on a fixed text, greedy-output identity on four prompts),
    run once per configuration with the same flags."""

    def traffic(quick: bool) -> list[PointPlan]:
        decode = MixWorkload("decode128", [RequestClass("decode", 32 if quick else 128, _short_prompt)])
        return [plan for c in (1, 16) for plan in _plans(
            decode, LoadSpec(process="closed", concurrency=c, num_requests=(2 if quick else 6) * c, seed=3))]

    def probe(base_url: str, args: list[str]) -> dict[str, Any]:
        kv_tokens = scrape_metrics(base_url).get("servelab_kv_blocks_total", 0) * 16
        flags = [a for flag in ("--model", "--quantization", "--kv-cache-dtype") if flag in args
                 for a in (flag, args[args.index(flag) + 1])]  # fmt: skip
        res = subprocess.run([sys.executable, "-m", "reference_server.accuracy", *flags], capture_output=True,
                             text=True, timeout=1800)  # fmt: skip
        if res.returncode != 0:
            return {"accuracy_error": res.stderr.strip()[-300:], "kv_tokens": kv_tokens}
        return {**json.loads(res.stdout.strip().splitlines()[-1]), "kv_tokens": kv_tokens}

    def tps(pc: dict[str, list[Summary]], label: str, c: int) -> float | None:
        return next((_get(s, OUT_TPS) for s in pc[label] if s["point_id"] == f"c{c:03d}"), None)

    def verdict(pc: dict[str, list[Summary]], extras: dict[str, dict[str, Any]]) -> str:
        parts = []
        for label in ("int8", "int4", "kv-int8"):
            c1, c16 = _ratio(tps(pc, label, 1), tps(pc, "none", 1)), _ratio(tps(pc, label, 16), tps(pc, "none", 16))
            lost = _ratio(extras["none"].get("top1_agreement", 0) - extras[label].get("top1_agreement", 0), 0.01)
            kv = _ratio(extras[label].get("kv_tokens"), extras["none"].get("kv_tokens"))
            parts.append(f"{label}: c=1 {c1 or 0:.2f}x, c=16 {c16 or 0:.2f}x bf16, KV tokens {kv or 0:.2f}x, "
                         f"top-1 agreement {-(lost or 0):+.1f} points")  # fmt: skip
        return "; ".join(parts)

    def acc(key: str) -> Callable[[Summary, dict[str, Any]], Any]:
        return lambda _s, e: e.get(key)

    return Experiment(
        "quantization", "int4 / int8 weights: faster single-stream decode (fewer bytes per step); an int8 KV cache: "
        "twice the tokens in the same memory; each at a small accuracy cost",
        [Config("none", ["--quantization", "none"]), Config("int8", ["--quantization", "int8"]),
         Config("int4", ["--quantization", "int4"]),
         Config("kv-int8", ["--quantization", "none", "--kv-cache-dtype", "int8"])],  # fmt: skip
        traffic,
        [Column("out tok/s", metric(OUT_TPS)), Column("ttft p50 ms", lambda s, _e: _ms(_get(s, "latency.ttft.p50"))),
         Column("tpot p50 ms", lambda s, _e: _ms(_get(s, "latency.tpot.p50"))),
         Column("KV tokens", acc("kv_tokens"), "{:,.0f}"), Column("top-1 vs fp32", acc("top1_agreement"), "{:.1%}"),
         Column("mean |logit err|", acc("mean_logit_error"), "{:.3f}"),
         Column("greedy identical", acc("greedy_identical"), "{:.0%}")],  # fmt: skip
        verdict,
        probe=probe,
    )


EXPERIMENTS.update({"batching": batching, "chunked-prefill": chunked_prefill, "scheduling": scheduling,
                    "prefix-cache": prefix_cache, "speculative": speculative, "quantization": quantization})  # fmt: skip
