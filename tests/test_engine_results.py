"""OpenAI request bodies, the backend registry, the results directory and fingerprints."""

import json

import pandas as pd
import pytest

from backends.base import ParseState
from backends.openai import OpenAIBackend
from backends.registry import get_backend
from loadgen.records.results import ResultsDir, environment, fingerprint, scrub, sweep_row
from workloads.contracts import GenRequest


def test_openai_bodies_completions_and_chat():
    be = OpenAIBackend("http://127.0.0.1:1/", model="m", api_key="sk-secret", continuous_usage=True,
                       extra_body={"top_k": 1})
    req = GenRequest("r", "hi", 7, extra_body={"min_tokens": 7}, seed=3)
    call = be.build(req)
    assert call.path == "/v1/completions" and call.headers == {"Authorization": "Bearer sk-secret"}
    assert call.body["prompt"] == "hi" and call.body["max_tokens"] == 7 and call.body["stream"] is True
    assert call.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert call.body["ignore_eos"] is True and call.body["seed"] == 3
    assert call.body["top_k"] == 1 and call.body["min_tokens"] == 7
    chat = OpenAIBackend("http://x", api="chat").build(GenRequest("r", [{"role": "user", "content": "yo"}], 2))
    assert chat.path == "/v1/chat/completions" and chat.body["messages"] == [{"role": "user", "content": "yo"}]
    assert "sk-secret" not in json.dumps(be.describe())


def test_openai_parse_chunk_usage_and_final_usage():
    be, st = OpenAIBackend("http://x", continuous_usage=True), ParseState()
    d1 = be.parse('{"choices":[{"text":"a b","finish_reason":null}],"usage":{"completion_tokens":2}}', st)[0]
    d2 = be.parse('{"choices":[{"text":"c","finish_reason":"length"}],"usage":{"completion_tokens":3}}', st)[0]
    assert (d1.tokens, d1.tokens_source, d2.tokens, d2.finish_reason) == (2, "chunk_usage", 1, "length")
    u = be.parse('{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}', st)[0]
    assert (u.prompt_tokens, u.completion_tokens, u.tokens_source) == (5, 3, "usage")
    assert be.parse("[DONE]", st)[0].done
    assert be.parse('{"error":{"message":"boom"}}', st)[0].error == "boom"
    with pytest.raises(ValueError, match="not JSON"):
        be.parse("{nope", st)


def test_registry_finds_builtins_and_explains_unknown():
    assert get_backend("openai") is OpenAIBackend
    with pytest.raises(KeyError, match="available: .*openai"):
        get_backend("nope")


def test_results_dir_writes_run_summary_and_sweep(tmp_path):
    rd = ResultsDir(tmp_path / "run1")
    run = rd.write_run({"url": "u", "api_key": "sk-secret", "nested": {"Authorization": "Bearer x"}}, 123.0, ["c001"])
    text = (tmp_path / "run1" / "run.json").read_text()
    assert "sk-secret" not in text and "Bearer x" not in text
    assert run["t0_unix"] == 123.0 and run["fingerprint"] == fingerprint({"config": scrub(run["config"]), "workloads": None})
    point = {"point_id": "c001", "load": {"process": "closed", "concurrency": 1}, "workload": {"name": "w"},
             "counts": {"requests": 2, "ok": 2}, "latency": {"ttft": {"p50": 0.1}},
             "throughput": {"steady": {"req_per_s": 3.0}}, "errors": {"rate": 0.0, "by_kind": {"stall": 1}},
             "client": {"schedule_lag": {"p99": 0.001}, "warnings": ["x"]}}
    rd.write_summary(run, [point])
    row = sweep_row(point)
    assert row["ttft_p50"] == 0.1 and row["steady_req_per_s"] == 3.0 and row["errors_stall"] == 1
    assert row["client_schedule_lag_p99"] == 0.001 and "client_warnings" not in row
    df = pd.read_parquet(tmp_path / "run1" / "sweep.parquet")
    assert list(df["point_id"]) == ["c001"] and pd.read_csv(tmp_path / "run1" / "sweep.csv")["ttft_p50"][0] == 0.1
    top = json.loads((tmp_path / "run1" / "summary.json").read_text())
    assert top["points"][0]["point_id"] == "c001" and top["environment"]["cpu_count"] >= 1


def test_environment_and_fingerprint():
    env = environment()
    assert env["python"] and env["cpu_model"] and "numpy" in env["packages"]
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1}) != fingerprint({"a": 2, "b": 2})
