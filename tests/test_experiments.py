"""Experiment definitions: traffic from workload files, seeded; verdicts computed from the table."""

from loadgen.dispatch.loadspec import LoadSpec
from loadgen.experiments.catalog import EXPERIMENTS, _plans, _workload, batching, chunked_prefill
from loadgen.experiments.experiment import (
    SPEC,
    Column,
    Config,
    Experiment,
    _comparison,
    _markdown,
    metric,
    run_experiment,
)
from workloads.spec import EXPERIMENTS_DIR


def test_every_experiment_workload_file_is_used_and_valid():
    """The files in workloads/experiments/ are the experiments' traffic: each one loads and is used."""
    used = {plan.workload.name for make in EXPERIMENTS.values() for q in (True, False) for plan in make().traffic(q)}
    assert {p.stem for p in EXPERIMENTS_DIR.glob("*.toml")} <= used


def test_chunked_prefill_traffic_is_the_schedule_in_its_file():
    """Four decoding streams at t = 0, then 2,000-token prompts 1 s apart; --quick sends the first six."""
    [full], [quick] = chunked_prefill().traffic(False), chunked_prefill().traffic(True)
    assert (full.load.process, full.load.num_requests, quick.load.num_requests) == ("trace", 8, 6)
    sent = [(s.at, s.first().workload_class, s.first().prompt_tokens, s.first().max_tokens)
            for s in full.workload.sessions(full.load.seed)]  # fmt: skip
    assert sent == [(0.0, "decode", 27, 160)] * 4 + [(0.5 + j, "long-prompt", 2000, 1) for j in range(4)]


def test_traffic_is_seeded_and_the_same_for_every_configuration():
    for make in EXPERIMENTS.values():
        exp = make()
        plans = exp.traffic(True)
        for plan in plans:
            first = [s.first() for s, _ in zip(plan.workload.sessions(plan.load.seed), range(5), strict=False)]
            again = [s.first() for s, _ in zip(plan.workload.sessions(plan.load.seed), range(5), strict=False)]
            assert [(r.prompt, r.max_tokens, r.workload_class) for r in first] == [
                (r.prompt, r.max_tokens, r.workload_class) for r in again]


def _summary(tps: float, p99: float) -> dict:
    return {"point_id": "c016", "throughput": {"whole": {"output_tok_per_s": tps, "req_per_s": 1.0}},
            "latency": {"e2e": {"p50": 1.0, "p99": p99}, "ttft": {"p99": 0.5}},
            "per_class": {"short": {"latency": {"e2e": {"p99": 1.0}}}}}


def test_batching_verdict_follows_the_numbers():
    exp = batching()
    extras = {k: {"seconds": 1.0, "metrics": {}} for k in ("static", "dynamic", "continuous")}
    good = {"static": [_summary(10, 9)], "dynamic": [_summary(15, 8)], "continuous": [_summary(30, 5)]}
    c = _comparison(exp, good, extras, True)
    assert "3.00x" in c["verdict"] and "PASS" in c["verdict"]
    assert "| static | c016 | 10.0 |" in _markdown(c)
    bad = dict(good, continuous=[_summary(20, 5)])
    assert "FAIL" in _comparison(exp, bad, extras, True)["verdict"]


def test_quantization_verdict_and_accuracy_columns():
    from loadgen.experiments.catalog import quantization

    exp = quantization()
    assert [p.point_id for p in exp.traffic(True)] == ["c001", "c016"]

    def pts(c1: float, c16: float) -> list[dict]:
        return [dict(_summary(c1, 1.0), point_id="c001"), dict(_summary(c16, 1.0), point_id="c016")]

    per = {"none": pts(30, 240), "int8": pts(36, 230), "int4": pts(45, 220), "kv-int8": pts(29, 250)}
    extras = {k: {"seconds": 1.0, "metrics": {}, "top1_agreement": a, "mean_logit_error": 0.1,
                  "greedy_identical": 0.5, "kv_tokens": kv}
              for k, a, kv in (("none", 0.98, 32768), ("int8", 0.96, 32768), ("int4", 0.975, 32768),
                               ("kv-int8", 0.975, 65280))}  # fmt: skip
    c = _comparison(exp, per, extras, True)
    assert "int4: c=1 1.50x, c=16 0.92x bf16, KV tokens 1.00x, top-1 agreement -0.5 points" in c["verdict"]
    assert "int8: c=1 1.20x" in c["verdict"] and "-2.0 points" in c["verdict"]
    assert "kv-int8: c=1 0.97x, c=16 1.04x bf16, KV tokens 1.99x, top-1 agreement -0.5 points" in c["verdict"]
    assert "| int4 | c001 | 45.0 |" in _markdown(c) and "97.5%" in _markdown(c) and "65,280" in _markdown(c)


def test_spec_counts_come_from_the_server_poller(tmp_path):
    """A live experiment (reference server with n-gram speculation, two code-edit requests): the drafted and
    accepted counts in its table are the server-state poller's, as in any `bench run`."""
    wl = _workload("code-edit", output=24)
    exp = Experiment(
        "spec-counts", "the poller counts speculative tokens", [Config("ngram", ["--spec", "ngram", "--spec-k", "8"])],
        lambda _quick: _plans(wl, LoadSpec(process="closed", concurrency=1, num_requests=2, seed=5)),
        [Column("errors", metric("counts.errors"), "{}"), Column("drafted", metric(f"{SPEC}.drafted"), "{}"),
         Column("accepted", metric(f"{SPEC}.accepted"), "{}")],
        lambda _pc, _e: "-", common_args=["--dtype", "fp32", "--max-model-len", "512"],
    )  # fmt: skip
    c = run_experiment(exp, tmp_path, True, None, lambda _line: None)
    [row] = c["rows"]
    assert row["errors"] == 0
    assert row["drafted"] > 0 and 0 < row["accepted"] <= row["drafted"], row
    assert (tmp_path / "ngram" / "points" / row["point"] / "server_state.jsonl").is_file()
