"""Named experiments (``bench experiment NAME``): each states the claim it tests, its server
configurations, its points, its table's columns and the verdict computed from the measured table.
Their traffic is data: workload files (``workloads/experiments/*.toml`` and built-ins) read by the one
workload loader. The machinery that runs one is :mod:`loadgen.experiments.experiment`.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.sweep import PointPlan
from loadgen.experiments.experiment import (
    SPEC,
    Column,
    Config,
    Experiment,
    Summary,
    figure,
    greedy_outputs,
    metric,
    scrape_metrics,
    value_at,
)
from loadgen.metrics.definitions import E2E, ITL, OUTPUT_TOK_S, REQ_S, TPOT, TTFT
from reference_server import metric_names
from workloads.base import Workload
from workloads.loader import load_workload
from workloads.spec import EXPERIMENTS_DIR

# -- the experiments ---------------------------------------------------------------------------------

EXPERIMENTS: dict[str, Callable[[], Experiment]] = {}


def _plans(workload: Workload, load: LoadSpec, prefix: str | None = None) -> list[PointPlan]:
    return [PointPlan(load.point_id() if prefix is None else f"{prefix}/{load.point_id()}", workload, load)]


# -- traffic ---------------------------------------------------------------------------------------


def _workload(name: str, **overrides: Any) -> Workload:
    """An experiment's traffic: ``workloads/experiments/NAME.toml``, else the built-in ``NAME``."""
    path = EXPERIMENTS_DIR / f"{name}.toml"
    return load_workload(str(path) if path.is_file() else name, **overrides)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _first(per_config: dict[str, list[Summary]], label: str, path: str) -> Any:
    return value_at(per_config[label][0], path)


OUT_TPS = ".".join(OUTPUT_TOK_S.whole())  # the experiments compare whole-run rates
OUT_TOK_S = Column(OUTPUT_TOK_S.label, metric(OUT_TPS))
REQ_S_WHOLE = Column(REQ_S.label, metric(".".join(REQ_S.whole())), "{:.2f}")


def batching() -> Experiment:
    """Static vs dynamic vs continuous batching on a 50 % short / 50 % long output mix.

    Every configuration has the same KV pool. Static and dynamic batching reserve each request's whole
    span (prompt + max_tokens) up front, as padded batches do, and admit nobody until the batch ends."""

    def traffic(quick: bool) -> list[PointPlan]:
        return _plans(_workload("batching-quick" if quick else "batching"), LoadSpec(process="closed", concurrency=16, num_requests=40 if quick else 64, seed=1))

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
        [OUT_TOK_S, REQ_S_WHOLE, figure(E2E, "p50"), figure(E2E, "p99"), figure(TTFT, "p99"), figure(E2E, "p99", "short")],
        verdict,
        common_args=["--max-num-seqs", "16", "--batch-size", "16", "--num-kv-blocks", "192", "--max-model-len", "512"],
    )


def chunked_prefill() -> Experiment:
    """Four streams decode while 2,000-token prompts arrive: the streams' ITL with and without chunking."""

    def traffic(quick: bool) -> list[PointPlan]:
        # the schedule in the file is the full run; --quick sends its first six requests (two long prompts)
        return _plans(_workload("chunked-prefill"),
                      LoadSpec(process="trace", num_requests=6 if quick else 8, seed=2, stall_timeout=300))  # fmt: skip

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
        [*(figure(ITL, stat, "decode", shown=True, fmt="{:.1f}") for stat in ("p50", "p99", "max")),
         figure(TTFT, "p50", "long-prompt"), OUT_TOK_S],  # fmt: skip
        verdict,
        common_args=["--no-enable-prefix-caching"],
    )


def scheduling() -> Experiment:
    """FIFO vs SJF vs priority on a queue of short, long and urgent requests arriving in a burst."""
    wl = _workload("scheduling")

    def traffic(quick: bool) -> list[PointPlan]:
        return _plans(wl, LoadSpec(process="constant", rate=20.0, num_requests=20 if quick else 60, seed=3))

    def verdict(pc: dict[str, list[Summary]], _e: dict[str, dict[str, Any]]) -> str:
        mean = {k: _first(pc, k, "latency.e2e.mean") for k in pc}
        urgent = {k: _first(pc, k, "per_class.urgent.latency.e2e.mean") for k in pc}
        return (f"mean e2e fifo {mean['fifo']:.2f}s, sjf {mean['sjf']:.2f}s; urgent mean e2e fifo "
                f"{urgent['fifo']:.2f}s, priority {urgent['priority']:.2f}s")  # fmt: skip

    cols = [figure(E2E, stat, c) for c in (None, "short", "long", "urgent") for stat in ("mean", "p99")]
    return Experiment(
        "scheduling", "SJF lowers mean latency; priority serves urgent work first",
        [Config(p, ["--policy", p]) for p in ("fifo", "sjf", "priority")], traffic, cols, verdict,
        common_args=["--max-num-seqs", "4"],
    )


