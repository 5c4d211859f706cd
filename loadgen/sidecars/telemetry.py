"""Telemetry beside a load point: GPUs through NVML, the host through psutil, or a remote exporter.

A sampler runs in its own thread (never on the event loop) at a fixed rate and appends one JSON object
per tick to ``points/<id>/telemetry.jsonl``; every ``t`` is on the run clock. ``stop`` summarises the
steady-state window. Missing or failing parts degrade instead of failing the run: no NVIDIA driver means
host series only (see :data:`loadgen.sidecars.gpu.NO_GPU_LINE`), a GPU that stops answering stops being sampled.

Record shape (keys absent when not measured)::

    {"t": 1.2, "cpu_pct": [per core], "mem_used_b": .., "mem_total_b": .., "client_cpu_pct": ..,
     "server_cpu_pct": .., "server_rss_b": ..,
     "gpus": [{"index": 0, "util": .., "mem_util": .., "mem_used_b": .., "mem_total_b": .., "power_w": ..,
               "sm_clock_mhz": .., "temp_c": .., "energy_j": .., "procs": [{"pid": .., "sm": .., "mem": ..}]}]}
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

from loadgen.metrics import percentiles
from loadgen.sidecars import gpu as gpu_probes
from loadgen.sidecars.exporters import exporter_record
from loadgen.sidecars.prometheus import parse_metrics
from loadgen.sidecars.sampler import Record, ThreadedSampler
from loadgen.timing.clock import RunClock


class HostProbe:
    """Host CPU per core and memory, this (client) process's CPU, and the server process when known.

    CPU shares are rates since the previous sample, so the first sample has memory only.
    """

    def __init__(self, server_pid: int | None = None) -> None:
        self._client = psutil.Process(os.getpid())
        self._server: psutil.Process | None = None
        self._first = True
        if server_pid is not None:
            try:
                self._server = psutil.Process(server_pid)
            except psutil.Error:
                self._server = None

    def sample(self) -> Record:
        vm = psutil.virtual_memory()
        rec: Record = {
            "cpu_pct": psutil.cpu_percent(percpu=True),
            "mem_used_b": int(vm.total - vm.available),
            "mem_total_b": int(vm.total),
            "client_cpu_pct": self._client.cpu_percent(None),
        }
        if self._server is not None:
            try:
                with self._server.oneshot():
                    rec["server_cpu_pct"] = self._server.cpu_percent(None)
                    rec["server_rss_b"] = int(self._server.memory_info().rss)
            except psutil.Error:  # the server exited: keep sampling the host
                self._server = None
        if self._first:  # psutil's first call only sets the reference point for the rates
            self._first = False
            for key in ("cpu_pct", "client_cpu_pct", "server_cpu_pct"):
                rec.pop(key, None)
        return rec


class _Telemetry(ThreadedSampler):
    """What the local and remote samplers share: the file, the record precision, the summary."""

    name = "telemetry"
    filename = "telemetry.jsonl"
    t_digits = 4

    def __init__(self, rate_hz: float) -> None:
        super().__init__(rate_hz, "telemetry rate")
        self.header = ""
        self.notes: list[str] = []

    def summary(self, window: tuple[float, float] | None) -> dict[str, Any]:
        out = summarize(self.records, window)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


class TelemetrySampler(_Telemetry):
    """Local sampler (a :class:`loadgen.timing.clock.Sidecar`): NVML GPUs if any, plus the host.

    ``header`` is the line for the run header, known after construction.
    """

    def __init__(self, rate_hz: float = 10.0, server_pid: int | None = None, gpu: bool = True) -> None:
        super().__init__(rate_hz)
        self.server_pid = server_pid
        self.gpus: list[gpu_probes.GpuProbe]
        self.gpus, self.header = gpu_probes.host_gpus() if gpu else ([], "GPU telemetry off")
        self._host: HostProbe | None = None

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self._host = HostProbe(self.server_pid)
        for g in self.gpus:
            g.gone = False
        super().start(clock, point_dir)

    def _tick(self, t: float) -> Record:
        assert self._host is not None
        rec = self._host.sample()
        gpus = []
        for g in self.gpus:
            if g.gone:
                continue
            try:
                gpus.append(g.sample())
            except gpu_probes.GpuGone as exc:
                assert self._clock is not None
                self.notes.append(f"{exc} at t={self._clock.now():.2f}s: sampling of this GPU stopped")
        if gpus:
            rec["gpus"] = gpus
        return rec


# --- summary -----------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float] | None:
    """Mean and max of a series (``None``/NaN samples skipped), from :func:`loadgen.metrics.percentiles.stats`."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    st = percentiles.stats(vals)
    return {"mean": st["mean"], "max": st["max"]}  # type: ignore[dict-item]


def _energy(points: list[tuple[float, Record]]) -> float | None:
    """Joules used in the window: the energy counter's difference, else power integrated over time."""
    counters = [(t, g["energy_j"]) for t, g in points if "energy_j" in g]
    if len(counters) >= 2:
        return counters[-1][1] - counters[0][1]
    power = [(t, g["power_w"]) for t, g in points if "power_w" in g]
    if len(power) >= 2:
        return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(power, power[1:], strict=False))
    return None


