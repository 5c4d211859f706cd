"""Integration against a real llama-server (built by scripts/build_llama_server.sh) on the bundled GGUF.

Part of the default suite: a missing binary fails (the build script is CI's first step), it is not
skipped. One server (-np 2) is shared by the stream tests; the sweep test starts its own per grid point.
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.cli import cli_point, fixed_workload, word_tokenizer
from support.pooling import embeddings_end_to_end
from test_robust_runs import WAVE_TOKENS, default_cli_run  # tests/ is on sys.path
from typer.testing import CliRunner

from backends.launcher import (
    LLAMA_SERVER_ENV,
    ServerProcess,
    free_port,
    render_command,
    server_grid,
    sweep_servers,
)
from backends.llamacpp import LlamaCppBackend, LlamaCppNativeBackend
from backends.openai import OpenAIBackend
from backends.profile import profile_of
from loadgen.cli.app import app
from loadgen.dispatch.engine import run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.signals import run_async
from loadgen.sidecars.poller import ServerStatePoller
from loadgen.timing.clock import RunClock
from workloads.base import SingleShot, Workload
from workloads.contracts import GenRequest, read_jsonl

pytestmark = pytest.mark.llamaserver
# -t 1: with -t 2 llama.cpp's two threads meet at a barrier every op; when the 2 cores are shared with
# the test client (or anything else) a descheduled thread stalls the other (measured here under load:
# 0.6 tok/s with -t 2 vs 15 tok/s with -t 1).
ROOT = Path(__file__).resolve().parents[1]
SERVER = "llama-server -m {model} -t 1 -c 8192 -np {np} --metrics --host 127.0.0.1 --port {port}"


@pytest.fixture(scope="module", autouse=True)
def llama_binary():
    """The binary from $SERVELAB_LLAMA_SERVER or the build script's cache (built if missing)."""
    if not os.environ.get(LLAMA_SERVER_ENV):
        out = subprocess.run(["bash", str(ROOT / "scripts/build_llama_server.sh")], capture_output=True, text=True)
        assert out.returncode == 0, f"llama-server build failed:\n{out.stderr[-2000:]}"
        os.environ[LLAMA_SERVER_ENV] = out.stdout.strip().splitlines()[-1]
    assert os.access(os.environ[LLAMA_SERVER_ENV], os.X_OK)


def _llama_server(tmp_path_factory, slots: int):
    """llama-server with ``slots`` parallel slots (-np), for the tests of one module."""
    port = free_port()
    log = tmp_path_factory.mktemp(f"llama{slots}") / "server.log"
    with ServerProcess(render_command(SERVER, {"np": str(slots)}, port), port, log, health_timeout_s=60) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _llama_server(tmp_path_factory, 2)


class Prompts(Workload):
    """Distinct prompts (so no slot reuses another's prompt cache) of roughly ``words`` words."""

    name = "test-prompts"

    def __init__(self, words: int, max_tokens: int, api: str = "completions") -> None:
        self.words, self.max_tokens, self.api = words, max_tokens, api

    def sessions(self, seed):
        i = 0
        while True:
            text = f"Request {seed}-{i}. " + " ".join(f"item{(i * 7 + k) % 97}" for k in range(self.words))
            prompt = [{"role": "user", "content": text}] if self.api == "chat" else text
            yield SingleShot(GenRequest(f"q{i}", prompt, self.max_tokens, api=self.api))
            i += 1


def run(backend, workload, out_dir, n, concurrency=1, sidecars=()):
    load = LoadSpec(concurrency=concurrency, num_requests=n, timeout=60, stall_timeout=30)
    summary = run_async(run_point(backend, workload, load, out_dir, RunClock(), sidecars))
    return summary, read_jsonl(out_dir / "requests.jsonl")


@pytest.fixture(scope="module")
def server16(tmp_path_factory):
    yield from _llama_server(tmp_path_factory, 16)


@pytest.mark.parametrize("concurrency", [4, 16])
def test_default_bench_run_has_no_errors(server16, tmp_path, concurrency):
    """Issue 17: as a user types it (auto -> llamacpp, default client), requests of exactly
    WAVE_TOKENS tokens finishing in waves (where llama-server's keep-alive closes bit) lose none."""
    recs = default_cli_run(server16.base_url, tmp_path, concurrency, backend="llamacpp")
    assert all(r["extra"]["timings"]["predicted_n"] == WAVE_TOKENS for r in recs)


