"""Workload files: validation (every error names the file, the key and what was expected), overrides, schedules,
traces, length distributions, ``describe`` and the ``bench workloads`` CLI."""

import json
import random
from itertools import islice

import pytest
from support.workload_file import write
from typer.testing import CliRunner

from workloads.cli import app
from workloads.loader import load_workload
from workloads.validation import WorkloadError


def test_overrides_and_arrival_from_file():
    wl = load_workload("rag")
    assert (wl.arrival.process, wl.arrival.rate) == ("poisson", 1.0)
    wl = load_workload("rag", process="closed", concurrency=3, rate=None)
    assert (wl.arrival.process, wl.arrival.concurrency, wl.arrival.rate) == ("closed", 3, 1.0)
    with pytest.raises(WorkloadError, match="rate"):
        load_workload("rag", rate=-1)
    with pytest.raises(TypeError, match="unknown workload override"):
        load_workload("rag", speed=2)
    assert {s.first().max_tokens for s in islice(load_workload("short-long-50-50", output=7).sessions(0), 8)} == {7}
    with pytest.raises(WorkloadError, match="output"):
        load_workload("rag", output=0)


def test_scheduled_classes_are_sent_in_time_order(tmp_path):
    p = write(tmp_path, '[[classes]]\nname = "a"\nprompt = 9\nat = [2, 0]\n'
                        '[[classes]]\nname = "b"\nprompt = 11\nat = [0, 1.5]\n')  # fmt: skip
    wl = load_workload(str(p))
    assert wl.arrival.process == "trace"
    sent = [(s.at, s.first().workload_class, s.first().prompt_tokens) for s in wl.sessions(3)]
    assert sent == [(0.0, "a", 9), (0.0, "b", 11), (1.5, "b", 11), (2.0, "a", 9)]
    assert wl.describe()["spec"]["classes"][0]["at"] == [2.0, 0.0]
    # a workload without a schedule (or texts per request, or a model) describes and fingerprints as before
    assert not {"at", "inputs", "model"} & set(load_workload("chat-short").describe()["spec"]["classes"][0])
    assert load_workload("embeddings").describe()["spec"]["classes"][0]["inputs"] == 8


BAD = [
    (
        '[[classes]]\nname = "x"\nprompt = { dist = "normal", mean = "lots", std = 3 }\n',
        "classes[0].prompt.mean",
        "expected a number",
    ),
    (
        '[[classes]]\nname = "x"\noutput = "many"\n',
        "classes[0].output",
        "expected a number or a distribution table",
    ),
    ('[[classes]]\nname = "x"\nweight = true\n', "classes[0].weight", "expected a number"),
    ("[[classes]]\nname = 5\n", "classes[0].name", "expected a string"),
    ('[arrival]\nrate = "fast"\n[[classes]]\nname = "x"\n', "arrival.rate", "expected a number"),
    ('[arrival]\nprocess = "bursty"\n[[classes]]\nname = "x"\n', "arrival.process", "expected one of"),
    ('[[classes]]\nname = "x"\nprompt = { dist = "zipf" }\n', "classes[0].prompt.dist", "expected one of"),
    ('[[classes]]\nname = "x"\npromt = 5\n', "classes[0].promt", "unknown key"),
    (
        '[[classes]]\nname = "x"\nshared_prefix = { tokens = 10, fraction = 2 }\n',
        "classes[0].shared_prefix.fraction",
        "between 0 and 1",
    ),
    ('[[classes]]\nname = "x"\nturns = { think_time = 1 }\n', "classes[0].turns.count", "is required"),
    (
        '[[classes]]\nname = "x"\nprompt = { dist = "empirical", values = [1, "b"] }\n',
        "classes[0].prompt.values[1]",
        "expected a number",
    ),
    ('[[classes]]\nname = "x"\ncontent = "code-edit"\nprompt = 5\n', "classes[0].prompt", "not allowed"),
    ('name = "nothing"\n', "classes", "is required"),
    (
        'api = "chat"\n[[classes]]\nname = "x"\ntemplate = "chatml"\n',
        "classes[0].template",
        "expected 'none'",
    ),
    ('[[classes]]\nname = "x"\n[[classes]]\nname = "x"\n', "classes[1].name", "unique"),
    ('[[classes]]\nname = "x"\nat = [0, -1]\n', "classes[0].at", "send times in seconds >= 0"),
    ('[[classes]]\nname = "x"\nat = [0]\n[[classes]]\nname = "y"\n', "classes[1].at", "is required"),
    ('[arrival]\nprocess = "closed"\n[[classes]]\nname = "x"\nat = [0]\n', "arrival.process", "expected 'trace'"),
    ('[[classes]]\nname = "x"\nat = [0]\nturns = { count = 2 }\n', "classes[0].at", "not allowed together"),
    ('[[classes]]\nname = "x"\ninputs = 4\n', "classes[0].inputs", "only applies with api = 'embeddings' or 'rerank'"),
    ('api = "embeddings"\n[[classes]]\nname = "x"\ninputs = 0\n', "classes[0].inputs", ">= 1"),
]


@pytest.mark.parametrize(("text", "key", "expected"), BAD)
def test_malformed_file_names_file_key_and_expected_type(tmp_path, text, key, expected):
    p = write(tmp_path, text)
    with pytest.raises(WorkloadError) as err:
        load_workload(str(p))
    msg = str(err.value)
    assert str(p) in msg and f"key '{key}'" in msg and expected in msg, msg