def summarize(records: list[Record], window: tuple[float, float] | None) -> dict[str, Any]:
    """Mean/max of host and per-GPU series inside ``window`` (all records when None).

    ``gpu_energy_j`` (summed over GPUs) is what :func:`loadgen.metrics.pointsummary.joules_per_output_token` divides.
    """
    lo, hi = window if window is not None else (-math.inf, math.inf)
    sel = [r for r in records if lo <= r["t"] <= hi]
    out: dict[str, Any] = {"samples": len(sel)}
    host = {
        "cpu_pct": _stats([sum(r["cpu_pct"]) / len(r["cpu_pct"]) for r in sel if r.get("cpu_pct")]),
        "mem_used_b": _stats([r.get("mem_used_b") for r in sel]),
        "client_cpu_pct": _stats([r.get("client_cpu_pct") for r in sel]),
        "server_cpu_pct": _stats([r.get("server_cpu_pct") for r in sel]),
        "server_rss_b": _stats([r.get("server_rss_b") for r in sel]),
    }
    out.update({k: v for k, v in host.items() if v is not None})
    per_gpu: dict[int, list[tuple[float, Record]]] = {}
    for r in sel:
        for g in r.get("gpus", []):
            per_gpu.setdefault(g["index"], []).append((r["t"], g))
    gpus = []
    for index, pts in sorted(per_gpu.items()):
        g_out: dict[str, Any] = {"index": index, "samples": len(pts)}
        for key in ("util", "mem_used_b", "power_w", "sm_clock_mhz", "temp_c"):
            s = _stats([g.get(key) for _, g in pts])
            if s is not None:
                g_out[key] = s
        energy = _energy(pts)
        if energy is not None:
            g_out["energy_j"] = energy
        gpus.append(g_out)
    if gpus:
        out["gpus"] = gpus
        energies = [g["energy_j"] for g in gpus if "energy_j" in g]
        if len(energies) == len(gpus):
            out["gpu_energy_j"] = sum(energies)
    return out


# --- remote: a DCGM exporter or node exporter (their series: loadgen.sidecars.exporters) ----------------


class RemoteTelemetry(_Telemetry):
    """Telemetry of a remote host from a Prometheus exporter URL (``--telemetry-url``).

    Scrapes with the server-state poller's parser. Exporters refresh slowly (dcgm-exporter collects every
    30 s unless started with ``-c``), so the default rate is 1 Hz. A failed scrape is recorded as
    ``{"t", "error"}`` and sampling goes on.
    """

    def __init__(self, url: str, rate_hz: float = 1.0, timeout_s: float = 2.0) -> None:
        super().__init__(rate_hz)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--telemetry-url must be an http(s) URL of a Prometheus exporter, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.header = f"remote telemetry: {url}"
        self._prev_cpu: dict[str, tuple[float, float]] = {}
        self._client: httpx.Client | None = None

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self._client = httpx.Client(timeout=self.timeout_s)
        self._prev_cpu = {}
        super().start(clock, point_dir)

    def _tick(self, t: float) -> Record:
        assert self._client is not None
        try:
            resp = self._client.get(self.url)
            resp.raise_for_status()
            values, _ = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return exporter_record(values, self._prev_cpu)

    def summary(self, window: tuple[float, float] | None) -> dict[str, Any]:
        out = super().summary(window)
        if self._client is not None:
            self._client.close()
            self._client = None
        errors = sum(1 for r in self.records if "error" in r)
        if errors:
            out["scrape_errors"] = errors
        return out


# --- wiring for bench run / sweep -------------------------------------------------------------------------

REMOTE_MAX_HZ = 1.0  # exporters refresh at most about once a second; faster scrapes only repeat values


def local_server_pid(base_url: str) -> int | None:
    """The pid listening on a loopback ``base_url``'s port (the server bench started), if visible."""
    parts = urlsplit(base_url)
    if parts.hostname not in ("127.0.0.1", "::1", "localhost") or parts.port is None:
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    pids = {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == parts.port}
    pids.discard(None)
    return pids.pop() if len(pids) == 1 else None


def check_options(hz: float, url: str | None) -> None:
    """Validate ``--telemetry-hz``/``--telemetry-url`` before a run starts (ValueError says what to do)."""
    if hz < 0:
        raise ValueError("--telemetry-hz must be >= 0 (0 turns telemetry off)")
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"--telemetry-url must be an http(s) URL of a Prometheus exporter, got {url!r}")


def header_line(hz: float, url: str | None) -> str:
    """The run-header line: what telemetry this run records."""
    if hz == 0:
        return "telemetry off (--telemetry-hz 0)"
    if url:
        return f"remote telemetry: {url} at {min(hz, REMOTE_MAX_HZ):g} Hz"
    return gpu_probes.host_gpus()[1]


def sidecars(target_url: str, hz: float, url: str | None) -> list[ThreadedSampler]:
    """The telemetry sidecar for one point: remote exporter when ``url`` is given, else this host (NVML
    GPUs, CPU, memory, and the server process when it listens on a loopback port here)."""
    if hz == 0:
        return []
    if url:
        return [RemoteTelemetry(url, rate_hz=min(hz, REMOTE_MAX_HZ))]
    return [TelemetrySampler(rate_hz=hz, server_pid=local_server_pid(target_url))]
