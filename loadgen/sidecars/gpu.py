"""GPUs through NVML: the only module that imports ``pynvml`` and the one place that detects GPUs
(telemetry asks it for its probes, ``run.json``'s environment for its inventory)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

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
def host_gpus() -> tuple[list[GpuProbe], str]:
    """:func:`open_gpus` once per process (NVML init is slow-ish and the devices do not change)."""
    return open_gpus()


def gpu_inventory() -> list[str]:
    """One line per GPU of this host, ``name, total memory MiB, driver`` (the form of ``nvidia-smi
    --query-gpu=name,memory.total,driver_version --format=csv,noheader``); empty without a usable driver."""
    probes, _ = host_gpus()
    try:
        driver = str(pynvml.nvmlSystemGetDriverVersion()) if probes else ""
        return [f"{p.name}, {int(pynvml.nvmlDeviceGetMemoryInfo(p.handle).total) // 2**20} MiB, {driver}" for p in probes]
    except pynvml.NVMLError:
        return []
