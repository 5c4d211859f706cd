"""`make scale-check` (scripts/scale_check.py): the rehearsal on this machine with small counts, and its pure
parts (nvidia-smi's CSV, the duty-cycle comparison, the verdicts, the pseudo-terminal reader)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadgen.sidecars.gpu import NO_GPU_LINE, host_gpus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import scale_check_nvml  # noqa: E402
import scale_check_report  # noqa: E402


@pytest.mark.rehearsal  # make test-rehearsal, a step of .ci/run
def test_rehearsal_runs_every_part_and_records_it(tmp_path):
    """The script as the GPU machine runs it (from the repo root, PYTHONPATH=., no `bench` needed), at
    rehearsal sizes: one JSON and one log, every part recorded, the load parts without errors."""
    out = tmp_path / "scale"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "scripts/scale_check.py", "--out", str(out), "--workers", "1,2", "--requests", "600",
            "--concurrency", "16", "--rate", "150", "--duration", "3", "--open-workers", "2", "--budget", "90"]  # fmt: skip
    t = time.monotonic()
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.monotonic() - t < 90
    assert sorted(p.name for p in out.iterdir()) == ["scale_check.json", "scale_check.log"]
    res = json.loads((out / "scale_check.json").read_text())
    parts = res["parts"]
    assert set(parts) == {"nvml", "open_loop", "scaling"}
    rows = parts["scaling"]["rows"]
    assert parts["scaling"]["status"] == "ok" and parts["scaling"]["skipped"] == [] and parts["scaling"]["servers"] == 2
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["efficiency"] == 1.0
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 600 and r["req_per_s"] > 0 and 0 < r["server_cpu_max"] < 1
        assert r["load_s"] < r["point_s"]
    op = parts["open_loop"]["result"]
    assert parts["open_loop"]["status"] == "ok" and op["errors"] == 0 and op["workers"] == 2 and op["requests"] > 300
    assert abs(op["achieved_rate"] / op["scheduled_rate"] - 1) < 0.1  # the client kept to its Poisson schedule
    assert abs(op["achieved_rate"] / 150 - 1) < 0.25  # ... which holds ~450 arrivals: Poisson noise ~5 %
    if not host_gpus()[0]:  # this machine: the GPU part says so, nothing is made up
        assert parts["nvml"] == {"status": "not run", "reason": NO_GPU_LINE, "seconds": parts["nvml"]["seconds"]}
    else:
        assert parts["nvml"]["status"] in ("ok", "not run", "error")
    v = res["verdicts"]
    assert v["errors"]["pass"] is True and v["errors"]["measured"] == 0
    assert v["req_per_s_16_workers"]["pass"] is None and v["efficiency_8_workers"]["pass"] is None  # not at scale
    assert v["open_loop_rate"]["pass"] is None and v["open_loop_lag_p99"]["measured"] == op["lag_p99_ms"]
    assert res["accepted"] is False
    log = (out / "scale_check.log").read_text()
    assert "open_loop: ok" in log and "scaling: ok" in log and "nvml: " in log
    assert run.stdout.splitlines()[0].startswith(f"scale check on {os.cpu_count()} cores")
    assert "PASS errors: 0" in run.stdout


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path):
    """An open-loop part that cannot run (rate 0) is recorded with its error; the scaling part after it runs,
    and the script exits 1."""
    out = tmp_path / "scale"
    argv = [sys.executable, "scripts/scale_check.py", "--out", str(out), "--workers", "1", "--requests", "200",
            "--concurrency", "8", "--rate", "0"]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    parts = json.loads((out / "scale_check.json").read_text())["parts"]
    assert parts["open_loop"]["status"] == "error" and "rate > 0" in parts["open_loop"]["error"]
    assert parts["scaling"]["status"] == "ok" and parts["scaling"]["rows"][0]["errors"] == 0
    assert "open_loop failed:" in (out / "scale_check.log").read_text() and "open_loop: error" in run.stdout


def test_report_is_written_as_parts_end(tmp_path):
    path = tmp_path / "scale_check.json"
    report = scale_check_report.Report(path, {"cores": 2}, {"full": False})
    first = json.loads(path.read_text())
    assert {p["status"] for p in first["parts"].values()} == {"pending"} and first["accepted"] is False
    assert all(v["pass"] is None for v in first["verdicts"].values())
    report.part("nvml", {"status": "not run", "reason": NO_GPU_LINE})
    assert json.loads(path.read_text())["parts"]["nvml"]["reason"] == NO_GPU_LINE


# One line per 100 ms as `nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits
# -lms 100` writes them (525.x drivers), with a header from a run without noheader and a reading it could not
# take; the machine's local time.
SMI = """timestamp, utilization.gpu [%]
2026/11/27 10:00:00.050, 0
2026/11/27 10:00:00.150, 0
2026/11/27 10:00:01.050, 48
2026/11/27 10:00:01.150, 52
2026/11/27 10:00:01.250, [N/A]
2026/11/27 10:00:02.050, 100
2026/11/27 10:00"""


def _t(clock: str) -> float:
    return time.mktime(time.strptime(f"2026/11/27 {clock}", "%Y/%m/%d %H:%M:%S"))


def test_parse_smi_reads_each_reading_and_skips_the_rest():
    got = scale_check_nvml.parse_smi(SMI)
    t0 = _t("10:00:00")
    assert [(round(t - t0, 3), u) for t, u in got] == [(0.05, 0.0), (0.15, 0.0), (1.05, 48.0), (1.15, 52.0), (2.05, 100.0)]


def test_compare_steps_means_each_side_after_the_settle_time():
    t0 = _t("10:00:00")
    smi = scale_check_nvml.parse_smi(SMI)
    nvml = [(t0 + 1.1, 47.0), (t0 + 1.2, 49.0), (t0 + 1.9, 90.0), (t0 + 2.1, 100.0), (t0 + 0.1, 3.0)]
    steps = [(0.0, t0 - 1, t0 + 0.5), (0.5, t0 + 0.5, t0 + 1.5), (1.0, t0 + 1.5, t0 + 2.5)]
    rows = scale_check_nvml.compare_steps(steps, nvml, smi, settle=0.5)
    assert [r["duty"] for r in rows] == [0.0, 0.5, 1.0]
    assert rows[0]["nvml_util"] == 3.0 and rows[0]["smi_util"] == 0.0 and rows[0]["within"]  # 0 s..0.5 s
    assert rows[1] == {"duty": 0.5, "nvml_util": 48.0, "smi_util": 50.0, "diff": -2.0, "n_nvml": 2, "n_smi": 2,
                       "within": True}  # fmt: skip
    assert rows[2]["smi_util"] == 100.0 and rows[2]["nvml_util"] == 100.0 and rows[2]["n_nvml"] == 1  # 90 settles
    far = scale_check_nvml.compare_steps(steps[1:2], [(t0 + 1.1, 60.0)], smi, settle=0.5)[0]
    assert far["diff"] == 10.0 and far["within"] is False
    empty = scale_check_nvml.compare_steps(steps[1:2], [], smi, settle=0.5)[0]
    assert empty["nvml_util"] is None and empty["diff"] is None and empty["within"] is False


def _load(workers: int, req_per_s: float, efficiency: float, errors: int = 0, busiest: float = 0.2) -> dict:
    return {"workers": workers, "req_per_s": req_per_s, "efficiency": efficiency, "errors": errors,
            "server_cpu_max": busiest, "servers_limit": busiest > 0.5}  # fmt: skip


def _parts(top: float = 12_000, eff8: float = 0.8, rate: float = 10_000, achieved: float = 9_810,
           lag: float = 4.9, diffs: tuple[float, ...] = (0.0, -4.5, 5.0)) -> dict:  # fmt: skip
    rows = [_load(1, 1_800, 1.0), _load(8, 8 * 1_800 * eff8, eff8), _load(16, top, top / (16 * 1_800))]
    op = {**_load(16, rate, 1.0), "requested_rate": rate, "achieved_rate": achieved, "lag_p99_ms": lag}
    steps = [{"diff": d, "within": abs(d) <= 5} for d in diffs]
    return {"scaling": {"status": "ok", "rows": rows}, "open_loop": {"status": "ok", "result": op},
            "nvml": {"status": "ok", "steps": steps}}  # fmt: skip


def test_verdicts_hold_issue_38s_figures_at_their_edges():
    v = scale_check_report.verdicts(_parts())
    assert all(x["pass"] is True for x in v.values()), v
    assert v["open_loop_rate"]["measured"] == 9_810 / 10_000 - 1 and v["nvml_vs_smi"]["measured"] == 5.0
    fails = {
        "req_per_s_16_workers": _parts(top=9_999), "efficiency_8_workers": _parts(eff8=0.79),
        "open_loop_rate": _parts(achieved=9_790), "open_loop_lag_p99": _parts(lag=5.0),
        "nvml_vs_smi": _parts(diffs=(0.0, 5.5)),
    }  # fmt: skip
    for name, parts in fails.items():
        v = scale_check_report.verdicts(parts)
        assert [k for k, x in v.items() if x["pass"] is False] == [name], (name, v)
    noisy = _parts()
    noisy["scaling"]["rows"][1].update(errors=2, server_cpu_max=0.7, servers_limit=True)
    v = scale_check_report.verdicts(noisy)
    assert v["errors"] == {"target": "0 errors", "measured": 2, "pass": False} and v["servers_not_limit"]["pass"] is False


def test_verdicts_not_at_scale_are_not_judged():
    """Fewer workers, a lower open-loop rate, no GPU: those verdicts are None (not measured), not passes."""
    parts = _parts(rate=200, achieved=200)
    parts["scaling"]["rows"] = parts["scaling"]["rows"][:1]
    parts["nvml"] = {"status": "not run", "reason": NO_GPU_LINE}
    v = scale_check_report.verdicts(parts)
    assert {k for k, x in v.items() if x["pass"] is None} == {
        "req_per_s_16_workers", "efficiency_8_workers", "open_loop_rate", "open_loop_lag_p99", "nvml_vs_smi"}
    failed = {"nvml": parts["nvml"], "open_loop": {"status": "error", "error": "x"}, "scaling": {"status": "error"}}
    assert all(x["pass"] is None for x in scale_check_report.verdicts(failed).values())


def test_tty_output_gets_every_line_of_a_program_stopped_mid_run(monkeypatch):
    """A stand-in for `nvidia-smi -lms 100`: it prints a reading every 20 ms and never flushes (into a pipe,
    none of its lines would come out before SIGTERM kills it). Through the pseudo-terminal each line arrives
    as it is printed, and the lines before the stop are all there."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the stand-in buffers as C stdio does
    code = ("import time\nfor i in range(10**6):\n    print(time.strftime('%Y/%m/%d %H:%M:%S.000') + f', {i % 101}')\n"
            "    time.sleep(0.02)\n")  # fmt: skip
    with scale_check_nvml.tty_output([sys.executable, "-c", code]) as chunks:
        deadline = time.monotonic() + 10
        while b"".join(chunks).count(b"\n") < 10:
            assert time.monotonic() < deadline, b"".join(chunks)
            time.sleep(0.02)
    readings = scale_check_nvml.parse_smi(b"".join(chunks).decode())
    assert len(readings) >= 10 and [u for _, u in readings] == [float(i % 101) for i in range(len(readings))]
    assert abs(readings[-1][0] - time.time()) < 5