def test_toml_syntax_error_and_unknown_name(tmp_path):
    p = write(tmp_path, "[[classes]\nname = 1\n")
    with pytest.raises(WorkloadError, match=f"{p}: not valid TOML"):
        load_workload(str(p))
    with pytest.raises(WorkloadError, match="no such workload.*chat-short"):
        load_workload("chat-shrot")


def test_cli_list_show_validate(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0 and "short-long-50-50" in res.output
    res = runner.invoke(app, ["show", "short-long-50-50", "--sample", "2"])
    assert res.exit_code == 0 and '"weight": 1.0' in res.output and "r1" in res.output
    bad = write(tmp_path, '[[classes]]\nname = "x"\noutput = { dist = "uniform", low = 5 }\n')
    res = runner.invoke(app, ["validate", "chat-short", str(bad)])
    assert res.exit_code == 1
    assert (
        "✓ chat-short" in res.output
        and "classes[0].output.high" in res.output
        and "is required" in res.output
    )


def test_trace_table_in_a_workload_file(tmp_path):
    from workloads.text import DATA

    p = write(tmp_path, f'name = "replay"\n[trace]\npath = "{DATA / "sample_mooncake.jsonl"}"\nlimit = 5\n')
    wl = load_workload(str(p))
    assert wl.name == "replay" and wl.arrival.process == "trace" and len(wl.rows) == 5
    rel = write(tmp_path, '[trace]\npath = "t.csv"\n')
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,12,3\n0.5,20,4\n")
    sessions = list(load_workload(str(rel)).sessions(0))
    assert [s.at for s in sessions] == [0.0, 0.5] and [s.first().prompt_tokens for s in sessions] == [12, 20]
    bad = write(tmp_path, '[trace]\npath = "t.csv"\n[[classes]]\nname = "x"\n', "bad.toml")
    with pytest.raises(WorkloadError, match="key 'classes': not allowed together with"):
        load_workload(str(bad))


def test_bench_run_rejects_a_malformed_workload_file(tmp_path):
    from loadgen.cli.app import app as bench

    p = write(
        tmp_path, '[[classes]]\nname = "x"\nprompt = { dist = "lognormal", median = 100, sigma = "wide" }\n'
    )
    res = CliRunner().invoke(bench, ["run", "--url", "http://127.0.0.1:9", "--workload", str(p)])
    assert res.exit_code != 0
    assert (
        str(p) in res.output and "classes[0].prompt.sigma" in res.output and "expected a number" in res.output
    )


def test_describe_is_checkout_independent_and_changes_with_the_traffic():
    a = load_workload("rag").describe()
    assert a["source"] == "builtin:rag" and "/" not in json.dumps(a["spec"])
    assert load_workload("rag", rate=3.0).describe() != a
    json.dumps(a)  # plain data


def test_length_distributions_follow_their_parameters():
    from statistics import mean, median

    from workloads.dist import parse_dist

    rng = random.Random(0)

    def draw(table, n=4000, integer=True):
        d = parse_dist(table, "t.toml", "k", integer=integer)
        return [d.sample_int(rng) if integer else d.sample(rng) for _ in range(n)]

    assert set(draw(7, 50)) == {7}
    u = draw({"dist": "uniform", "low": 10, "high": 20})
    assert min(u) == 10 and max(u) == 20 and 14.5 < mean(u) < 15.5
    nrm = draw({"dist": "normal", "mean": 300, "std": 50})
    assert 295 < mean(nrm) < 305
    ln = draw({"dist": "lognormal", "median": 1000, "sigma": 0.5})
    assert 950 < median(ln) < 1050 and mean(ln) > median(ln)
    emp = draw({"dist": "empirical", "values": [5, 50], "weights": [3, 1]})
    assert set(emp) == {5, 50} and 0.7 < emp.count(5) / len(emp) < 0.8
    clipped = draw({"dist": "normal", "mean": 100, "std": 80, "min": 60, "max": 120})
    assert min(clipped) == 60 and max(clipped) == 120
    think = draw({"dist": "normal", "mean": 0.5, "std": 1.0, "min": 0}, integer=False)
    assert min(think) == 0.0 and isinstance(think[0], float)


def test_an_embeddings_class_sends_its_inputs_of_the_lengths_meant():
    """The built-in embeddings workload: 8 texts of 32-256 tokens per request, the request's intended prompt
    tokens their sum (what the server counts), each text exactly its drawn length."""
    from workloads.text import builder_for

    wl = load_workload("embeddings")
    tok = builder_for("bundled").tokenizer
    reqs = [s.first() for s in islice(wl.sessions(0), 5)]
    for req in reqs:
        lengths = [len(tok.encode(t).ids) for t in req.inputs]
        assert req.api == "embeddings" and len(lengths) == 8 and all(32 <= n <= 256 for n in lengths), lengths
        assert req.prompt_tokens == sum(lengths)
    assert len({r.inputs for r in reqs}) == 5


def test_a_class_names_the_served_model_or_adapter_its_requests_ask_for(tmp_path):
    """A mix of classes splits traffic over served names (LoRA adapters): each request carries its class's
    `model`, the backend sends it (else --model's)."""
    from backends.openai import OpenAIBackend

    p = write(tmp_path, '[[classes]]\nname = "a"\nmodel = "lora-a"\n[[classes]]\nname = "base"\n')
    reqs = [s.first() for s in islice(load_workload(str(p)).sessions(0), 40)]
    be = OpenAIBackend("http://x", model="served")
    sent = {(r.workload_class, be.build(r).body["model"]) for r in reqs}
    assert sent == {("a", "lora-a"), ("base", "served")}
    assert load_workload(str(p)).describe()["spec"]["classes"][0]["model"] == "lora-a"
