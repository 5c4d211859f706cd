"""Recorded traffic as a workload (workloads/datasets.py): ShareGPT conversations, a JSONL of OpenAI request
bodies, a text column; parsed strictly, sent as recorded, replayed at their times or under any arrivals."""

import json

import pytest
from typer.testing import CliRunner

from loadgen.cli.app import app
from workloads.datasets import DEFAULT_OUTPUT, DatasetWorkload
from workloads.loader import load_workload
from workloads.text import builder_for
from workloads.validation import WorkloadError

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Name three rivers."},
                                  {"from": "gpt", "value": "The Nile, the Amazon and the Danube."},
                                  {"from": "human", "value": "Which is longest?"},
                                  {"from": "gpt", "value": "The Nile, by most measures."}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "A question nobody answered."}]},
]  # fmt: skip


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sharegpt_conversations_keep_their_turns_history_and_reply_lengths(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    wl = load_workload(str(path), api="chat")
    assert isinstance(wl, DatasetWorkload) and wl.finite and wl.arrival.process is None  # no times: any arrivals
    first, second = list(wl.sessions(0))  # the unanswered conversation is skipped
    count = builder_for("bundled").count
    req = first.first()
    assert req.prompt == [{"role": "user", "content": "Name three rivers."}]
    assert req.max_tokens == count("The Nile, the Amazon and the Danube.") and req.api == "chat"
    think, nxt = first.next("Rhine, Po, Ebro.")  # the server's own reply goes into the history
    assert think == 0.0 and nxt.max_tokens == count("The Nile, by most measures.")
    assert [m["content"] for m in nxt.prompt] == ["Name three rivers.", "Rhine, Po, Ebro.", "Which is longest?"]
    assert first.next("The Nile.") is None
    assert second.first().prompt[0] == {"role": "system", "content": "Be brief."}
    completions = next(load_workload(str(path)).sessions(0))
    assert completions.first().prompt == "Name three rivers." and completions.first().api == "completions"
    assert completions.next("Rhine.")[1].prompt.endswith("User: Which is longest?\nAssistant:")


def test_request_bodies_are_sent_as_recorded_at_their_times(tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    path = _jsonl(tmp_path / "bodies.jsonl", [
        {"timestamp": 105.5, "model": "x", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 7,
         "tools": tools, "tool_choice": "auto", "stream": False},
        {"timestamp": 100.0, "prompt": "Once upon a time", "temperature": 0.7},
    ])  # fmt: skip
    wl = load_workload(str(path))
    assert wl.arrival.process == "trace"
    early, late = list(wl.sessions(0))  # in time order, times relative to the first
    assert (early.at, late.at) == (0.0, 5.5)
    assert early.first().prompt == "Once upon a time" and early.first().max_tokens == DEFAULT_OUTPUT
    assert early.first().extra_body == {"temperature": 0.7}
    req = late.first()
    assert req.api == "chat" and req.max_tokens == 7 and req.prompt == [{"role": "user", "content": "Weather?"}]
    assert req.extra_body == {"tools": tools, "tool_choice": "auto"}  # model, stream, timestamp: the harness's
    assert next(load_workload(str(path), output=9).sessions(0)).first().max_tokens == 9  # where the data has none


def test_text_column_needs_its_field_and_bad_data_is_named(tmp_path):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "Why is the sky blue?", "max_tokens": 5}, {"question": "And why?"}])
    with pytest.raises(WorkloadError, match="--dataset-field"):
        load_workload(str(path))
    a, b = list(load_workload(str(path), field="question").sessions(0))
    assert (a.first().prompt, a.first().max_tokens, b.first().max_tokens) == ("Why is the sky blue?", 5, DEFAULT_OUTPUT)
    for rows, where in [([{"prompt": "x", "timestamp": 1}, {"prompt": "y"}], "timestamp"),
                        ([{"prompt": "x", "max_tokens": 0}], "line 1.max_tokens"),
                        ([{"messages": "not a list"}], "line 1")]:  # fmt: skip
        with pytest.raises(WorkloadError, match=where):
            load_workload(str(_jsonl(tmp_path / "bad.jsonl", rows)))
    res = CliRunner().invoke(app, ["workloads", "validate", str(path), "--dataset-field", "question"])
    assert res.exit_code == 0, res.output
    toml = tmp_path / "qa.toml"
    toml.write_text('[trace]\npath = "qa.jsonl"\nformat = "text"\nfield = "question"\noutput = 11\n')
    assert [s.first().max_tokens for s in load_workload(str(toml)).sessions(0)] == [5, 11]
    toml.write_text('[trace]\npath = "qa.jsonl"\nfield = "question"\nformat = "openai"\n')
    with pytest.raises(WorkloadError, match="trace.field"):
        load_workload(str(toml))


def test_datasets_run_live_replayed_and_under_a_rate(null_server, tmp_path):
    """A ShareGPT file through `bench run` sends every turn of every conversation; timed bodies replay at their
    recorded spacing, and under --rate the same requests follow the rate's schedule instead."""
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps(SHAREGPT))
    res = CliRunner().invoke(app, ["run", "--url", null_server, "--workload", str(sg), "--concurrency", "2",
                                   "--output-dir", str(tmp_path), "--run-id", "sg", "--poll-hz", "0"])  # fmt: skip
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in (tmp_path / "sg" / "points" / "c002" / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == ["r0.0", "r0.1", "r1"] and not any(r["error"] for r in recs)
    bodies = _jsonl(tmp_path / "b.jsonl", [{"timestamp": t, "prompt": f"p{t}", "max_tokens": 2} for t in (0, 1.5, 3)])
    for run_id, extra, spacing in [("replay", ["--speedup", "3"], 0.5), ("rated", ["--rate", "40"], None)]:
        res = CliRunner().invoke(app, ["run", "--url", null_server, "--workload", str(bodies), "--output-dir",
                                       str(tmp_path), "--run-id", run_id, "--poll-hz", "0", *extra])  # fmt: skip
        assert res.exit_code == 0, res.output
        (point,) = (tmp_path / run_id / "points").glob("*/requests.jsonl")
        recs = sorted((json.loads(line) for line in point.read_text().splitlines()), key=lambda r: r["intended"])
        assert len(recs) == 3 and not any(r["error"] for r in recs)
        gaps = [b["intended"] - a["intended"] for a, b in zip(recs, recs[1:], strict=False)]
        if spacing is not None:
            assert gaps == pytest.approx([spacing, spacing], abs=1e-6)
        else:
            assert gaps != pytest.approx([0.5, 0.5], abs=1e-3) and sum(gaps) < 1.0  # Poisson at 40/s, not 1.5 s apart
