"""Telemetry: the host sampler live, NVML degradation against the real library, exporter scraping."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pynvml
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from loadgen.metrics.pointsummary import add_energy_per_token, joules_per_output_token
from loadgen.records.results import environment
from loadgen.sidecars.exporters import exporter_record
from loadgen.sidecars.gpu import NO_GPU_LINE, GpuProbe, gpu_inventory, open_gpus
from loadgen.sidecars.telemetry import RemoteTelemetry, TelemetrySampler, summarize
from loadgen.timing.clock import RunClock


def _nvml_available() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture
def busy_server():
    """A real child process burning CPU, standing in for the server bench started."""
    proc = subprocess.Popen([sys.executable, "-c", "x = bytearray(50_000_000)\nwhile True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def test_host_sampler_live(tmp_path, busy_server):
    sampler = TelemetrySampler(rate_hz=20, server_pid=busy_server.pid)
    child = psutil.Process(busy_server.pid)
    time.sleep(0.3)  # let the child allocate
    cpu0, w0 = sum(child.cpu_times()[:2]), time.perf_counter()
    sampler.start(RunClock(), tmp_path)
    time.sleep(1.0)
    summary = sampler.stop(window=(0.2, 0.9))
    child_pct = 100 * (sum(child.cpu_times()[:2]) - cpu0) / (time.perf_counter() - w0)

    lines = [json.loads(x) for x in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert lines == sampler.records
    assert 15 <= len(lines) <= 25  # 20 Hz for ~1 s
    ts = [r["t"] for r in lines]
    assert ts == sorted(ts) and 0.0 <= ts[0] < 0.3 + 0.2
    assert "cpu_pct" not in lines[0] and "server_rss_b" in lines[0]  # rates need a previous sample
    assert all(len(r["cpu_pct"]) == psutil.cpu_count() for r in lines[1:])
    assert all(0 < r["mem_used_b"] < r["mem_total_b"] for r in lines)
    # the sampled CPU share of the busy child agrees with its own CPU time; its RSS holds the 50 MB buffer
    assert child_pct > 10
    assert abs(summary["server_cpu_pct"]["mean"] - child_pct) < 25
    assert summary["server_rss_b"]["max"] > 50_000_000
    assert summary["samples"] == sum(1 for t in ts if 0.2 <= t <= 0.9)
    assert "gpus" not in summary or _nvml_available()


def test_server_exit_mid_run_keeps_host_series(tmp_path, busy_server):
    sampler = TelemetrySampler(rate_hz=20, server_pid=busy_server.pid, gpu=False)
    sampler.start(RunClock(), tmp_path)
    time.sleep(0.3)
    busy_server.kill()
    busy_server.wait()
    time.sleep(0.3)
    sampler.stop(None)
    with_server = [r for r in sampler.records if "server_cpu_pct" in r]
    assert with_server and len(with_server) < len(sampler.records)
    assert all("cpu_pct" in r for r in sampler.records[1:])


def test_run_json_gpus_come_from_nvml_in_nvidia_smis_form():
    """``environment()["gpus"]`` is the NVML inventory: nothing without a driver, else the very lines of
    ``nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader``."""
    inventory = gpu_inventory()
    assert environment()["gpus"] == inventory
    if not _nvml_available():
        assert inventory == []
        return
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    assert inventory == [line.strip() for line in smi.splitlines() if line.strip()]


@pytest.mark.skipif(
    _nvml_available(), reason="this machine has an NVIDIA driver; the no-driver path cannot run"
)
def test_no_driver_header_and_host_only(tmp_path):
    probes, line = open_gpus()
    assert probes == [] and line == NO_GPU_LINE == "no NVIDIA GPU: GPU telemetry off"
    sampler = TelemetrySampler(rate_hz=50)
    assert sampler.header == NO_GPU_LINE
    sampler.start(RunClock(), tmp_path)
    time.sleep(0.2)
    summary = sampler.stop(None)
    assert sampler.records and all("gpus" not in r for r in sampler.records)
    assert "gpus" not in summary and "gpu_energy_j" not in summary


@pytest.mark.skipif(_nvml_available(), reason="needs NVML uninitialised to get its real 'gone' error")
def test_gpu_that_stops_answering_stops_being_sampled(tmp_path):
    """The real pynvml raises NVMLError_Uninitialized for a device query once NVML is down (as after a
    driver unload); the sampler must drop that GPU, note it, and keep the host series."""
    sampler = TelemetrySampler(rate_hz=50, gpu=False)
    sampler.gpus = [GpuProbe(index=0, handle=None, name="lost")]
    sampler.start(RunClock(), tmp_path)
    time.sleep(0.2)
    summary = sampler.stop(None)
    assert len(sampler.records) >= 5
    assert all("gpus" not in r and "mem_used_b" in r for r in sampler.records)
    assert sampler.gpus[0].gone
    assert len(summary["notes"]) == 1 and "GPU 0" in summary["notes"][0] and "stopped" in summary["notes"][0]


def test_summary_window_energy_and_joules_per_token():
    recs = []
    for i in range(11):  # 0..1 s, GPU 0 at 100 W + counter, GPU 1 power only at 50 W
        t = i / 10
        recs.append(
            {
                "t": t,
                "cpu_pct": [10.0, 30.0],
                "gpus": [
                    {
                        "index": 0,
                        "util": 50.0 + i,
                        "mem_used_b": 1000 + i,
                        "power_w": 100.0,
                        "energy_j": 7.0 + 120 * t,
                    },
                    {"index": 1, "util": 10.0, "power_w": 50.0},
                ],
            }
        )
    s = summarize(recs, window=(0.2, 0.6))
    assert s["samples"] == 5
    assert s["cpu_pct"] == {"mean": 20.0, "max": 20.0}
    g0, g1 = s["gpus"]
    assert g0["util"] == {"mean": 54.0, "max": 56.0}
    assert g0["mem_used_b"]["max"] == 1006
    assert g0["energy_j"] == pytest.approx(120 * 0.4)  # from the counter, not the power gauge
    assert g1["energy_j"] == pytest.approx(50 * 0.4)  # trapezoid of power
    assert s["gpu_energy_j"] == pytest.approx(68.0)
    assert joules_per_output_token(s, 34) == pytest.approx(2.0)
    assert joules_per_output_token(summarize([{"t": 0.0, "cpu_pct": [1.0]}], None), 34) is None
    point = {"telemetry": s, "throughput": {"steady": {"output_tok_per_s": 85.0, "seconds": 0.4}}}
    add_energy_per_token(point)
    assert point["telemetry"]["joules_per_output_token"] == pytest.approx(68.0 / 34)
    host_only = {"telemetry": summarize([{"t": 0.0, "cpu_pct": [1.0]}], None), "throughput": point["throughput"]}
    add_energy_per_token(host_only)
    assert "joules_per_output_token" not in host_only["telemetry"]


DCGM_TEXT = """# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 87
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-2",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 3
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 2048
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 1024
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 312.5
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="h"} 5000
"""


def _node_text(idle0: float, user0: float) -> str:
    return f"""# TYPE node_cpu_seconds_total counter
