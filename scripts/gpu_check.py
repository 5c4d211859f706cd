"""``make gpu-check``: the reference server on a GPU, checked and measured in one prepared run.

A GPU machine is lent to this project now and then, for 15 minutes in all, so this script is the whole
check, rehearsed on CPU (``--rehearse``: CPU device, tiny shapes, small counts; ``tests/test_gpu_check.py``)
before the GPU ever sees it. It makes its own models (the bundled 98 MB GGUF cannot travel): seeded weights
in the SmolLM2-135M shape and in bigger Llama shapes (Llama 3.2 1B's and 3.1 8B's layers), written as GGUF files
with the bundled model's tokenizer (``--tokenizer-gguf``: the bundled model itself, or the metadata-only
GGUF that ``--export-tokenizer`` writes for carrying), so the server loads them as it loads any model.

The checks, each independent (a failure is recorded and the next one runs), in order of value:
- ``pytest``: the engine tests (greedy invariance under prefix caching, chunked prefill and preemption; the
  paged forward against a dense recompute) and the Triton kernel against its float32 reference, run by pytest
  on this device with the small seeded model as the bundled one (``$SERVELAB_MODEL``).
- ``identity``: the same seeded weights, greedy, float32: CPU (PyTorch ops) and the device (Triton kernel,
  CUDA graphs) must give the same tokens; the device's bf16 default path against its float32 one is reported
  (agreement share, and where they part, the float32 logit margin between the two tokens).
- ``decode``: the decode step at c = 64 (bf16, CUDA graphs) of the small shape, Llama 1B's and Llama 8B's: its
  GPU time (graph replays timed with events) and the engine step's wall time, against the bandwidth bound
  (weights + KV bytes read per step over the device-to-device copy rate measured here), judged on the 8B
  shape: on an H100 the 135M and the 1B shapes' steps both took ~1.6 ms of GPU time at c = 1, i.e. a fixed
  cost per layer's kernels, not bytes, sets them; CUDA graphs on vs off for each shape.
- ``batching``: continuous batching (the engine, 64 slots) against a plain ``transformers`` static batch
  (``generate`` on batches of 64, each run to its longest output: the seeds' "naive" baseline) on the same
  device and shape, same requests: output tokens per second.
- ``sweep``: ``bench sweep`` against the reference server (started by the harness) at c = 1/16/64/256 with
  NVML telemetry on; the GPU utilisation, memory, power and SM clock series are counted in its results.

Writes ``OUT/gpu_check.json`` (figures and verdicts) and ``OUT/gpu_check.log`` and copies the sweep's
report; the last lines printed are a short table. ``--budget-s`` bounds the whole run: a check that would
start past it is recorded as not run.

    python3 scripts/gpu_check.py --out DIR                  # on the GPU machine (make gpu-check PY=python3)
    python3 scripts/gpu_check.py --rehearse --out DIR       # on CPU, tiny shapes
    python3 scripts/gpu_check.py --export-tokenizer .gpu/tokenizer.gguf
"""


from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from gpu_check_plan import CHECKS, GPU_PLAN, REHEARSAL_PLAN, REPO, Context, Log, Plan, Record, dig

sys.path.insert(0, str(REPO))

from gpu_check_engine import check_batching, check_decode, check_identity, copy_bandwidth  # noqa: E402
from gpu_check_harness import check_pytest, check_sweep  # noqa: E402
from gpu_check_models import SHAPES, export_tokenizer, write_seeded_gguf  # noqa: E402

from reference_server.model_files import default_model_path  # noqa: E402

RUNNERS: dict[str, Callable[[Context], Record]] = {
    "pytest": check_pytest, "identity": check_identity, "decode": check_decode, "batching": check_batching,
    "sweep": check_sweep,
}


@contextlib.contextmanager
def timed(record: Record) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        record["seconds"] = round(time.perf_counter() - t0, 2)


def environment(device: str) -> Record:
    import triton

    env: Record = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                   "device": device, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count)
    from loadgen.sidecars.gpu import gpu_inventory

    env["nvml"] = gpu_inventory()
    return env


