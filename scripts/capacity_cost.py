"""Cost of `bench capacity`'s search against a linear sweep at the same resolution, on the known-answer
service model: median probe-seconds over seeds, per SLO set and mode (virtual time), and optionally live
against the service-model server (``--live``). Writes a JSON record.

    python scripts/capacity_cost.py --seeds 10 --out results/capacity_cost.json [--live 3] [--poisson 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np

from backends.openai import OpenAIBackend
from loadgen.capacity.config import SearchConfig
from loadgen.capacity.live import LiveProber
from loadgen.capacity.search import linear_sweep, search
from loadgen.capacity.sequential import Sequential
from loadgen.dispatch.signals import run_async
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.metrics.slo import parse_slos
from loadgen.testservers.servicemodel import ServiceModel, ServiceModelProcess, SimProber, true_capacity

CASES = [("concurrency", "closed", "tpot_p90=9.5ms"), ("concurrency", "closed", "ttft_p99=40ms"),
         ("concurrency", "closed", "e2e_p90=150ms,error_rate=1%"), ("rate", "constant", "tpot_p90=9.5ms"),
         ("rate", "constant", "ttft_p99=40ms"), ("rate", "constant", "ttft_p90=25ms,tpot_p99=11ms")]  # fmt: skip
POISSON_CASES = [("live", (60, 8), "ttft_p90=60ms"), ("sim", (60, 16), "e2e_p90=150ms"), ("live", (60, 8), "ttft_p90=60ms,tpot_p90=40ms"),
                 ("sim", (60, 16), "ttft_p99=40ms"), ("sim", (60, 16), "ttft_p90=25ms,tpot_p99=11ms")]  # fmt: skip


def fixed_sweep(model: ServiceModel, job: tuple[int, int], slos: list, truth: float, seed: int, probe_s: float,
                aligned: bool) -> tuple[float, float]:  # fmt: skip
    """A linear sweep that places the capacity to ±5 % by point estimates: loads in steps of 5 % of the true
    capacity, every probe ``probe_s`` long (no early stop), until one fails; returns (the last passing load,
    probe-seconds). ``aligned``: the loads are 5 %, 10 %, ... of the capacity, so one of them sits on it (the
    sweep's best case); else the grid starts at a random 5-10 % (per seed), as a user's grid would."""
    first = 0.05 if aligned else 0.05 + 0.05 * float(np.random.default_rng([seed, 7]).random())
    prober, k, last, spent = SimProber(model, job, slos, seed=seed), 0, 0.0, 0.0
    while (x := (first + 0.05 * k) * truth) < 2 * truth:
        # one look at the time cap (its point estimate); a sample cap well above what the probe can send
        seq = Sequential(slos, max_samples=int(1.5 * x * probe_s) + 100, pooled=True)
        p = run_async(prober.probe("rate", x, seq, probe_s, 0, "sweep"))
        spent += p.seconds
        if p.verdict == "fail":
            break
        last, k = x, k + 1
    return last, spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10, help="virtual-time seeds per case (0: none)")
    ap.add_argument("--live", type=int, default=0, help="also run this many seeds live against the server")
    ap.add_argument("--poisson", type=int, default=0, help="seeds of the Poisson-arrival searches (virtual time)")
    ap.add_argument("--budget", type=float, default=600.0, help="probe-seconds of the Poisson searches")
    ap.add_argument("--sweep-s", default="", help="Poisson: probe lengths (s) of a fixed linear sweep that must place "
                    "the capacity to ±5 %% in >= 90 %% of the seeds, e.g. 30,60,120")
    ap.add_argument("--out", type=Path, default=Path("results/capacity_cost.json"))
    args = ap.parse_args()
    model, job = ServiceModel(), (60, 16)
    rows = []
    for mode, process, slo in CASES if args.seeds else []:
        slos = parse_slos(slo, percentiles=True)
        truth = true_capacity(model, job, slos, mode, "constant" if mode == "rate" else "poisson", requests=3000)
        step = max(1.0, round(0.1 * truth)) if mode == "concurrency" else 0.1 * truth
        s_cost, l_cost, hits = [], [], 0
        for seed in range(args.seeds):
            cfg = SearchConfig(mode)
            res = run_async(search(SimProber(model, job, slos, seed=seed, process=process), slos, cfg))
            lo, hi = res.interval
            hits += res.status == "ok" and lo <= truth and (truth < hi if mode == "concurrency" else truth <= hi)
            s_cost.append(res.probe_seconds)
            l_cost.append(run_async(linear_sweep(SimProber(model, job, slos, seed=seed, process=process), slos, cfg,
                                                 step))[0])  # fmt: skip
        row = {"mode": mode, "slo": slo, "truth": truth, "seeds": args.seeds, "interval_hits": hits,
               "search_s_median": statistics.median(s_cost), "linear_s_median": statistics.median(l_cost),
               "ratio": statistics.median(s_cost) / statistics.median(l_cost), "where": "virtual time"}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.live:
        live = ServiceModel(slots=8, prefill_base=0.002, prefill_per_token=0.00005, decode_base=0.002,
                            decode_per_seq=0.004)  # fmt: skip
        wl = FixedWorkload(max_tokens=8, prompt="w " * 60)
        for mode, process, slo in (("concurrency", "closed", "tpot_p90=20ms"), ("rate", "constant", "ttft_p99=20ms")):
            slos = parse_slos(slo, percentiles=True)
            truth = true_capacity(live, (60, 8), slos, mode, "constant", requests=3000)
            step = 1.0 if mode == "concurrency" else 0.1 * truth
            s_cost, l_cost, hits = [], [], 0
            with ServiceModelProcess(live) as url, TemporaryDirectory() as tmp:
                for seed in range(args.live):
                    cfg = SearchConfig(mode, budget_s=300, max_probe_s=30, max_samples=1000)
                    for kind in ("search", "linear"):
                        prober = LiveProber(OpenAIBackend(url, model="null"), wl, slos, Path(tmp) / f"{kind}{seed}",
                                            process=process, seed=seed, timeout=30)  # fmt: skip
                        t = time.monotonic()
                        if kind == "search":
                            res = run_async(search(prober, slos, cfg))
                            lo, hi = res.interval
                            hits += res.status == "ok" and lo <= truth and (truth < hi if mode == "concurrency" else truth <= hi)
                            s_cost.append(res.probe_seconds)
                        else:
                            l_cost.append(run_async(linear_sweep(prober, slos, cfg, step))[0])
                        cost = (s_cost if kind == "search" else l_cost)[-1]
                        print(mode, kind, seed, round(cost, 1), "probe-s", round(time.monotonic() - t, 1), "wall-s", flush=True)
            rows.append({"mode": mode, "slo": slo, "truth": truth, "seeds": args.live, "interval_hits": hits,
                         "search_s_median": statistics.median(s_cost), "linear_s_median": statistics.median(l_cost),
                         "ratio": statistics.median(s_cost) / statistics.median(l_cost), "where": "live"})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    live_model = ServiceModel(slots=8, prefill_base=0.003, prefill_per_token=0.000075, decode_base=0.003,
                              decode_per_seq=0.006)  # tests/support/service_models.py LIVE  # fmt: skip
    for m, job, slo in POISSON_CASES if args.poisson else []:  # Poisson: the soft boundary
        model_p = live_model if m == "live" else model
        slos = parse_slos(slo, percentiles=True)
        truth = true_capacity(model_p, job, slos, "rate", "poisson", requests=20000, seeds=4)
        runs, l_cost = [], []
        for seed in range(args.poisson):
            res = run_async(search(SimProber(model_p, job, slos, seed=seed), slos, SearchConfig("rate", budget_s=args.budget)))
            lo, hi = res.interval
            runs.append({"status": res.status, "interval": [lo, hi], "probe_s": round(res.probe_seconds, 1),
                         "half_width": None if lo is None or hi is None else round((hi - lo) / (hi + lo), 3),
                         "contains": (lo or 0.0) <= truth <= (hi if hi is not None else float("inf"))})  # fmt: skip
            l_cost.append(run_async(linear_sweep(SimProber(model_p, job, slos, seed=seed), slos, SearchConfig("rate"),
                                                 0.1 * truth))[0])  # fmt: skip
        s_med = statistics.median(r["probe_s"] for r in runs)
        rows.append({"mode": "rate", "process": "poisson", "model": m, "slo": slo, "truth": truth, "runs": runs,
                     "interval_hits": sum(r["contains"] for r in runs),
                     "resolved": sum(r["contains"] and r["status"] == "ok" for r in runs),
                     "search_s_median": s_med, "linear_s_median": statistics.median(l_cost),
                     "ratio": s_med / statistics.median(l_cost), "where": "virtual time"})  # fmt: skip
        for aligned, probe_s in itertools.product((True, False), [float(v) for v in args.sweep_s.split(",") if v]):
            sweeps = [fixed_sweep(model_p, job, slos, truth, seed, probe_s, aligned) for seed in range(args.poisson)]
            within = sum(abs(last / truth - 1) <= 0.05 + 1e-9 for last, _ in sweeps)
            rows[-1].setdefault("fixed_sweeps", []).append(
                {"grid": "aligned" if aligned else "random", "probe_s": probe_s, "within_5pct": within,
                 "lasts": [round(x, 2) for x, _ in sweeps], "probe_s_median": statistics.median(c for _, c in sweeps)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
