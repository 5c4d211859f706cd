"""`bench`: input validation (clear message, non-zero exit, before any traffic) and a real run."""

import json

import pytest
from typer.testing import CliRunner

from loadgen.cli import app
from loadgen.options import parse_slo

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
    from reference_server.model_files import default_model_path, tokenizer_from_gguf

    good = tmp_path / "tokenizer.json"
    tokenizer_from_gguf(default_model_path()).save(str(good))
    base = ["run", "--url", null_server, "--concurrency", "1", "--num-requests", "2", "--output-dir", str(tmp_path),
            "--poll-hz", "0", "--telemetry-hz", "0"]
    res = runner.invoke(app, [*base, "--tokenizer", str(good), "--run-id", "ok"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "ok" / "run.json").read_text())["config"]["tokenizer"] == str(good)
    bad = tmp_path / "bad.json"
    bad.write_text("not a tokenizer")
    for path, message in ((tmp_path / "missing.json", "not found"), (bad, "tokenizer")):
        res = runner.invoke(app, [*base, "--tokenizer", str(path)])
        assert res.exit_code == 2, res.output
        out = " ".join(res.output.split())
        assert "error" in out and "--tokenizer" in out and message in out
