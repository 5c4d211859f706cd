"""A synthetic results directory for the report's tests and benchmark.

The records come from a small discrete-time simulation of a continuous-batching server (token budget,
max running sequences, step time growing with batch size and prefill tokens) driven by a closed-loop
client, so every series is internally consistent: in-flight counts, server running/waiting, per-step
prefill/decode tokens, KV blocks, CPU load and token timestamps all come from the same simulated steps.
It is test material only; nothing in a real run uses it.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.dispatch.loadspec import LoadSpec
from loadgen.metrics import pointsummary

SLO = {"ttft": 0.5, "tpot": 0.05}


@dataclass
class SimConfig:
    concurrencies: tuple[int, ...] = (1, 4, 16)
    requests_per_point: int = 120
    warmup_per_point: int = 2
    classes: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(
        default_factory=lambda: {"short": ((32, 128), (8, 32)), "long": ((256, 768), (48, 128))}
    )  # class -> ((prompt min, max), (output min, max))
    max_num_seqs: int = 8
    token_budget: int = 1024
    block_size: int = 16
    kv_blocks_total: int = 2048
    error_rate: float = 0.02
    server_state: bool = True
    iterations: bool = True
    telemetry: bool = True
    gpus: int = 0  # NVML GPUs in the telemetry, as loadgen.sidecars.gpu samples them
    seed: int = 0
    speed: float = 1.0  # >1 = a faster simulated server (shorter steps)


@dataclass
class _Seq:
    rid: str
    cls: str
    prompt: int
    out: int
    intended: float
    sent: float
    arrive: float
    fail_at: int | None  # output token count at which the stream disconnects
    generated: int = 0
    events: list[list[float]] = field(default_factory=list)


def _simulate_point(
    cfg: SimConfig, conc: int, t_start: float, rng: np.random.Generator, pfx: str
) -> dict[str, Any]:
    n_total = cfg.requests_per_point + cfg.warmup_per_point
    names = list(cfg.classes)
    records: list[dict[str, Any]] = []
    iters: list[dict[str, Any]] = []
    pending: list[tuple[float, int, _Seq]] = []  # (arrival at server, seq no, seq)
    issued = 0

    def issue(at: float) -> None:
        nonlocal issued
        if issued >= n_total:
            return
        cls = names[int(rng.integers(len(names)))]
        (p_lo, p_hi), (o_lo, o_hi) = cfg.classes[cls]
        sent = at + float(rng.uniform(5e-5, 6e-4))
        out = int(rng.integers(o_lo, o_hi + 1))
        fails = rng.random() < cfg.error_rate
        fail_at = int(rng.integers(0, max(out // 2, 1) + 1)) if fails else None
        seq = _Seq(
            f"{pfx}-{issued:05d}",
            cls,
            int(rng.integers(p_lo, p_hi + 1)),
            out,
            at,
            sent,
            sent + float(rng.uniform(1e-4, 4e-4)),
            fail_at,
        )
        issued += 1
        heapq.heappush(pending, (seq.arrive, issued, seq))

    def finish(seq: _Seq, end: float, error: dict[str, str] | None, status: int | None) -> None:
        records.append(
            {
                "id": seq.rid,
                "cls": seq.cls,
                "warmup": len(records) < cfg.warmup_per_point,
                "intended": round(seq.intended, 6),
                "sent": round(seq.sent, 6),
                "headers": round(seq.sent + 0.0008, 6) if status else None,
                "end": round(end, 6),
                "status": status,
                "error": error,
                "events": [[round(t, 6), k] for t, k in seq.events],
                "prompt_tokens": seq.prompt,
                "prompt_tokens_source": "usage",
                "output_tokens": seq.generated,
                "output_tokens_source": "usage" if error is None else "events",
                "finish_reason": "length" if error is None else None,
                "extra": {},
            }
        )
        issue(end)  # closed loop: the freed slot sends the next request

    for _ in range(conc):
        issue(t_start)
    waiting: list[_Seq] = []
    running: list[_Seq] = []
    t = t_start
    while pending or waiting or running:
        while pending and pending[0][0] <= t:
            seq = heapq.heappop(pending)[2]
            if seq.fail_at == 0:  # refused at once: an HTTP 500 with an error body
                seq.events = []
                finish(
                    seq,
                    seq.arrive + 0.002,
                    {"kind": "http_5xx", "message": "HTTP 500: engine overloaded"},
                    500,
                )
            else:
                waiting.append(seq)
        if not waiting and not running:
            t = pending[0][0] if pending else t
            continue
        budget = cfg.token_budget - len(running)
        admitted: list[_Seq] = []
        while (
            waiting
            and len(running) + len(admitted) < cfg.max_num_seqs
            and (waiting[0].prompt <= budget or not (running or admitted))
        ):
            seq = waiting.pop(0)
            budget -= seq.prompt
            admitted.append(seq)
        prefill = sum(s.prompt for s in admitted)
        decode = len(running)
        dt = (0.004 + 0.0009 * (decode + len(admitted)) + 0.000012 * prefill) / cfg.speed
        t_end = t + dt * float(rng.uniform(0.95, 1.08))
        batch = running + admitted
        kv_used = sum(math.ceil((s.prompt + s.generated + 1) / cfg.block_size) for s in batch)
        iters.append(
            {
                "t0": t,
                "t": t_end,
                "request_ids": [s.rid for s in batch],
                "prefill_tokens": prefill,
                "decode_tokens": decode,
                "kv_blocks_used": kv_used,
                "kv_blocks_total": cfg.kv_blocks_total,
                "waiting": len(waiting),
            }
        )
        still: list[_Seq] = []
        for seq in batch:
            seq.generated += 1
            seq.events.append([t_end + float(rng.uniform(1e-4, 5e-4)), 1])
            if seq.fail_at is not None and seq.generated >= seq.fail_at:
                finish(
                    seq,
                    seq.events[-1][0] + 0.001,
                    {"kind": "disconnect", "message": "connection dropped mid-stream"},
                    200,
                )
            elif seq.generated >= seq.out:
                finish(seq, seq.events[-1][0] + 0.0002, None, 200)
            else:
                still.append(seq)
        running = still
        t = t_end
    records.sort(key=lambda r: r["end"])
    return {"records": records, "iterations": iters, "t_end": t}


def _dump_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def write_synthetic_results(root: Path, run_id: str = "synthetic", cfg: SimConfig | None = None) -> Path:
    """Write ``root/run_id`` in the results layout and return its path."""
    cfg = cfg or SimConfig()
    rng = np.random.default_rng(cfg.seed)
    out = Path(root) / run_id
    t0_unix = time.time() - 3600.0
    t = 0.05
    points: list[dict[str, Any]] = []
    for conc in cfg.concurrencies:
        pid = f"c{conc:03d}"
        pdir = out / "points" / pid
        pdir.mkdir(parents=True, exist_ok=True)
        sim = _simulate_point(cfg, conc, t, rng, pid)
        _dump_jsonl(pdir / "requests.jsonl", sim["records"])
        its = sim["iterations"]
        if (
            cfg.iterations
        ):  # GET /v1/iterations records as the poller stores them (``t``: step start, run clock)
            rows = [
                {
                    "i": n,
                    "t_unix": round(t0_unix + it["t0"], 6),
                    "t_end_unix": round(t0_unix + it["t"], 6),
                    "seq_ids": it["request_ids"],
                    "prefill_tokens": it["prefill_tokens"],
                    "decode_tokens": it["decode_tokens"],
                    "kv_blocks_used": it["kv_blocks_used"],
                    "kv_blocks_total": it["kv_blocks_total"],
                    "num_running": len(it["request_ids"]),
                    "num_waiting": it["waiting"],
                    "preempted": [],
                    "t": round(it["t0"], 6),
                }
                for n, it in enumerate(its)
            ]
            _dump_jsonl(pdir / "iterations.jsonl", rows)
        step_t = np.array([it["t"] for it in its])
        ticks = np.arange(t, sim["t_end"], 0.1)
        if cfg.server_state:  # as loadgen.sidecars.poller writes it: Prometheus keys with labels, scrape latency
            rows = []
            for ts in ticks:
                i = int(np.searchsorted(step_t, ts)) - 1
                it = its[i] if i >= 0 else {"request_ids": [], "waiting": 0, "kv_blocks_used": 0}
                lbl = "{engine=0,model_name=synthetic}"
                rows.append(
                    {
                        "t": round(float(ts), 6),
                        "metrics": {
                            f"vllm:num_requests_running{lbl}": float(len(it["request_ids"])),
                            f"vllm:num_requests_waiting{lbl}": float(it["waiting"]),
                            f"vllm:kv_cache_usage_perc{lbl}": round(
                                it["kv_blocks_used"] / cfg.kv_blocks_total, 5
                            ),
                            f"vllm:generation_tokens_total{lbl}": float(np.searchsorted(step_t, ts)),
                        },
                        "latency_s": round(float(rng.uniform(0.001, 0.004)), 6),
                    }
                )
            _dump_jsonl(pdir / "server_state.jsonl", rows)
        if cfg.telemetry:  # as loadgen.sidecars.telemetry writes host samples
            rows = []
            for ts in ticks:
                busy = float(((step_t > ts - 0.1) & (step_t <= ts)).any())
                cores = [round(float(np.clip(8 + 85 * busy + rng.normal(0, 4), 0, 100)), 1) for _ in range(2)]
                rows.append(
                    {
                        "t": round(float(ts), 6),
                        "cpu_pct": cores,
                        "mem_used_b": int(3.1e9 + 1e6 * rng.normal(0, 5)),
                        "mem_total_b": 24_000_000_000,
                        "client_cpu_pct": round(float(rng.uniform(2, 6)), 1),
                        "server_cpu_pct": round(float(np.clip(170 * busy + rng.normal(10, 5), 0, 200)), 1),
                    }
                )
                if cfg.gpus:
                    rows[-1]["gpus"] = [{"index": i, "util": 90.0 * busy, "mem_util": 40.0 * busy,
                                         "mem_used_b": 70 * 2**30 + i, "mem_total_b": 80 * 2**30,
                                         "power_w": 120.0 + 500 * busy, "sm_clock_mhz": 1980.0 - i}
                                        for i in range(cfg.gpus)]  # fmt: skip
            _dump_jsonl(pdir / "telemetry.jsonl", rows)
        load = LoadSpec(
            process="closed",
            concurrency=conc,
            num_requests=cfg.requests_per_point,
            warmup=cfg.warmup_per_point,
            seed=cfg.seed,
        ).describe()
        summary = {
            "point_id": pid,
            "load": load,
            "labels": {},
            "t_start": t,
            "t_end": sim["t_end"],
            **pointsummary.summarize(sim["records"], load, SLO),
        }
        (pdir / "summary.json").write_text(json.dumps(summary, indent=1))
        points.append(summary)
        t = sim["t_end"] + 0.5
    config = {
        "backend": "synthetic",
        "concurrency": list(cfg.concurrencies),
        "requests": cfg.requests_per_point,
    }
    (out / "run.json").write_text(
        json.dumps(
            {
                "run_id": run_id,
                "t0_unix": t0_unix,
                "config": config,
                "points": [p["point_id"] for p in points],
            },
            indent=1,
        )
    )
    (out / "summary.json").write_text(
        json.dumps(
            {
                "run_id": run_id,
                "config": config,
                "environment": {"cpu": "synthetic"},
                "fingerprint": "synthetic",
                "points": points,
            },
            indent=1,
        )
    )
    return out
