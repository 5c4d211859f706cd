"""The gate against synthetic result sets of known distributions, fingerprints and outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.gate.compare import compare
from loadgen.gate.resultset import load, save_baseline
from loadgen.gate.rules import GateError, MetricRule, metric_path
from loadgen.gate.verdict import to_markdown
from loadgen.metrics.quantiles import t_quantile

FP = {"workload": {"name": "chat-short", "seed": 0}, "load": {"process": "closed", "concurrency": 4}}
ENV = {"cpu_model": "AMD EPYC", "gpus": [], "server_version": "0.1.0"}
RULES = [MetricRule.parse("output_tok_s:-5%"), MetricRule.parse("ttft_p99:+10%")]


def write_result(
    path: Path,
    tok_s: np.ndarray,
    ttft: np.ndarray | None = None,
    fp: dict = FP,
    env: dict = ENV,
    paired: bool = False,
) -> Path:
    ttft = ttft if ttft is not None else np.full(len(tok_s), 0.2)
    points = [
        {
            "point_id": f"c004/t{i}",
            "throughput": {"steady": {"output_tok_per_s": float(v)}},
            "latency": {"ttft": {"p99": float(t)}},
        }
        for i, (v, t) in enumerate(zip(tok_s, ttft, strict=True))
    ]
    path.mkdir(parents=True, exist_ok=True)
    doc = {"run_id": path.name, "fingerprint": fp, "environment": env, "points": points, "ab_paired": paired}
    (path / "summary.json").write_text(json.dumps(doc))
    return path


def trials(rng: np.random.Generator, mean: float, noise: float, n: int) -> np.ndarray:
    return mean * (1 + noise * rng.standard_normal(n))


def verdicts(tmp_path: Path, ratio: float, noise: float, n: int, datasets: int = 40) -> list[str]:
    rng = np.random.default_rng(1234)
    out = []
    for k in range(datasets):
        b = write_result(tmp_path / f"b{k}", trials(rng, 100.0, noise, n))
        c = write_result(tmp_path / f"c{k}", trials(rng, 100.0 * ratio, noise, n))
        out.append(compare(load(b), load(c), RULES[:1]).verdict)
    return out


def test_ten_percent_regression_under_three_percent_noise_is_caught(tmp_path):
    v = verdicts(tmp_path, ratio=0.90, noise=0.03, n=10)
    assert v.count("regression") >= 36, v  # >= 90 % power (simulated: ~93 %)
    assert "pass" not in v


def test_no_regression_under_three_percent_noise_passes(tmp_path):
    v = verdicts(tmp_path, ratio=1.0, noise=0.03, n=10)
    assert "regression" not in v
    assert v.count("pass") >= 36, v


def test_thirty_percent_noise_with_three_trials_is_inconclusive_not_a_false_alarm(tmp_path):
    v_same = verdicts(tmp_path / "same", ratio=1.0, noise=0.30, n=3)
    v_slow = verdicts(tmp_path / "slow", ratio=0.90, noise=0.30, n=3)
    assert set(v_same) == set(v_slow) == {"inconclusive"}


def test_thirty_percent_noise_with_five_trials_still_no_false_alarm(tmp_path):
    v = verdicts(tmp_path, ratio=1.0, noise=0.30, n=5)
    assert "regression" not in v
    assert v.count("inconclusive") >= 36, v


def test_latency_rule_is_lower_is_better(tmp_path):
    rng = np.random.default_rng(7)
    tok = trials(rng, 100, 0.01, 8)
    b = write_result(tmp_path / "b", tok, ttft=trials(rng, 0.2, 0.02, 8))
    c = write_result(tmp_path / "c", tok, ttft=trials(rng, 0.3, 0.02, 8))  # 50 % slower TTFT
    rep = compare(load(b), load(c), RULES)
    by_metric = {ch.metric: ch for ch in rep.checks}
    assert by_metric["output_tok_s"].verdict == "pass"
    assert by_metric["ttft_p99"].verdict == "regression" and by_metric["ttft_p99"].ci[0] > 1.1
    assert rep.verdict == "regression" and rep.exit_code == 1


def test_paired_ab_cancels_machine_drift(tmp_path):
    """Machine speed drifts 40 % over the trials; A and B alternate, B is 10 % slower. Unpaired the drift
    swamps the effect; paired by trial it is a clear regression."""
    drift = np.linspace(1.0, 1.4, 8)
    rng = np.random.default_rng(3)
    a = 100 * drift * (1 + 0.01 * rng.standard_normal(8))
    b = 90 * drift * (1 + 0.01 * rng.standard_normal(8))
    unpaired = compare(
        load(write_result(tmp_path / "a", a)), load(write_result(tmp_path / "b", b)), RULES[:1]
    )
    paired = compare(
        load(write_result(tmp_path / "pa", a, paired=True)),
        load(write_result(tmp_path / "pb", b, paired=True)),
        RULES[:1],
    )
    assert unpaired.verdict == "inconclusive"
    assert paired.verdict == "regression"


def test_too_few_trials_is_inconclusive_with_a_reason(tmp_path):
    b = write_result(tmp_path / "b", np.array([100.0, 101.0, 99.0]))
    c = write_result(tmp_path / "c", np.array([50.0, 51.0, 49.0]))
    rep = compare(load(b), load(c), RULES[:1])
    assert rep.verdict == "inconclusive" and rep.exit_code == 2
    assert "needs >= 5 trials" in rep.checks[0].reason
    assert compare(load(b), load(c), RULES[:1], min_trials=3).verdict == "regression"


def test_differing_workload_fingerprint_is_refused_and_names_the_field(tmp_path):
    other = {**FP, "load": {"process": "closed", "concurrency": 8}}
    b = write_result(tmp_path / "b", np.full(5, 100.0))
    c = write_result(tmp_path / "c", np.full(5, 100.0), fp=other)
    rep = compare(load(b), load(c), RULES)
    assert rep.verdict == "invalid" and rep.exit_code == 2 and not rep.checks
    assert "load.concurrency: 4 != 8" in rep.errors[0]


def test_differing_environment_warns_but_compares(tmp_path):
    b = write_result(tmp_path / "b", np.array([100.0, 101, 99, 100, 100]))
    c = write_result(
        tmp_path / "c", np.array([100.0, 101, 99, 100, 100]), env={**ENV, "cpu_model": "Intel Xeon"}
    )
    rep = compare(load(b), load(c), RULES[:1])
    assert rep.verdict == "pass"
    assert len(rep.warnings) == 1 and "cpu_model: 'AMD EPYC' != 'Intel Xeon'" in rep.warnings[0]


def test_missing_metric_and_points_are_invalid(tmp_path):
    b = write_result(tmp_path / "b", np.full(4, 100.0))
    rep = compare(load(b), load(b), [MetricRule.parse("tpot_p50:+5%")])
    assert rep.verdict == "invalid" and "tpot_p50" in rep.errors[0]
    rep = compare(load(b), load(b), RULES[:1], points=["c999"])
    assert rep.verdict == "invalid" and "c999" in rep.errors[0]


def test_metric_specs():
    assert metric_path("output_tok_s") == ("throughput", "steady", "output_tok_per_s")
    assert metric_path("ttft_p99") == ("latency", "ttft", "p99")
    assert metric_path("telemetry.cpu_pct.mean") == ("telemetry", "cpu_pct", "mean")
    r = MetricRule.parse("ttft_p99:+10%")
    assert not r.higher_is_better and r.limit == pytest.approx(1.1) and str(r) == "ttft_p99:+10%"
    r = MetricRule.parse("output_tok_s:-0%")
    assert r.higher_is_better and r.limit == 1.0
    for bad in ("output_tok_s", "output_tok_s:5%", "output_tok_s:-5", "nosuch:-5%"):
        with pytest.raises(GateError):
            MetricRule.parse(bad)


def test_t_quantile_matches_tables():
    for df, expected in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_baseline_save_round_trip_and_markdown(tmp_path):
    rng = np.random.default_rng(5)
    res = write_result(tmp_path / "run1", trials(rng, 100, 0.02, 5))
    out = tmp_path / "baselines" / "ci.json"
    save_baseline(res, out)
    base = load(out)
    assert base.fingerprint == FP and list(base.points) == ["c004"] and len(base.points["c004"]) == 5
    rep = compare(base, load(res), RULES)
    assert rep.verdict == "pass"
    md = to_markdown(rep)
    assert md.startswith("### servelab gate: ✅ pass")
    assert "| c004 | output_tok_s | `output_tok_s:-5%` |" in md and "| 5/5 |" in md
    json.dumps(rep.to_dict())  # the JSON output is serialisable


def test_unreadable_inputs_are_gate_errors(tmp_path):
    with pytest.raises(GateError, match="no such result"):
        load(tmp_path / "nope")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(GateError, match="no 'points'"):
        load(tmp_path / "x.json")


def write_run_result(path: Path, tok_s: np.ndarray, config: dict, env: dict) -> Path:
    """A result as bench run writes it: config + hashed fingerprint, trials as labels/trial."""
    path.mkdir(parents=True)
    points = [
        {"point_id": f"c004/t{i}", "trial": i, "throughput": {"steady": {"output_tok_per_s": float(v)}}}
        for i, v in enumerate(tok_s)
    ]
    doc = {
        "run_id": path.name,
        "config": config,
        "environment": env,
        "fingerprint": str(hash(str(config))),
        "points": points,
    }
    (path / "summary.json").write_text(json.dumps(doc))
    return path


CONFIG = {
    "command": "run",
    "url": "http://127.0.0.1:8001",
    "workloads": ["chat-short"],
    "concurrency": [4],
    "seed": 0,
    "repeat": 5,
}


def test_config_fingerprint_ignores_url_and_repeat_but_not_traffic(tmp_path):
    tok = np.array([100.0, 101, 99, 100, 100, 101])
    b = write_run_result(tmp_path / "b", tok[:5], CONFIG, {**ENV, "load_average": [0.1]})
    c = write_run_result(
        tmp_path / "c",
        tok,
        {**CONFIG, "url": "http://127.0.0.1:9999", "repeat": 6},
        {**ENV, "load_average": [3.0]},
    )
    rep = compare(load(b), load(c), RULES[:1])
    assert rep.verdict == "pass" and rep.warnings == []
    d = write_run_result(tmp_path / "d", tok, {**CONFIG, "concurrency": [8]}, ENV)
    rep = compare(load(b), load(d), RULES[:1])
    assert rep.verdict == "invalid" and "concurrency: [4] != [8]" in rep.errors[0]
    # an option newer than the baseline: the baseline ran with its default, so only another value differs
    e = write_run_result(tmp_path / "e", tok, {**CONFIG, "dataset_field": None, "reset_cache": False}, ENV)
    assert compare(load(b), load(e), RULES[:1]).verdict == "pass"
    f = write_run_result(tmp_path / "f", tok, {**CONFIG, "reset_cache": True}, ENV)
    assert "reset_cache: False != True" in compare(load(b), load(f), RULES[:1]).errors[0]


def _bench(*args: str):
    from typer.testing import CliRunner

    from loadgen.cli.app import app

    result = CliRunner().invoke(app, list(args))
    result.text = " ".join(result.output.split())  # rich wraps long lines
    return result


def test_bench_gate_exit_codes_and_outputs(tmp_path):
    rng = np.random.default_rng(11)
    b = write_result(tmp_path / "b", trials(rng, 100, 0.02, 8))
    same = write_result(tmp_path / "same", trials(rng, 100, 0.02, 8))
    slow = write_result(tmp_path / "slow", trials(rng, 80, 0.02, 8))
    few = write_result(tmp_path / "few", trials(rng, 100, 0.02, 3))
    md, js = tmp_path / "gate.md", tmp_path / "gate.json"
    r = _bench("gate", "--baseline", str(b), "--candidate", str(same), "--metric", "output_tok_s:-5%",
               "--markdown", str(md), "--json", str(js))  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "pass" in md.read_text() and json.loads(js.read_text())["verdict"] == "pass"
    r = _bench(
        "gate",
        "--baseline",
        str(b),
        "--candidate",
        str(slow),
        "--metric",
        "output_tok_s:-5%",
        "--json",
        str(js),
    )
    assert r.exit_code == 1 and json.loads(js.read_text())["checks"][0]["verdict"] == "regression"
    r = _bench("gate", "--baseline", str(b), "--candidate", str(few), "--metric", "output_tok_s:-5%")
    assert r.exit_code == 2 and "inconclusive" in r.text
    r = _bench(
        "gate", "--baseline", str(b), "--candidate", str(tmp_path / "missing"), "--metric", "output_tok_s:-5%"
    )
    assert r.exit_code == 2 and "no such result" in r.text
    r = _bench("gate", "--baseline", str(b), "--candidate", str(same), "--metric", "output_tok_s")
    assert r.exit_code == 2 and "bad --metric" in r.text


def test_bench_baseline_save_then_gate(tmp_path):
    rng = np.random.default_rng(12)
    res = write_result(tmp_path / "run", trials(rng, 100, 0.02, 6))
    out = tmp_path / "baselines" / "main.json"
    r = _bench("baseline", "save", str(res), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["format"] == "servelab-baseline/1"
    r = _bench("gate", "--baseline", str(out), "--candidate", str(res), "--metric", "output_tok_s:-5%")
    assert r.exit_code == 0, r.output
    r = _bench("baseline", "save", str(tmp_path / "nope"), "-o", str(out))
    assert r.exit_code == 2


def test_paired_trials_pair_by_index_and_drop_incomplete_pairs(tmp_path):
    a = write_result(tmp_path / "a", np.array([100.0, 200, 100, 200, 100, 200]), paired=True)
    b = write_result(tmp_path / "b", np.array([80.0, 160, 80, 160, 80, 160]), paired=True)
    doc = json.loads((b / "summary.json").read_text())
    doc["points"][2]["throughput"]["steady"]["output_tok_per_s"] = None  # trial 2 failed on one side
    (b / "summary.json").write_text(json.dumps(doc))
    check = compare(load(a), load(b), RULES[:1]).checks[0]
    assert check.n_baseline == check.n_candidate == 5
    assert check.ratio == pytest.approx(0.8) and check.ci == pytest.approx((0.8, 0.8))
    assert check.verdict == "regression"


def _summarized(path: Path, delay: float) -> Path:
    """A result of three trials, each a PointSummary made from records (a prefix cache hit and an SLO, so every
    optional figure is there), the server ``delay`` s slower on every event."""
    from loadgen.metrics import pointsummary

    def rec(i: int, trial: int) -> dict:
        t0 = 0.1 * i
        events = [[t0 + 0.2 + delay, 1], [t0 + 0.3 + delay, 2], [t0 + 0.5 + delay + 0.01 * trial, 1]]
        return {"id": str(i), "cls": "a", "warmup": False, "intended": t0, "sent": t0 + 0.001, "headers": {},
                "end": events[-1][0] + 0.01, "status": 200, "error": None, "events": events, "prompt_tokens": 10,
                "prompt_tokens_source": "usage", "output_tokens": 4, "output_tokens_source": "usage",
                "cached_tokens": 4 + trial}  # fmt: skip

    points = [{"point_id": f"c004/t{k}", **pointsummary.summarize([rec(i, k) for i in range(20)], load=FP["load"],
                                                                  slo={"ttft": 0.5})} for k in range(3)]  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    doc = {"run_id": path.name, "fingerprint": FP, "environment": ENV, "points": points}
    (path / "summary.json").write_text(json.dumps(doc))
    return path


def test_every_registry_tag_is_a_gate_metric_found_in_real_summaries(tmp_path):
    """Each tag of the metric registry (a distribution's with every stat) is a gate name, and the gate finds
    its values at the registry's path in PointSummaries made from records; the names an unknown one is told
    to use are names the gate takes."""
    from loadgen.metrics import definitions as metrics
    from loadgen.metrics.percentiles import STAT_KEYS

    names = [(f"{t}_{st}" if m.distribution else t, m) for t, m in metrics.REGISTRY.items()
             for st in (STAT_KEYS if m.distribution else ("",))
             # bench verify's (gated in test_verify.py) and a pooling run's (gated live in test_llamaserver.py)
             if m.path[0] != "quality" and m is not metrics.INPUTS_S]  # fmt: skip
    rules = [MetricRule.parse(f"{n}:{'-' if m.higher_is_better else '+'}50%") for n, m in names]
    rep = compare(load(_summarized(tmp_path / "b", 0.0)), load(_summarized(tmp_path / "c", 0.001)), rules)
    assert rep.errors == [] and [c.metric for c in rep.checks] == [n for n, _ in names]
    with pytest.raises(GateError, match="unknown metric 'ttft'") as err:  # a distribution needs its stat
        metric_path("ttft")
    suggested = str(err.value).split("use e.g. ")[1].split(", or a dotted")[0].split(", ")
    assert "output_tok_s" in suggested and "ttft_p99" in suggested
    assert all(metric_path(n) for n in suggested)
