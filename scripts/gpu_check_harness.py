"""``make gpu-check``'s checks that run the project's own programs on the device: ``pytest`` (the engine and
kernel tests) and ``sweep`` (``bench sweep`` against the reference server, NVML telemetry on)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_check_plan import REPO, Context, Record, dig

from reference_server.model_files import MODEL_ENV

NVML_SERIES = {"util": "GPU utilisation", "mem_used_b": "memory used", "power_w": "power", "sm_clock_mhz": "SM clock"}


def child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH: the subprocesses (pytest, bench sweep and the
    server it starts) import the project from the tree, installed or not."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def check_pytest(ctx: Context) -> Record:
    env = {**child_env(), MODEL_ENV: str(ctx.small_path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ctx.plan.pytest]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.left(), check=False)
    ctx.log(proc.stdout[-4000:] + proc.stderr[-2000:])
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors)", proc.stdout)}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    return {"ok": ok, "returncode": proc.returncode, "passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "files": list(ctx.plan.pytest), "model": str(ctx.small_path)}


def _series(points: Path) -> Record:
    """Samples per NVML series in the sweep's telemetry, over all its points."""
    counts = dict.fromkeys(NVML_SERIES, 0)
    gpus: set[str] = set()
    for f in points.rglob("telemetry.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            for g in rec.get("gpus") or []:
                gpus.add(str(g.get("index")))
                for k in NVML_SERIES:
                    counts[k] += g.get(k) is not None
    return {"gpus": sorted(gpus), "samples": counts}


def check_sweep(ctx: Context) -> Record:
    plan = ctx.plan
    run = ctx.work / "sweep"
    workload = ctx.work / "gpu-check.toml"
    workload.write_text(f'api = "completions"\n[arrival]\nprocess = "closed"\nconcurrency = 1\n[[classes]]\n'
                        f'name = "fixed"\nprompt = {plan.prompt}\noutput = 128\nignore_eos = true\ntemperature = 0.0\n')
    server = (f"{sys.executable} -m reference_server --model {ctx.big_path} --port {{port}} "
              f"--max-num-seqs {max(plan.sweep)} --device {plan.device}")
    cmd = [sys.executable, "-c", "from loadgen.cli.app import main; main()", "sweep", "--server", server, "--workload", str(workload),
           "--concurrency", ",".join(map(str, plan.sweep)), "--duration", str(plan.sweep_s),
           "--tokenizer", str(ctx.big_path), "--output-dir", str(ctx.work), "--run-id", "sweep", "--warmup", "4"]
    env = child_env()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.left(), check=False)
    ctx.log(proc.stdout[-6000:] + proc.stderr[-3000:])
    points = []
    for f in sorted((run / "points").rglob("summary.json"), key=lambda p: p.stat().st_mtime):
        s = json.loads(f.read_text())
        lat = s.get("latency", {})
        points.append({"point": f.parent.name, "requests": s["counts"]["requests"], "errors": s["counts"]["errors"],
                       "output_tok_s": dig(s, ("throughput", "steady", "output_tok_per_s")),
                       "ttft_p50_ms": 1e3 * lat["ttft"]["p50"] if lat.get("ttft") else None,
                       "itl_p50_ms": 1e3 * lat["itl"]["p50"] if lat.get("itl") else None})
    series = _series(run / "points")
    report = run / "report.html"
    if report.is_file():
        shutil.copy(report, ctx.out / "sweep_report.html")
    nvml = all(series["samples"][k] > 0 for k in NVML_SERIES) if plan.device.startswith("cuda") else None
    errors = sum(p["errors"] for p in points)
    return {"returncode": proc.returncode, "points": points, "errors": errors, "nvml": series, "nvml_ok": nvml,
            "report": report.is_file(), "ok": proc.returncode == 0 and len(points) == len(plan.sweep) and errors == 0}
