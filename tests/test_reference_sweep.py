"""`bench sweep --server` with the bundled reference server: the same launcher as for llama-server, plus
its exact per-iteration records fetched into iterations.jsonl for every point."""

import json
from pathlib import Path

import pytest
from support.cli import cli_point, fixed_workload, word_tokenizer
from support.hub import offline_hub_cache
from test_robust_runs import default_cli_run  # tests/ is on sys.path
from typer.testing import CliRunner

from loadgen.cli.app import app
from loadgen.cli.targets import embedded_server


def test_reference_server_grid_with_iterations(tmp_path):
    wl = fixed_workload(tmp_path / "short.toml", 32, 12)
    res = CliRunner().invoke(app, [
        "sweep", "--server", "python -m reference_server --port {port} --threads 1 --max-num-seqs {seqs}",
        "--grid", "seqs=1,2", "--workload", str(wl), "--concurrency", "2",
        "--num-requests", "4", "--warmup", "0", "--output-dir", str(tmp_path), "--run-id", "ref",
        "--server-timeout", "180",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    points = json.loads((tmp_path / "ref" / "summary.json").read_text())["points"]
    assert [p["point_id"] for p in points] == ["seqs1/c002", "seqs2/c002"]
    for p, seqs in zip(points, (1, 2), strict=True):
        assert p["counts"]["ok"] == 4 and p["counts"]["output_tokens"] == 48
        its = [json.loads(x) for x in (tmp_path / "ref" / "points" / p["point_id"] / "iterations.jsonl").open()]
        assert p["server"]["iterations"]["count"] == len(its) > 0
        assert max(r["num_running"] for r in its) == seqs  # the grid parameter reached the server
        assert all(p["t_start"] - 1 <= r["t"] <= p["t_end"] for r in its)  # on the run clock
        # the server's counter (scraped by the poller), its iteration log and the client agree on the
        # tokens generated; each request's first token comes out of its prefill step, so decode steps
        # computed 48 - 4 or (if counted) 48 tokens
        assert p["server"]["point"]["counters"]["servelab_generation_tokens_total"] == 48
        assert sum(r["output_tokens"] for r in its) == 48
        assert 48 - 4 <= sum(r["decode_tokens"] for r in its) <= 48


@pytest.fixture(scope="module")
def reference_url(tmp_path_factory):
    with embedded_server(tmp_path_factory.mktemp("ref") / "server.log") as url:
        yield url


@pytest.mark.parametrize("concurrency", [4, 16])
def test_default_bench_run_has_no_errors(reference_url, tmp_path, concurrency):
    """Issue 17 against the bundled reference server: default backend (auto: identified by its own
    /v1/models, driven as OpenAI) and client, requests of exactly WAVE_TOKENS tokens in waves, 0 errors."""
    default_cli_run(reference_url, tmp_path, concurrency, backend="openai")


def test_a_rerun_is_answered_by_the_prefix_cache_until_it_is_reset(reference_url, tmp_path):
    """The same run twice (one --seed) against one server: the second finds its prompts in the server's
    prefix cache, and its summary, table and report say so and warn; --reset-cache empties the cache before
    the point, and the same prompts miss again."""
    wl = fixed_workload(tmp_path / "p200.toml", 200, 4)
    first, _ = cli_point(reference_url, wl, tmp_path, "first", 3, "--seed", "11")
    again, out = cli_point(reference_url, wl, tmp_path, "again", 3, "--seed", "11")
    reset, out_reset = cli_point(reference_url, wl, tmp_path, "reset", 3, "--seed", "11", "--reset-cache")
    assert first["prefix_cache"]["source"] == "responses" and first["prefix_cache"]["hit_rate"] < 0.1
    assert again["prefix_cache"]["hit_rate"] > 0.9 and "warning" in again["prefix_cache"]
    assert "the server had seen these prompts before" in out
    assert (tmp_path / "again" / "report.html").read_text().count("the server had seen these prompts before") >= 1
    assert reset["cache_reset"] == {"path": "/reset_prefix_cache", "ok": True, "status": 200}
    assert reset["prefix_cache"]["cached_tokens"] == 0 and "had seen" not in out_reset
    # the server's own counters agree with what its responses said
    assert again["server"]["point"]["prefix_cache"]["cached_tokens"] == again["prefix_cache"]["cached_tokens"]


def test_tokenize_counts_what_the_server_counts(reference_url):
    """``POST /tokenize`` (vLLM's shape) counts a prompt or chat messages as the server does when it serves
    them (usage.prompt_tokens); a body with neither, both or another model is a 4xx JSON error."""
    import httpx

    prompt, messages = "The quick brown fox jumps over the lazy dog.", [{"role": "user", "content": "Hello there!"}]
    with httpx.Client(base_url=reference_url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for body, api in (({"prompt": prompt}, "/v1/completions"), ({"messages": messages}, "/v1/chat/completions")):
            tok = c.post("/tokenize", json={"model": model, **body, "add_special_tokens": None}).json()
            served = c.post(api, json={"model": model, **body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
            assert tok["count"] == len(tok["tokens"]) == served > 3 and tok["max_model_len"] > 0, (body, tok)
        for bad in ({}, {"prompt": prompt, "messages": messages}, {"prompt": 3}, {"model": "other", "prompt": "x"}):
            r = c.post("/tokenize", json=bad)
            assert 400 <= r.status_code < 500 and "message" in r.json()["error"], (bad, r.text)


@pytest.mark.parametrize("by", ["folder", "hub id"])
def test_without_tokenizer_flag_the_served_models_own_is_used(tmp_path, monkeypatch, by):
    """`bench run --url` with no --tokenizer (auto): a server whose model id names a folder with a tokenizer.json
    (as vLLM serving a local model does) or a Hugging Face id in the cache (offline) gets prompts cut with that
    tokenizer; their lengths are the server's count."""
    import sys

    from backends.launcher import ServerProcess, free_port
    from reference_server.model_files import default_model_path, tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(default_model_path())
    if by == "folder":
        served = str(tmp_path / "served-model")
        Path(served).mkdir()
        tokenizer.save(f"{served}/tokenizer.json")
    else:
        served = "acme/served-lm"
        offline_hub_cache(tmp_path / "hf", served, tokenizer, monkeypatch)
    wl = fixed_workload(tmp_path / "w.toml", 300, 4)
    port = free_port()
    cmd = [sys.executable, "-m", "reference_server", "--port", str(port), "--threads", "1", "--served-model-name",
           served]  # fmt: skip
    with ServerProcess(cmd, port, tmp_path / "server.log", health_timeout_s=180) as srv:
        point, out = cli_point(srv.base_url, wl, tmp_path, "auto", 3)
    assert f"tokenizer: the served model's ({served})" in out
    assert "the server counts" not in out  # its /tokenize, asked before the run, agrees
    assert json.loads((tmp_path / "auto" / "run.json").read_text())["config"]["tokenizer"] == served
    assert point["prompt_lengths"]["intended"] == point["prompt_lengths"]["counted"] == 900


def test_tokenizer_auto_falls_back_to_the_workloads_own_and_the_servers_count_judges_it(reference_url, tmp_path):  # fmt: skip
    """--tokenizer auto (the default) against a server whose model id names no tokenizer here (the reference
    server's: its GGUF's stem): the workload's own tokenizer, with no warning where the server's /tokenize counts
    the first prompt as meant (the bundled model served), with one naming auto's fallback where it does not (a
    workload file naming another tokenizer)."""
    wl = fixed_workload(tmp_path / "w.toml", 300, 4)
    point, out = cli_point(reference_url, wl, tmp_path, "auto", 2)
    assert "tokenizer: the workload's own (no tokenizer of the served model" in out
    assert "the server counts" not in out and "no tokenize endpoint" not in out
    assert point["prompt_lengths"]["intended"] == point["prompt_lengths"]["counted"] == 600
    assert json.loads((tmp_path / "auto" / "run.json").read_text())["config"]["tokenizer"] is None
    other = tmp_path / "other.toml"
    other.write_text(f'tokenizer = "{word_tokenizer(tmp_path / "words.json")}"\n{wl.read_text()}')
    point, out = cli_point(reference_url, other, tmp_path, "other", 2, "--tokenizer", "auto")
    assert "the server counts" in out and "(--tokenizer auto: no tokenizer of the served model" in out
    assert point["prompt_lengths"]["ratio"] > 1.02


def test_the_servers_own_count_is_asked_before_the_run(reference_url, tmp_path):
    """targets.server_counts: the reference server (driven by the plain OpenAI backend, whose profile has no
    tokenize path) is found through the known servers' endpoints; prompts cut with another tokenizer are
    named before any load, prompts cut with its own are not."""
    from loadgen.cli.targets import make_backend, server_counts
    from workloads.loader import load_workload

    word_tokenizer(tmp_path / "words.json")
    wl = fixed_workload(tmp_path / "w.toml", 300, 4)
    be = make_backend("openai", reference_url, None, None, None, False, None)
    assert server_counts(be, [load_workload(str(wl))], 5) == []
    (warning,) = server_counts(be, [load_workload(str(wl), tokenizer=str(tmp_path / "words.json"))], 5)
    assert "cut to 300" in warning and "--tokenizer" in warning