def verdicts(results: Record) -> Record:
    """The issue's acceptance figures and verdicts, from the checks' records: a check's ``ok`` says it ran
    and its outputs were right; these say whether the GPU met its targets (None: not measured here)."""
    c = results["checks"]
    get = lambda name, *keys: dig(c.get(name, {}), keys)  # noqa: E731
    judged = get("decode", "judged")
    over = get("decode", judged, "gpu_over_bound")
    gain = get("batching", "gain", "varied")
    return {
        "engine_tests_on_device": get("pytest", "ok"),
        "greedy_identity_cpu_eq_device": get("identity", "ok"),
        "decode_judged_shape": judged,
        "decode_gpu_over_bound": over,
        "decode_wall_over_bound": get("decode", judged, "wall_over_bound"),
        "decode_gpu_within_2x_bound": None if over is None else over <= 2.0,
        "graphs_gain": {k: get("decode", k, "graphs_gain") for k in results["plan"]["decode"]},
        "continuous_over_static": get("batching", "gain"),
        "continuous_at_least_3x_static": None if gain is None else gain >= 3.0,
        "sweep_zero_errors": get("sweep", "ok"),
        "nvml_series_in_report": get("sweep", "nvml_ok"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for gpu_check.json, gpu_check.log and the sweep's report")
    ap.add_argument("--rehearse", action="store_true", help="CPU device, tiny shapes, small counts")
    ap.add_argument("--big", choices=sorted(SHAPES), help=f"the big shape (default {GPU_PLAN.big})")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    ap.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time limit (default: 450)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the models and the sweep (default: OUT/work)")
    ap.add_argument("--tokenizer-gguf", type=Path, default=None,
                    help="GGUF whose tokenizer the seeded models get (default: .gpu/tokenizer.gguf, else the bundled model)")
    ap.add_argument("--export-tokenizer", type=Path, default=None, metavar="PATH",
                    help="only write the tokenizer-only GGUF (from --tokenizer-gguf) to PATH and exit")
    args = ap.parse_args(argv)
    carried = REPO / ".gpu" / "tokenizer.gguf"
    tokenizer = args.tokenizer_gguf or (carried if carried.is_file() else None)
    if args.export_tokenizer:
        export_tokenizer(tokenizer or default_model_path(), args.export_tokenizer)
        print(f"wrote {args.export_tokenizer} ({args.export_tokenizer.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if args.out is None:
        ap.error("--out is required")
    checks = [c for c in args.checks.split(",") if c]
    if unknown := set(checks) - set(CHECKS):
        ap.error(f"unknown checks {sorted(unknown)}: choose from {', '.join(CHECKS)}")
    plan = REHEARSAL_PLAN if args.rehearse else GPU_PLAN
    if args.big:
        plan = Plan(**{**asdict(plan), "big": args.big})
    if plan.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: run with --rehearse on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "gpu_check.log")
    ctx = Context(plan, args.out, work, log, time.perf_counter() + args.budget_s)
    results: Record = {"plan": asdict(plan), "environment": environment(plan.device), "checks": {}}
    log(f"environment: {results['environment']}")
    try:
        ctx.tokenizer = tok = tokenizer or default_model_path()
        with timed(results.setdefault("models", {})):
            ctx.small_path = write_seeded_gguf(tok, work / f"{plan.small}.gguf", plan.small, SHAPES[plan.small], 0, plan.device)
            ctx.big_path = write_seeded_gguf(tok, work / f"{plan.big}.gguf", plan.big, SHAPES[plan.big], 1, plan.device)
        results["models"].update(tokenizer=str(tok), small=plan.small, big=plan.big,
                                 big_file_gib=round(ctx.big_path.stat().st_size / 2**30, 2))
        log(f"models: {results['models']}")
        ctx.bandwidth = copy_bandwidth(plan.device, 2**31 if plan.device.startswith("cuda") else 2**26)
        log(f"device-to-device copy: {ctx.bandwidth / 1e9:.0f} GB/s (read + write)")
    except Exception as exc:  # no models: nothing else can run
        results["models"]["error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
        checks = []
    for name in checks:
        rec: Record = {}
        if ctx.deadline - time.perf_counter() < 10:
            rec = {"ok": None, "error": "not run: out of time (--budget-s)"}
        else:
            log(f"== {name}")
            with timed(rec):
                try:
                    rec.update(RUNNERS[name](ctx))
                except Exception as exc:
                    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                    log(traceback.format_exc())
        results["checks"][name] = rec
        log(f"{name}: {json.dumps(rec, default=str)[:3000]}")
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    results["acceptance"] = verdicts(results)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    log("summary:")
    for name in checks:
        r = results["checks"][name]
        log(f"  {name:9s} ok={r.get('ok')!s:5s} {r.get('seconds', '-')!s:>6s}s {r.get('error', '')}")
    for k, v in results["acceptance"].items():
        log(f"  {k}: {json.dumps(v, default=str)}")
    return 0 if all(results["checks"][n].get("ok") is not False for n in checks) and checks else 1


if __name__ == "__main__":
    sys.exit(main())