def test_plain_openai_dialect_keeps_alive_without_errors(server16, tmp_path):
    """`--backend openai` keeps connections alive; llama-server closes them after streams and the
    client resends those requests once on a fresh connection (the issue's 24-of-48 failures). 48 requests:
    two wave boundaries where 16 finished streams' connections are reused at once. Whether the race
    happens in a given run is timing (it once did not: 1 failure in 608 on a quiet machine), so this test
    asserts what must hold either way: 0 errors, exact counts, at most one resend per request; the resend
    itself is proven deterministically against a server that drops idle connections on purpose
    (test_robust_runs.test_keepalive_race_is_retried_once_and_counted_exactly)."""
    recs = default_cli_run(server16.base_url, tmp_path, 16, backend="llamacpp", n=48, args=("--backend", "openai"))
    assert all(r["retries"] <= 1 for r in recs)


def test_native_stream_exact_counts(server, tmp_path):
    summary, recs = run(LlamaCppNativeBackend(server.base_url), Prompts(20, 24), tmp_path, n=3)
    assert summary["counts"]["ok"] == 3
    for r in recs:
        t = r["extra"]["timings"]
        assert r["output_tokens"] == t["predicted_n"] == 24  # ignore_eos: exactly max_tokens
        assert sum(tok for _, tok in r["events"]) == 24 and all(tok >= 1 for _, tok in r["events"])
        assert r["output_tokens_source"] == "usage" and r["finish_reason"] == "length"
        assert r["prompt_tokens"] == t["prompt_n"] + t["cache_n"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_openai_stream_exact_counts(server, tmp_path, api):
    backend = LlamaCppBackend(server.base_url, model="smol")
    summary, recs = run(backend, Prompts(20, 17, api), tmp_path, n=2)
    assert summary["counts"]["ok"] == 2
    for r in recs:
        assert r["output_tokens"] == r["extra"]["timings"]["predicted_n"] == 17
        assert r["output_tokens_source"] == "usage" and sum(tok for _, tok in r["events"]) == 17
        # one chunk per token, except that a token ending mid UTF-8 character is sent with the next
        assert len(r["events"]) == 17 or r["event_tokens"] == "spread"
        assert r["prompt_tokens"] == r["extra"]["timings"]["prompt_n"] + r["extra"]["timings"]["cache_n"]


def test_plain_openai_backend_counts_llama_completions_usage_once(server, tmp_path):
    """`--backend openai` on llama-server's /v1/completions: usage rides on the finish_reason chunk and is
    the final total, not a per-chunk delta (it used to be added to the per-event count: 2x tokens)."""
    # 6 requests on 2 slots: later ones reuse kept-alive connections llama-server may close (retried)
    summary, recs = run(OpenAIBackend(server.base_url, model="smol"), Prompts(20, 17), tmp_path, n=6, concurrency=2)
    assert summary["counts"]["ok"] == 6 and summary["counts"]["output_tokens"] == 6 * 17
    for r in recs:
        assert r["output_tokens"] == 17 and r["output_tokens_source"] == "usage"
        assert sum(tok for _, tok in r["events"]) == 17


LONG_PROMPTS = """
[[classes]]
name = "long"
prompt = { dist = "fixed", value = 600 }
output = { dist = "fixed", value = 32 }
"""


def test_bench_run_matches_server_timings(server, tmp_path):
    """`bench run` TTFT vs the server's prompt_ms, TPOT vs predicted_ms/(predicted_n-1), output tokens vs
    predicted_n: within 5 %. Long prompts keep TTFT dominated by prompt processing, as the server
    measures it (HTTP and tokenization add ~1 ms)."""
    (tmp_path / "long.toml").write_text(LONG_PROMPTS)
    res = CliRunner().invoke(app, [
        "run", "--url", server.base_url, "--backend", "llamacpp-native", "--workload", str(tmp_path / "long.toml"),
        "--concurrency", "1", "--num-requests", "3", "--output-dir", str(tmp_path), "--run-id", "agree",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    (point,) = json.loads((tmp_path / "agree" / "summary.json").read_text())["points"]
    recs = read_jsonl(tmp_path / "agree" / "points" / point["point_id"] / "requests.jsonl")
    timings = [r["extra"]["timings"] for r in recs]
    assert len(timings) == 3 and all(t["prompt_n"] + t["cache_n"] == 600 for t in timings)
    server_ttft = sum(t["prompt_ms"] for t in timings) / 3 / 1e3
    server_tpot = sum(t["predicted_ms"] / (t["predicted_n"] - 1) for t in timings) / 3 / 1e3
    ttft, tpot = point["latency"]["ttft"]["mean"], point["latency"]["tpot"]["mean"]
    report = {"ttft_client": ttft, "ttft_server": server_ttft, "tpot_client": tpot, "tpot_server": server_tpot}
    assert abs(ttft - server_ttft) / server_ttft < 0.05, report
    assert abs(tpot - server_tpot) / server_tpot < 0.05, report
    assert point["counts"]["output_tokens"] == sum(t["predicted_n"] for t in timings) == 3 * 32


def test_a_rerun_against_llama_server_is_seen_in_its_cache(server, tmp_path):
    """llama-server keeps prompts (its slots and its RAM prompt cache): the same run twice (one --seed)
    finds the second's prompts cached, which each response's usage says and the summary warns about; a new
    run id's prompts (no --seed) miss. It offers no cache reset, so --reset-cache is refused with exit 2."""
    wl = fixed_workload(tmp_path / "long.toml", 600, 4)
    first, again, fresh = (cli_point(server.base_url, wl, tmp_path, run_id, 2, *extra)[0]
                           for run_id, *extra in (("first", "--seed", "21"), ("again", "--seed", "21"), ("fresh",)))  # fmt: skip
    assert first["prefix_cache"]["hit_rate"] < 0.1 and "warning" not in first["prefix_cache"]
    assert again["prefix_cache"]["hit_rate"] > 0.9 and "warning" in again["prefix_cache"]
    assert fresh["prefix_cache"]["hit_rate"] < 0.1 and "warning" not in fresh["prefix_cache"]
    res = CliRunner().invoke(app, ["run", "--url", server.base_url, "--workload", str(wl), "--num-requests", "1",
                                   "--output-dir", str(tmp_path), "--reset-cache"])  # fmt: skip
    assert res.exit_code == 2 and "offers no prefix-cache reset" in " ".join(res.output.split()), res.output


def test_prompts_of_another_tokenizer_are_caught_by_the_servers_count(server, tmp_path):
    """Every run compares the prompt tokens the workload's tokenizer made with those the server counted
    (usage): with the served model's own (bundled) tokenizer they agree; with another's (a word-level
    tokenizer.json) the header (the server's /tokenize before the run), the summary, the table and the report say
    the prompts are not the lengths asked."""
    word_tokenizer(tmp_path / "words.json")
    wl = fixed_workload(tmp_path / "long.toml", 600, 4)
    own, own_out = cli_point(server.base_url, wl, tmp_path, "own", 2, "--seed", "31")
    other, out = cli_point(server.base_url, wl, tmp_path, "other", 2, "--seed", "31", "--tokenizer", str(tmp_path / "words.json"))
    assert own["prompt_lengths"]["intended"] == own["prompt_lengths"]["counted"] == 1200
    assert "warning" not in own["prompt_lengths"]
    assert other["prompt_lengths"]["intended"] == 1200 and other["prompt_lengths"]["ratio"] > 1.02
    # said before the run too: the first prompt counted by llama-server's /tokenize
    assert "the server counts" in out and "the server counts" not in own_out
    assert "the prompts are not the lengths asked" in out and "the prompts are not the lengths asked" in (
        tmp_path / "other" / "report.html").read_text()


def test_server_sweep_two_np_values(tmp_path):
    """`bench sweep --server ... --grid np=1,4`: one server per grid point, each point with its
    server-state time series, reconciled against what the client counted."""
    wl = fixed_workload(tmp_path / "short.toml", 48, 24)
    res = CliRunner().invoke(app, [
        "sweep", "--server", SERVER, "--grid", "np=1,4", "--backend", "llamacpp-native", "--workload", str(wl),
        "--concurrency", "4", "--num-requests", "8", "--warmup", "0", "--output-dir", str(tmp_path),
        "--run-id", "grid", "--server-timeout", "60",
        "--poll-hz", "10",  # the slots' series below must catch the busiest moment of a few-second point
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    run_dir = tmp_path / "grid"
    points = json.loads((run_dir / "summary.json").read_text())["points"]
    assert [p["point_id"] for p in points] == ["np1/c004", "np4/c004"]
    assert json.loads((run_dir / "run.json").read_text())["points"] == ["np1/c004", "np4/c004"]
    assert list(pd.read_csv(run_dir / "sweep.csv")["np"]) == [1, 4]
    for p, np_ in zip(points, (1, 4), strict=True):
        assert p["labels"] == {"np": str(np_)} and p["server_launch"]["params"] == {"np": str(np_)}
        assert p["counts"]["ok"] == 8
        assert (run_dir / "points" / f"np{np_}" / "server.log").stat().st_size > 0
        lines = (run_dir / "points" / f"np{np_}" / "c004" / "server_state.jsonl").read_text().splitlines()
        samples = [json.loads(x) for x in lines]
        assert len(samples) >= 5 and all("metrics" in s and "slots" in s for s in samples)
        srv = p["server"]
        # the server's own counter, reconciled over the point, equals what the client counted
        assert srv["point"]["counters"]["llamacpp:tokens_predicted_total"] == p["counts"]["output_tokens"]
        assert max(sum(sl["busy"] for sl in s["slots"]) for s in samples) == np_
        assert len(samples[0]["slots"]) == np_
        if np_ == 1:  # three of the four in-flight requests wait for the one slot
            assert srv["gauges"]["llamacpp:requests_deferred"]["max"] >= 1


def test_sweep_records_a_server_that_never_starts(tmp_path):
    bad = "llama-server -m /nonexistent-{np}.gguf --port {port}"
    results = sweep_servers(bad, server_grid(bad, ["np=2"]), tmp_path, lambda u, gp, so_far: [], health_timeout_s=30)
    assert results[0]["failed"]["kind"] == "launch" and "exited with code" in results[0]["failed"]["message"]


def test_spec_decode_acceptance_per_request_and_per_run(tmp_path):
    """llama-server drafting with a draft model (the same GGUF): per-request draft_n/draft_n_accepted
    in the records, and the run's acceptance from the server's counters, which must agree exactly."""
    template = SERVER.replace("-np {np}", "-np 1 -md {model} --spec-type draft-simple")
    port = free_port()
    with ServerProcess(render_command(template, {}, port), port, tmp_path / "server.log", health_timeout_s=60) as srv:
        backend = LlamaCppNativeBackend(srv.base_url)
        poller = ServerStatePoller(srv.base_url, profile_of(backend), hz=10)
        summary, recs = run(backend, Prompts(10, 24), tmp_path / "p", n=3, sidecars=[poller])
    drafted = sum(r["extra"]["spec_drafted"] for r in recs)
    accepted = sum(r["extra"]["spec_accepted"] for r in recs)
    spec = summary["server"]["point"]["spec_decode"]
    assert drafted > 0 and spec["drafted"] == drafted and spec["accepted"] == accepted
    assert spec["acceptance_rate"] == accepted / drafted > 0.5  # the draft model is the target model
    assert all(r["output_tokens"] == 24 for r in recs)


def test_recorded_traffic_replays_against_llama_server(server, tmp_path):
    """Issue 36: a ShareGPT file (every turn of every conversation, on the chat API) and a request-log JSONL
    with timestamps (sent at its recorded times, --speedup 1) against llama-server: 0 errors, each request
    scheduled at its recorded time, and sent on time (the 5 ms p99 figure is measured in docs/workloads.md; the
    bound here only catches a broken schedule)."""
    sharegpt = [{"conversations": [{"from": "human", "value": f"Question {i}: name a colour."},
                                   {"from": "gpt", "value": "Blue, like the sky."},
                                   {"from": "human", "value": "Another one?"}, {"from": "gpt", "value": "Green."}]}
                for i in range(3)]  # fmt: skip
    (tmp_path / "sg.json").write_text(json.dumps(sharegpt))
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"timestamp": 1000 + i * 0.1, "prompt": f"Line {i} of the log.", "max_tokens": 4})
                           + "\n" for i in range(20)))  # fmt: skip
    for run_id, workload, extra, n in (("sg", "sg.json", ["--api", "chat", "--concurrency", "2"], 6), ("log", "log.jsonl", [], 20)):
        res = CliRunner().invoke(app, ["run", "--url", server.base_url, "--workload", str(tmp_path / workload),
                                       "--output-dir", str(tmp_path), "--run-id", run_id, *extra])  # fmt: skip
        assert res.exit_code == 0, res.output
        (path,) = (tmp_path / run_id / "points").glob("*/requests.jsonl")
        recs = read_jsonl(path)
        assert len(recs) == n and not [r["error"] for r in recs if r["error"]]
    intended = sorted(r["intended"] for r in recs)
    assert [round(b - a, 6) for a, b in zip(intended, intended[1:], strict=False)] == [0.1] * 19
    lag = np.array([r["sent"] - r["intended"] for r in recs])
    assert lag.min() >= 0 and np.percentile(lag, 99) < 0.25, lag  # never early; late only by a broken schedule


THINK_TEMPLATE = ROOT / "tests" / "fixtures" / "think-chatml.jinja"
THINKING_SERVER = SERVER + " --jinja --chat-template-file {template} --reasoning-format deepseek"


def test_reasoning_stream_from_llama_server(tmp_path):
    """Issue 36: llama-server's own reasoning parser streams `reasoning_content` deltas, then `content`
    ones: a template whose generation prompt opens a <think> (as Qwen3's and DeepSeek-R1's do) makes the
    bundled model's first tokens reasoning, and the request's `reasoning_budget_tokens` makes the server
    close the block after 8. `bench run --api chat` as a user types it: every answer follows its reasoning,
    TTFT (first token of either) comes before TTFO (first answer token), and the printed summary and the
    report say both. This build states no `completion_tokens_details.reasoning_tokens`, so the count is
    the reasoning events' tokens."""
    port = free_port()
    argv = render_command(THINKING_SERVER, {"np": "1", "template": str(THINK_TEMPLATE)}, port)
    with ServerProcess(argv, port, tmp_path / "server.log", health_timeout_s=60) as srv:
        wl = fixed_workload(tmp_path / "short.toml", 32, 24)
        body = json.dumps({"reasoning_budget_tokens": 8})
        point, out = cli_point(srv.base_url, wl, tmp_path, "think", 4, "--api", "chat", "--extra-body", body)
    recs = read_jsonl(tmp_path / "think" / "points" / point["point_id"] / "requests.jsonl")
    for r in recs:
        assert 0 < r["first_output"] < len(r["events"]) and r["output_tokens"] == 24, r
        assert r["events"][r["first_output"]][0] > r["events"][0][0] and "reasoning_tokens" not in r["extra"]
    reasoning, lat = point["counts"]["reasoning_tokens"], point["latency"]
    assert 0 < reasoning < point["counts"]["output_tokens"] == 4 * 24
    assert lat["ttfo"]["count"] == 4, lat
    assert "prompt_lengths" not in point  # a chat request's prompt is the server's template's: not compared
    assert all(lat["ttft"][s] < lat["ttfo"][s] for s in ("min", "p50", "p99")), lat
    said = f"the model reasoned before answering: {reasoning} reasoning tokens"
    assert said in out and "(TTFO) p50" in out
    assert said in (tmp_path / "think" / "report.html").read_text()


EMBEDDING_SERVER = SERVER + " --embeddings --pooling mean"


def test_embeddings_live_through_run_sweep_report_and_gate(tmp_path):
    """Issue 36: llama-server `--embeddings` measured as a user would (support.pooling.embeddings_end_to_end).
    This build embeds only ~100-170 tokens/s on one thread here, so the texts are short."""
    port = free_port()
    with ServerProcess(render_command(EMBEDDING_SERVER, {"np": "4"}, port), port, tmp_path / "server.log",
                       health_timeout_s=60) as srv:  # fmt: skip
        embeddings_end_to_end(srv.base_url, tmp_path)
