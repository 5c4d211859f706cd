"""Telemetry beside a load point: GPUs through NVML, the host through psutil, or a remote exporter.

A sampler runs in its own thread (never on the event loop) at a fixed rate and appends one JSON object
per tick to ``points/<id>/telemetry.jsonl``; every ``t`` is on the run clock. ``stop`` summarises the
steady-state window. Missing or failing parts degrade instead of failing the run: no NVIDIA driver means
host series only (see :data:`NO_GPU_LINE`), a GPU that stops answering stops being sampled.

Record shape (keys absent when not measured)::

    {"t": 1.2, "cpu_pct": [per core], "mem_used_b": .., "mem_total_b": .., "client_cpu_pct": ..,
     "server_cpu_pct": .., "server_rss_b": ..,
     "gpus": [{"index": 0, "util": .., "mem_util": .., "mem_used_b": .., "mem_total_b": .., "power_w": ..,
               "sm_clock_mhz": .., "temp_c": .., "energy_j": .., "procs": [{"pid": .., "sm": .., "mem": ..}]}]}
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pynvml

from loadgen import metrics
from loadgen.clock import RunClock
from loadgen.prometheus import parse_metrics, split_key

NO_GPU_LINE = "no NVIDIA GPU: GPU telemetry off"
Record = dict[str, Any]

# NVML return codes after which a device will not answer again in this process.
_GONE = {
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
}
# ...and after which only this one query is pointless to repeat.
_UNSUPPORTED = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}


class GpuGone(Exception):
    """The device stopped answering (fallen off the bus, driver unloaded)."""


@dataclass
class GpuProbe:
    """One NVML device. ``sample`` asks each query separately so one unsupported query costs one field."""

    index: int
    handle: Any
    name: str = ""
    gone: bool = False
    _unsupported: set[str] = field(default_factory=set)
    _proc_ts: int = 0

    def _ask(self, key: str, fn: Callable[[], Any]) -> Any:
        if key in self._unsupported:
            return None
        try:
            return fn()
        except pynvml.NVMLError as exc:
            if exc.value in _GONE:
                self.gone = True
                raise GpuGone(f"GPU {self.index}: {exc}") from exc
            if exc.value in _UNSUPPORTED:
                self._unsupported.add(key)
            return None

    def sample(self) -> Record:
        """One reading; raises :class:`GpuGone` once the device is lost."""
        h = self.handle
        rec: Record = {"index": self.index}
        util = self._ask("util", lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            rec["util"], rec["mem_util"] = float(util.gpu), float(util.memory)
        mem = self._ask("mem", lambda: pynvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            rec["mem_used_b"], rec["mem_total_b"] = int(mem.used), int(mem.total)
        power = self._ask("power", lambda: pynvml.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            rec["power_w"] = power / 1000.0
        clock = self._ask("clock", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
        if clock is not None:
            rec["sm_clock_mhz"] = float(clock)
        temp = self._ask("temp", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
        if temp is not None:
            rec["temp_c"] = float(temp)
        energy = self._ask("energy", lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        if energy is not None:
            rec["energy_j"] = energy / 1000.0
        procs = self._ask("procs", lambda: pynvml.nvmlDeviceGetProcessUtilization(h, self._proc_ts))
        if procs:
            self._proc_ts = max(int(p.timeStamp) for p in procs)
            rec["procs"] = [{"pid": int(p.pid), "sm": int(p.smUtil), "mem": int(p.memUtil)} for p in procs]
        return rec


def open_gpus() -> tuple[list[GpuProbe], str]:
    """The NVML devices of this host and a one-line description for the run header.

    Without a usable driver the list is empty and the line is :data:`NO_GPU_LINE`.
    """
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        probes = [GpuProbe(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        for p in probes:
            p.name = str(pynvml.nvmlDeviceGetName(p.handle))
        driver = str(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        return [], NO_GPU_LINE
    if not probes:
        return [], NO_GPU_LINE
    names = ", ".join(sorted({p.name for p in probes}))
    return probes, f"GPU telemetry: {len(probes)} x {names} (driver {driver})"


@functools.cache
def _host_gpus() -> tuple[list[GpuProbe], str]:
    """:func:`open_gpus` once per process (NVML init is slow-ish and the devices do not change)."""
    return open_gpus()


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


class _ThreadedSampler:
    """The thread, the file and the summary shared by the local and remote samplers."""

    name = "telemetry"

    def __init__(self, rate_hz: float) -> None:
        if not rate_hz > 0:
            raise ValueError(f"telemetry rate must be > 0 Hz, got {rate_hz}")
        self.period = 1.0 / rate_hz
        self.header: str = ""
        self.notes: list[str] = []
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock: RunClock | None = None
        self._out: Any = None

    def _tick(self) -> Record:
        raise NotImplementedError

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self._clock = clock
        self._stop.clear()
        self.records = []
        point_dir.mkdir(parents=True, exist_ok=True)
        self._out = (point_dir / "telemetry.jsonl").open("w", encoding="utf-8")
        self._thread = threading.Thread(target=self._loop, name="servelab-telemetry", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        assert self._clock is not None
        next_t = self._clock.now()
        while not self._stop.is_set():
            t = round(self._clock.now(), 4)
            try:
                rec = {"t": t, **self._tick()}
            except Exception as exc:  # a sampler bug must not end the run: record it and go on
                rec = {"t": t, "error": f"{type(exc).__name__}: {exc}"[:300]}
            self.records.append(rec)
            self._out.write(json.dumps(rec, separators=(",", ":")) + "\n")
            next_t += self.period
            self._stop.wait(max(0.0, next_t - self._clock.now()))

    def stop(self, window: tuple[float, float] | None) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._out is not None:
            self._out.close()
            self._out = None
        out = summarize(self.records, window)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


class TelemetrySampler(_ThreadedSampler):
    """Local sampler (a :class:`loadgen.clock.Sidecar`): NVML GPUs if any, plus the host.

    ``header`` is the line for the run header, known after construction.
    """

    def __init__(self, rate_hz: float = 10.0, server_pid: int | None = None, gpu: bool = True) -> None:
        super().__init__(rate_hz)
        self.server_pid = server_pid
        self.gpus: list[GpuProbe]
        self.gpus, self.header = _host_gpus() if gpu else ([], "GPU telemetry off")
        self._host: HostProbe | None = None

    def start(self, clock: RunClock, point_dir: Path) -> None:
        self._host = HostProbe(self.server_pid)
        for g in self.gpus:
            g.gone = False
        super().start(clock, point_dir)

    def _tick(self) -> Record:
        assert self._host is not None
        rec = self._host.sample()
        gpus = []
        for g in self.gpus:
            if g.gone:
                continue
            try:
                gpus.append(g.sample())
            except GpuGone as exc:
                assert self._clock is not None
                self.notes.append(f"{exc} at t={self._clock.now():.2f}s: sampling of this GPU stopped")
        if gpus:
            rec["gpus"] = gpus
        return rec


# --- summary -----------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float] | None:
    """Mean and max of a series (``None``/NaN samples skipped), from :func:`loadgen.metrics.stats`."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    st = metrics.stats(vals)
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

    ``gpu_energy_j`` (summed over GPUs) is what :func:`loadgen.metrics.joules_per_output_token` divides.
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


