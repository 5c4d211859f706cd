"""`bench`: input validation (clear message, non-zero exit, before any traffic) and a real run."""

import itertools
import json

import pytest
from typer.testing import CliRunner

from loadgen.cli.app import app
from loadgen.exitcodes import UsageError
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.metrics.slo import SloError, parse_slos
from loadgen.runoptions import parse_slo
from workloads.contracts import GenRequest, read_jsonl

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--url", "http://127.0.0.1:9", "--slo", "ttft=fast"], "--slo"),
        (["run", "--url", "http://127.0.0.1:9", "--concurrency", "4", "--rate", "2"], "not both"),
        (["run", "--url", "http://127.0.0.1:9", "--api", "grpc"], "--api"),
        (["run", "--url", "ftp://127.0.0.1:9"], "http://"),
        (["run", "--url", "http://127.0.0.1:9", "--arrival", "bursty"], "--arrival"),
        (["sweep", "--url", "http://127.0.0.1:9", "--concurrency", "1,x"], "comma-separated"),
        (["sweep", "--url", "http://127.0.0.1:9", "--rate", "0"], "> 0"),
        (["run", "--url", "http://127.0.0.1:9", "--api-key-env", "SERVELAB_TEST_UNSET_VAR"], "not set"),
        (["calibrate", "--concurrency", "0"], "positive"),
        (["calibrate", "--prompt-tokens", "0"], "positive"),
        (["calibrate", "--output-tokens", "-5"], "positive"),
        (["calibrate", "--api", "grpc"], "--api must be completions or chat"),
        (["calibrate", "--events", "16", "--output-tokens", "32"], "give one"),
        (["calibrate", "--api", "embeddings"], "--api must be completions or chat"),  # it times token streams
        # a pooling run (embeddings, rerank) generates no token: an SLO on one is refused, by --api or the workload
        (["run", "--url", "http://127.0.0.1:9", "--api", "embeddings", "--slo", "ttft=1s"], "generates no token"),
        (["capacity", "--url", "http://127.0.0.1:9", "--workload", "embeddings", "--slo", "tpot_p90=1s,e2e_p90=2s"],
         "tpot; limit its e2e"),
    ],
)
def test_bad_input_is_a_clear_error(args, message, monkeypatch):
    monkeypatch.delenv("SERVELAB_TEST_UNSET_VAR", raising=False)
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "error" in out and message in out


def test_parse_slo_units():
    assert parse_slo("ttft=500ms,tpot=50,e2e=2s") == pytest.approx({"ttft": 0.5, "tpot": 0.05, "e2e": 2.0})
    assert parse_slo(None) is None
    assert parse_slo("ttft=500us") == pytest.approx({"ttft": 0.0005})


def test_one_slo_grammar_and_each_command_says_which_form_it_takes():
    """Goodput's per-request limits and capacity's percentiles are one grammar (loadgen/metrics/slo.py); a key in the
    other command's form is an error that shows how to write it here."""
    with pytest.raises(UsageError, match="write ttft=1s"):
        parse_slo("ttft_p99=1s")
    with pytest.raises(UsageError, match="max-error-rate"):
        parse_slo("ttft=1s,error_rate=1%")
    with pytest.raises(SloError, match="ttft_p99=1s"):
        parse_slos("ttft=1s", percentiles=True)
    (slo,) = parse_slos("tpot_p90=60", percentiles=True)
    assert (slo.key, slo.limit, slo.allowed) == ("tpot_p90", pytest.approx(0.06), pytest.approx(0.1))


def test_bench_run_writes_the_results_layout(null_server, tmp_path):
    res = runner.invoke(app, ["run", "--url", null_server, "--concurrency", "2", "--num-requests", "6",
                              "--warmup", "1", "--output-dir", str(tmp_path), "--run-id", "r1", "--poll-hz", "0",
                              "--telemetry-hz", "0", "--slo", "ttft=1s"])
    assert res.exit_code == 0, res.output
    run_dir = tmp_path / "r1"
    for name in ("run.json", "summary.json", "sweep.csv", "sweep.parquet", "points/c002/requests.jsonl",
                 "points/c002/summary.json"):
        assert (run_dir / name).is_file(), name
    lines = (run_dir / "points/c002/requests.jsonl").read_text().splitlines()
    assert len(lines) == 7
    point = json.loads((run_dir / "points/c002/summary.json").read_text())
    assert point["counts"]["ok"] == 6 and point["goodput"]["good"] == 6 and point["per_class"]
    assert "c002" in " ".join(res.output.split())


def test_runs_and_points_send_fresh_prompts_and_the_recorded_seed_repeats_them(null_server, tmp_path):
    """Without --seed a run's seed comes from its run id (run.json records it) and each point has its own:
    two runs and two points never share a seed, so neither prompts; --seed with a recorded value gives every
    point's seed, and so its prompts, again."""

    def sweep(rid: str, *extra: str) -> tuple[int, list[int]]:
        res = runner.invoke(app, ["sweep", "--url", null_server, "--concurrency", "1,2", "--num-requests", "3",
                                  "--warmup", "0", "--output-dir", str(tmp_path), "--run-id", rid, "--poll-hz", "0",
                                  "--telemetry-hz", "0", *extra])
        assert res.exit_code == 0, res.output
        doc = json.loads((tmp_path / rid / "summary.json").read_text())
        assert all(p["counts"]["ok"] == 3 for p in doc["points"])
        return doc["config"]["seed"], [p["load"]["seed"] for p in doc["points"]]

    seed_a, points_a = sweep("a")
    seed_b, points_b = sweep("b")
    assert seed_a != seed_b and len(set(points_a + points_b)) == 4
    assert sweep("c", "--seed", str(seed_a)) == (seed_a, points_a)


