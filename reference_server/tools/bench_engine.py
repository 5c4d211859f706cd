"""Engine-only throughput, no HTTP: ``python -m reference_server.tools.bench_engine --concurrency 16``.

Starts ``concurrency`` greedy requests with short prompts and ``--output-tokens`` each (EOS ignored),
steps the engine to completion and prints output tokens per second (warm-up steps excluded)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from reference_server.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.sequence import SamplingParams
from reference_server.model_files import default_model_path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m reference_server.tools.bench_engine", description=__doc__)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="weights (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV cache (default: auto)")
    p.add_argument("--threads", type=int, default=None, help="default: as the server (all cores if idle, else 1)")
    p.add_argument("--profile", action="store_true", help="print the torch profiler's top ops")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto, as the server)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: decode steps as CUDA graphs (default: on)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest --concurrency (at least 64)")
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model or default_model_path(), dtype=args.dtype, threads=args.threads,
                                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                 enable_prefix_caching=False, device=args.device,
                                 cuda_graphs=args.cuda_graphs,
                                 max_num_seqs=args.max_num_seqs or max(64, *args.concurrency)))
    print(f"device {engine.runner.device} dtype {engine.runner.dtype} weights {engine.runner.quantization_note} "
          f"KV {engine.runner.kv_capacity()} "
          f"threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()}")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    for c in args.concurrency:
        prompts = [[(7 * i + j) % 4000 + 100 for j in range(args.prompt_tokens)] for i in range(c)]
        for pr in prompts:
            engine.add_request(pr, params)
        engine.step()  # prefill (and first token)
        steps, tokens, t0 = 0, 0, time.perf_counter()
        prof = None
        if args.profile:
            from torch.profiler import profile

            prof = profile()
            prof.__enter__()
        while engine.scheduler.has_work():
            tokens += len(engine.step())
            steps += 1
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        print(f"concurrency {c:3d}: {tokens / dt:7.1f} output tok/s, {dt / steps * 1000:6.2f} ms/step ({steps} steps)")


if __name__ == "__main__":
    main()