# --- remote: a DCGM exporter or node exporter --------------------------------------------------------

# DCGM exporter gauge -> record field, and the factor to the record's unit.
_DCGM = {
    "DCGM_FI_DEV_GPU_UTIL": ("util", 1.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_util", 1.0),
    "DCGM_FI_DEV_FB_USED": ("mem_used_b", 1024.0 * 1024.0),  # MiB
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0),
    "DCGM_FI_DEV_GPU_TEMP": ("temp_c", 1.0),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_j", 1e-3),  # mJ
}
_IDLE_MODES = ("idle", "iowait")


def exporter_record(values: dict[str, float], prev_cpu: dict[str, tuple[float, float]]) -> Record:
    """One telemetry record from a scrape of a DCGM exporter and/or a node exporter.

    Per-core CPU % needs two scrapes of ``node_cpu_seconds_total``; ``prev_cpu`` carries
    ``{cpu: (busy_s, total_s)}`` from the previous scrape and is updated in place.
    """
    rec: Record = {}
    gpus: dict[int, Record] = {}
    cpu_now: dict[str, list[float]] = {}
    fb_free: dict[int, float] = {}
    for key, value in values.items():
        name, labels = split_key(key)
        if name in _DCGM and "gpu" in labels:
            field_name, factor = _DCGM[name]
            g = gpus.setdefault(int(labels["gpu"]), {"index": int(labels["gpu"])})
            g[field_name] = value * factor
        elif name == "DCGM_FI_DEV_FB_FREE" and "gpu" in labels:
            fb_free[int(labels["gpu"])] = value * 1024.0 * 1024.0
        elif name == "node_cpu_seconds" and "cpu" in labels:
            busy_total = cpu_now.setdefault(labels["cpu"], [0.0, 0.0])
            busy_total[1] += value
            if labels.get("mode") not in _IDLE_MODES:
                busy_total[0] += value
        elif name == "node_memory_MemTotal_bytes":
            rec["mem_total_b"] = int(value)
        elif name == "node_memory_MemAvailable_bytes":
            rec["_mem_avail"] = int(value)
    for index, free in fb_free.items():
        if index in gpus and "mem_used_b" in gpus[index]:
            gpus[index]["mem_total_b"] = int(gpus[index]["mem_used_b"] + free)
    for g in gpus.values():
        if "mem_used_b" in g:
            g["mem_used_b"] = int(g["mem_used_b"])
    if "mem_total_b" in rec and "_mem_avail" in rec:
        rec["mem_used_b"] = rec["mem_total_b"] - rec["_mem_avail"]
    rec.pop("_mem_avail", None)
    if cpu_now:
        cores = sorted(cpu_now, key=lambda c: int(c) if c.isdigit() else c)
        if all(c in prev_cpu for c in cores):
            pct = []
            for c in cores:
                d_busy, d_total = cpu_now[c][0] - prev_cpu[c][0], cpu_now[c][1] - prev_cpu[c][1]
                pct.append(round(100.0 * d_busy / d_total, 2) if d_total > 0 else 0.0)
            rec["cpu_pct"] = pct
        prev_cpu.clear()
        prev_cpu.update({c: (bt[0], bt[1]) for c, bt in cpu_now.items()})
    if gpus:
        rec["gpus"] = [gpus[i] for i in sorted(gpus)]
    return rec


class RemoteTelemetry(_ThreadedSampler):
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

    def _tick(self) -> Record:
        assert self._client is not None
        try:
            resp = self._client.get(self.url)
            resp.raise_for_status()
            values, _ = parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return exporter_record(values, self._prev_cpu)

    def stop(self, window: tuple[float, float] | None) -> dict[str, Any]:
        out = super().stop(window)
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
    return _host_gpus()[1]


def sidecars(target_url: str, hz: float, url: str | None) -> list[_ThreadedSampler]:
    """The telemetry sidecar for one point: remote exporter when ``url`` is given, else this host (NVML
    GPUs, CPU, memory, and the server process when it listens on a loopback port here)."""
    if hz == 0:
        return []
    if url:
        return [RemoteTelemetry(url, rate_hz=min(hz, REMOTE_MAX_HZ))]
    return [TelemetrySampler(rate_hz=hz, server_pid=local_server_pid(target_url))]