def prefix_cache() -> Experiment:
    """A shared 1,000-token system prompt: TTFT with the prefix cache on and off."""
    wl = _workload("prefix-cache")

    def traffic(quick: bool) -> list[PointPlan]:
        return _plans(wl, LoadSpec(process="closed", concurrency=4, num_requests=8 if quick else 32, seed=4))

    def verdict(pc: dict[str, list[Summary]], _e: dict[str, dict[str, Any]]) -> str:
        r = _ratio(_first(pc, "cache-off", "latency.ttft.p50"), _first(pc, "cache-on", "latency.ttft.p50"))
        return f"TTFT p50 off / on = {r:.1f}x" if r else "incomplete"

    return Experiment(
        "prefix-cache", "prefix caching multiplies effective capacity for shared prompts",
        [Config("cache-off", ["--no-enable-prefix-caching"]), Config("cache-on", [])], traffic,
        [figure(TTFT, "p50", fmt="{:.3f}"), figure(TTFT, "p99", fmt="{:.3f}"), OUT_TOK_S, REQ_S_WHOLE],
        verdict,
    )


def speculative() -> Experiment:
    """Speculation off / n-gram / self-draft on a predictable code-edit workload and a creative one."""

    def traffic(quick: bool) -> list[PointPlan]:
        n, out = (2, 64) if quick else (6, 128)  # quick: the self-draft config alone ran ~80 s at 128 tokens
        edit, creative = _workload("code-edit", output=out), _workload("creative", output=out)
        load = LoadSpec(process="closed", concurrency=1, num_requests=n, seed=5)
        return _plans(edit, load, "code-edit") + _plans(creative, load, "creative")

    def probe(base_url: str, _args: list[str]) -> dict[str, Any]:
        edits = itertools.islice(_workload("code-edit").sessions(0), 2)
        return {"outputs": greedy_outputs(base_url, [str(s.first().prompt) for s in edits], 48)}

    def verdict(pc: dict[str, list[Summary]], extras: dict[str, dict[str, Any]]) -> str:
        def tps(label: str, point: str) -> float | None:
            return next((value_at(s, OUT_TPS) for s in pc[label] if s["point_id"].startswith(point)), None)

        speed = _ratio(tps("ngram", "code-edit"), tps("off", "code-edit"))
        same = all(extras[k]["outputs"] == extras["off"]["outputs"] for k in extras)
        creative_acc = next((value_at(s, f"{SPEC}.acceptance_rate") for s in pc["ngram"] if s["point_id"].startswith("creative")), None)
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
        [OUT_TOK_S, figure(TPOT, "mean", shown=True, fmt="{:.1f}"),
         Column("acceptance", metric(f"{SPEC}.acceptance_rate"), "{:.0%}"),
         Column("drafted", metric(f"{SPEC}.drafted"), "{:.0f}")],  # fmt: skip
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

    The accuracy columns come from ``python -m reference_server.tools.accuracy`` (teacher-forced top-1 agreement
    and mean logit error against the float32 model on a fixed text, greedy-output identity on four prompts),
    run once per configuration with the same flags."""

    def traffic(quick: bool) -> list[PointPlan]:
        decode = _workload("decode", output=32 if quick else None)
        return [plan for c in (1, 16) for plan in _plans(
            decode, LoadSpec(process="closed", concurrency=c, num_requests=(2 if quick else 6) * c, seed=3))]

    def probe(base_url: str, args: list[str]) -> dict[str, Any]:
        kv_tokens = scrape_metrics(base_url).get(metric_names.KV_BLOCKS_TOTAL, 0) * 16
        flags = [a for flag in ("--model", "--quantization", "--kv-cache-dtype") if flag in args
                 for a in (flag, args[args.index(flag) + 1])]  # fmt: skip
        res = subprocess.run([sys.executable, "-m", "reference_server.tools.accuracy", *flags], capture_output=True,
                             text=True, timeout=1800)  # fmt: skip
        if res.returncode != 0:
            return {"accuracy_error": res.stderr.strip()[-300:], "kv_tokens": kv_tokens}
        return {**json.loads(res.stdout.strip().splitlines()[-1]), "kv_tokens": kv_tokens}

    def tps(pc: dict[str, list[Summary]], label: str, c: int) -> float | None:
        return next((value_at(s, OUT_TPS) for s in pc[label] if s["point_id"] == f"c{c:03d}"), None)

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
        [OUT_TOK_S, figure(TTFT, "p50", shown=True, fmt="{:.1f}"), figure(TPOT, "p50", shown=True, fmt="{:.1f}"),
         Column("KV tokens", acc("kv_tokens"), "{:,.0f}"), Column("top-1 vs fp32", acc("top1_agreement"), "{:.1%}"),
         Column("mean |logit err|", acc("mean_logit_error"), "{:.3f}"),
         Column("greedy identical", acc("greedy_identical"), "{:.0%}")],  # fmt: skip
        verdict,
        probe=probe,
    )


EXPERIMENTS.update({"batching": batching, "chunked-prefill": chunked_prefill, "scheduling": scheduling,
                    "prefix-cache": prefix_cache, "speculative": speculative, "quantization": quantization})  # fmt: skip
