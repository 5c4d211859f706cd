"""Telemetry records from the series of a DCGM exporter (GPUs) and a node exporter (host), as scraped by
:class:`loadgen.sidecars.telemetry.RemoteTelemetry`: the same record shape as local telemetry."""

from __future__ import annotations

from loadgen.sidecars.prometheus import split_key
from loadgen.sidecars.sampler import Record

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
