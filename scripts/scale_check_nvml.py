"""``make scale-check``'s NVML part: a torch matmul loop keeps GPU 0 busy at set duty cycles while the project's
NVML module and ``nvidia-smi`` read its utilisation side by side."""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from scale_check_report import NVML_TOLERANCE, Budget, log

from loadgen.sidecars.gpu import host_gpus

DUTY = "0,0.25,0.5,0.75,1"  # duty-cycle steps of the GPU load
SETTLE_S = 1.0  # the start of each step left out of its means: NVML's utilisation averages over a window
SAMPLE_S = 0.1  # NVML sampler and nvidia-smi loop period
DUTY_PERIOD_S = 0.1  # the GPU load is busy for duty x this, then idle for the rest, over and over
MATMUL_N = 4096  # the load's square bf16 matmul (~0.2-0.3 ms on an H100: fine steps of busy time)
SMI_QUERY = "timestamp,utilization.gpu"
SMI_TIME = "%Y/%m/%d %H:%M:%S.%f"


def parse_smi(text: str) -> list[tuple[float, float]]:
    """(Unix time, utilisation %) of each reading in ``nvidia-smi --query-gpu=timestamp,utilization.gpu
    --format=csv,noheader,nounits`` output (the timestamp is the machine's local time). Lines that are not a
    reading (a header, ``[N/A]``, a torn last line) are left out."""
    out = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        try:
            out.append((datetime.strptime(row[0], SMI_TIME).timestamp(), float(row[1])))
        except (IndexError, ValueError):
            continue
    return out


def compare_steps(
    steps: list[tuple[float, float, float]], nvml: list[tuple[float, float]], smi: list[tuple[float, float]],
    settle: float = SETTLE_S,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per duty-cycle step ``(duty, start, end)`` (Unix times): the mean utilisation of the NVML samples and
    of the nvidia-smi readings (``(time, %)``) in ``[start + settle, end]``, their difference (NVML minus
    nvidia-smi, points) and whether it is within :data:`NVML_TOLERANCE` (False when a side has no reading)."""
    rows = []
    for duty, start, end in steps:
        means = []
        for samples in (nvml, smi):
            got = [u for t, u in samples if start + settle <= t <= end]
            means.append((sum(got) / len(got) if got else None, len(got)))
        (a, na), (b, nb) = means
        diff = a - b if a is not None and b is not None else None
        rows.append({"duty": duty, "nvml_util": a, "smi_util": b, "diff": diff, "n_nvml": na, "n_smi": nb,
                     "within": diff is not None and abs(diff) <= NVML_TOLERANCE})  # fmt: skip
    return rows


def gpu_missing() -> str | None:
    """Why the NVML part cannot run here (no GPU through NVML, no nvidia-smi, no CUDA in torch), or None."""
    probes, line = host_gpus()
    if not probes:
        return line
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found on PATH"
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU load is a torch matmul loop)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


@contextlib.contextmanager
def _on_thread(target: Callable[[], None], stop: Callable[[], None], join_s: float | None = None) -> Iterator[None]:
    """``target`` on a daemon thread while the block runs; then ``stop()`` ends it and the thread is joined
    (for at most ``join_s`` seconds; None: until it ends)."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop()
        thread.join(join_s)


@contextlib.contextmanager
def _sampling(every: float, sample: Callable[[], float | None]) -> Iterator[list[tuple[float, float]]]:
    """``(time.time(), sample())`` every ``every`` seconds on a thread while the block runs (None: no reading)."""
    out: list[tuple[float, float]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            if (value := sample()) is not None:
                out.append((time.time(), value))

    with _on_thread(loop, stop.set):
        yield out


def _busy(duty: float, seconds: float) -> None:
    """GPU 0 busy for ``duty`` of every :data:`DUTY_PERIOD_S` (back-to-back matmuls), idle for the rest."""
    import torch

    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    end = time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        while time.perf_counter() < t + duty * DUTY_PERIOD_S:
            torch.mm(a, a, out=c)
            torch.cuda.synchronize()
        time.sleep(max(0.0, t + DUTY_PERIOD_S - time.perf_counter()))


@contextlib.contextmanager
def tty_output(argv: list[str]) -> Iterator[list[bytes]]:
    """Run ``argv`` with its output on a pseudo-terminal while the block runs, then stop it (SIGTERM); yields
    the list its output is appended to. On a terminal, C stdio writes each line as it ends; into a pipe the
    output would be block-buffered, and what is still buffered lost when the program is stopped."""
    ctl, tty = os.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=tty, stderr=tty)
    os.close(tty)
    chunks: list[bytes] = []

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the program has gone
            while chunk := os.read(ctl, 65536):
                chunks.append(chunk)

    def terminate() -> None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    try:
        with _on_thread(read, terminate, join_s=5):
            yield chunks
    finally:
        os.close(ctl)


def nvml_part(duties: list[float], step_s: float, budget: Budget) -> dict[str, Any]:
    """The duty-cycle steps, sampled by the project's NVML module and by ``nvidia-smi`` (see the module
    docstring; ``nvidia-smi`` writes to a pseudo-terminal: :func:`tty_output`)."""
    missing = gpu_missing()
    if missing is not None:
        return {"status": "not run", "reason": missing}
    if (need := 1.0 + len(duties) * step_s) > budget.left():
        return {"status": "not run", "reason": f"its {need:.0f} s do not fit the {budget.left():.0f} s of budget left"}
    probe = host_gpus()[0][0]
    steps = []
    with tty_output(["nvidia-smi", "-i", str(probe.index), f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                     "-lms", str(int(SAMPLE_S * 1000))]) as chunks:  # fmt: skip
        _busy(1.0, 1.0)  # CUDA context, kernels and clocks up before the first step
        with _sampling(SAMPLE_S, lambda: probe.sample().get("util")) as nvml:
            for duty in duties:
                t0 = time.time()
                _busy(duty, step_s)
                steps.append((duty, t0, time.time()))
                log.info("nvml: duty %.0f%% for %.1f s", duty * 100, step_s)
    text = b"".join(chunks).decode(errors="replace")
    smi_readings = parse_smi(text)
    return {"status": "ok", "gpu": probe.name, "steps": compare_steps(steps, nvml, smi_readings),
            "smi_readings": len(smi_readings), "smi_first_line": text.splitlines()[0] if text else None}  # fmt: skip