node_cpu_seconds_total{{cpu="0",mode="idle"}} {idle0}
node_cpu_seconds_total{{cpu="0",mode="user"}} {user0}
node_cpu_seconds_total{{cpu="0",mode="iowait"}} 1
node_cpu_seconds_total{{cpu="1",mode="idle"}} 100
node_cpu_seconds_total{{cpu="1",mode="user"}} 5
# TYPE node_memory_MemTotal_bytes gauge
node_memory_MemTotal_bytes 8e+09
# TYPE node_memory_MemAvailable_bytes gauge
node_memory_MemAvailable_bytes 6e+09
"""


def test_exporter_record_maps_dcgm_and_node_exporter():
    from loadgen.sidecars.prometheus import parse_metrics

    prev: dict = {}
    first = exporter_record(parse_metrics(DCGM_TEXT + _node_text(100, 10))[0], prev)
    assert "cpu_pct" not in first  # per-core CPU needs two scrapes
    assert first["mem_used_b"] == 2_000_000_000 and first["mem_total_b"] == 8_000_000_000
    g0, g1 = first["gpus"]
    assert g0 == {
        "index": 0,
        "util": 87.0,
        "mem_used_b": 2048 * 2**20,
        "mem_total_b": 3072 * 2**20,
        "power_w": 312.5,
        "energy_j": 5.0,
    }
    assert g1 == {"index": 1, "util": 3.0}
    second = exporter_record(parse_metrics(_node_text(101, 13))[0], prev)  # cpu0: 3 busy of 4 s
    assert second["cpu_pct"] == [75.0, 0.0]


def test_remote_sampler_scrapes_a_live_exporter(tmp_path):
    reg = CollectorRegistry()
    util = Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", ["gpu", "UUID"], registry=reg)
    cpu = Counter("node_cpu_seconds", "cpu", ["cpu", "mode"], registry=reg)
    util.labels(gpu="0", UUID="GPU-1").set(40)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        port = server.server_address[1]
        sampler = RemoteTelemetry(f"http://127.0.0.1:{port}/metrics", rate_hz=20)
        sampler.start(RunClock(), tmp_path)
        for i in range(6):
            util.labels(gpu="0", UUID="GPU-1").set(40 + 10 * i)
            cpu.labels(cpu="0", mode="user").inc(0.5)
            cpu.labels(cpu="0", mode="idle").inc(0.5)
            time.sleep(0.05)
        summary = sampler.stop(None)
    finally:
        server.shutdown()
        thread.join()
    utils = [r["gpus"][0]["util"] for r in sampler.records]
    assert len(utils) >= 4 and utils[0] >= 40 and max(utils) > utils[0]
    assert summary["gpus"][0]["util"]["max"] == max(utils)
    assert any(r.get("cpu_pct") for r in sampler.records)


def test_remote_sampler_survives_a_dead_url(tmp_path):
    sampler = RemoteTelemetry("http://127.0.0.1:9/metrics", rate_hz=20, timeout_s=0.2)
    sampler.start(RunClock(), tmp_path)
    time.sleep(0.2)
    summary = sampler.stop(None)
    assert summary["scrape_errors"] == len(sampler.records) >= 2


def test_bad_rate_and_url_are_clear_errors():
    with pytest.raises(ValueError, match="rate must be > 0"):
        TelemetrySampler(rate_hz=0)
    with pytest.raises(ValueError, match="--telemetry-url"):
        RemoteTelemetry("localhost:9400")