def test_bench_run_replays_a_whole_trace_by_default(null_server, tmp_path):
    """A trace is finite: without --num-requests it runs to its last row (200 here), not to a default cap."""
    res = runner.invoke(app, ["run", "--url", null_server, "--workload", "workloads/data/sample_azure.csv",
                              "--speedup", "4", "--output-dir", str(tmp_path), "--run-id", "tr", "--poll-hz", "0",
                              "--telemetry-hz", "0"])
    assert res.exit_code == 0, res.output
    (point,) = (tmp_path / "tr" / "points").rglob("summary.json")
    assert json.loads(point.read_text())["counts"]["ok"] == 200


def test_tokenizer_option_uses_the_given_file_and_rejects_bad_ones(null_server, tmp_path):
    """A given --tokenizer is used as it is; auto (the default) against a server whose model names no tokenizer
    here and that has no tokenize endpoint to confirm the bundled one (the null server) warns."""
    from reference_server.model_files import default_model_path, tokenizer_from_gguf

    good = tmp_path / "tokenizer.json"
    tokenizer_from_gguf(default_model_path()).save(str(good))
    base = ["run", "--url", null_server, "--concurrency", "1", "--num-requests", "2", "--output-dir", str(tmp_path),
            "--poll-hz", "0", "--telemetry-hz", "0"]
    res = runner.invoke(app, [*base, "--tokenizer", str(good), "--run-id", "ok"])
    assert res.exit_code == 0, res.output
    assert "no tokenize endpoint" not in res.output
    assert json.loads((tmp_path / "ok" / "run.json").read_text())["config"]["tokenizer"] == str(good)
    res = runner.invoke(app, [*base, "--run-id", "auto"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "warning: the server has no tokenize endpoint" in out
    assert "(--tokenizer auto: no tokenizer of the served model 'null' here)" in out
    assert json.loads((tmp_path / "auto" / "run.json").read_text())["config"]["tokenizer"] is None
    bad = tmp_path / "bad.json"
    bad.write_text("not a tokenizer")
    for path, message in ((tmp_path / "missing.json", "not found"), (bad, "tokenizer")):
        res = runner.invoke(app, [*base, "--tokenizer", str(path)])
        assert res.exit_code == 2, res.output
        out = " ".join(res.output.split())
        assert "error" in out and "--tokenizer" in out and message in out


def test_calibrate_measures_the_traffic_given_and_records_it(tmp_path):
    """`bench calibrate --prompt-tokens 2000 --api chat --output-tokens 50`: both points send 2000-token prompts,
    each its own, on the chat API and get 50 events (tokens) back, and calibrate.json says so."""
    res = runner.invoke(app, ["calibrate", "--concurrency", "4", "--num-requests", "40", "--duration", "1", "--rate",
                              "20", "--prompt-tokens", "2000", "--api", "chat", "--output-tokens", "50",
                              "--output-dir", str(tmp_path), "--run-id", "cal"])  # fmt: skip
    assert res.exit_code == 0, res.output
    header = "calibrating chat API, 2000-token prompts, 50 events (output tokens) per response"
    assert header in " ".join(res.output.split())
    doc = json.loads((tmp_path / "cal" / "calibrate.json").read_text())
    assert doc["traffic"] == {"api": "chat", "prompt_tokens": 2000, "events": 50}
    for point in ("closed", "open"):
        assert doc[point]["errors"] == 0 and doc[point]["requests"] > 0
        assert json.loads((tmp_path / "cal" / point / "point.json").read_text())["workload"]["api"] == "chat"
        recs = read_jsonl(tmp_path / "cal" / point / "requests.jsonl")
        # the null server's usage counts the whitespace-separated words of the message it received: each word is
        # at least one token, and the corpus has about 0.83 words a token; each prompt its own, so counts vary
        words = [r["prompt_tokens"] for r in recs]
        assert {r["prompt_tokens_source"] for r in recs} == {"usage"}
        assert all(1400 < w <= 2000 for w in words), words
        assert len(set(words)) > len(recs) // 4 and {r["output_tokens"] for r in recs} == {50}


def test_fixed_workload_prompts_are_exact_and_each_its_own():
    """`FixedWorkload(prompt_tokens=N)` (bench calibrate --prompt-tokens): every request's prompt is N tokens
    of the bundled tokenizer and differs from the others; on completions the request says so (chat leaves the
    count to the server, whose template adds tokens); the same seed gives the same prompts."""

    def firsts(wl: FixedWorkload, n: int) -> list[GenRequest]:
        return [s.first() for s in itertools.islice(wl.sessions(7), n)]

    wl = FixedWorkload(max_tokens=8, prompt_tokens=300)
    reqs = firsts(wl, 20)
    assert wl.builder is not None and all(wl.builder.count(r.prompt) == 300 for r in reqs)
    assert len({r.prompt for r in reqs}) == 20
    assert {(r.prompt_tokens, r.api) for r in reqs} == {(300, "completions")}
    assert firsts(wl, 20) == reqs
    chat = firsts(FixedWorkload(prompt_tokens=300, api="chat"), 3)
    assert {(r.prompt_tokens, r.api) for r in chat} == {(None, "chat")}
    assert all(wl.builder.count(r.prompt) == 300 for r in chat)
    assert {r.prompt for r in firsts(FixedWorkload(), 3)} == {FixedWorkload.prompt}
    assert FixedWorkload().builder is None  # no tokenizer loaded for the short fixed prompt
