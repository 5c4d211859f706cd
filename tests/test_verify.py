"""``bench verify``: the comparison's parts, and the command against the null server made wrong on purpose
(``diverge_above``: past N requests in flight it changes one token), where it must fail at every load that
misbehaves and pass at every other, and ``bench gate --metric identical`` on its results."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen.cli.app import app
from loadgen.experiments.margin import token_tops
from loadgen.experiments.verify import RecordingWorkload, Tolerance, divergence, judge
from loadgen.testservers.null import NullServerProcess
from workloads.loader import load_workload

# llama-server's answer to POST /v1/completions {"logprobs": 2, "max_tokens": 1} (build 11434, as measured)
LLAMA_ANSWER = {"choices": [{"text": " Paris", "index": 0, "logprobs": {"content": [{
    "id": 7042, "token": " Paris", "logprob": -0.24842411279678345, "top_logprobs": [
        {"id": 7042, "token": " Paris", "logprob": -0.24842411279678345},
        {"id": 260, "token": " the", "logprob": -2.7847447395324707}]}]}, "finish_reason": "length"}]}  # fmt: skip
# vLLM's (the legacy OpenAI completions format)
VLLM_ANSWER = {"choices": [{"text": " Paris", "logprobs": {"tokens": [" Paris"], "token_logprobs": [-0.25],
                                                           "top_logprobs": [{" the": -2.75, " Paris": -0.25}]}}]}  # fmt: skip


def test_divergence_is_the_first_differing_character():
    assert divergence(" tok tok", " tok tok") is None
    assert divergence(" tok tok", " tok tak") == 6
    assert divergence(" tok", " tok tok") == 4  # one answer stops early
    assert divergence("a", "b") == 0


def test_sampled_passes_ask_for_the_same_draws():
    """--temperature: every request of every pass sampled with one seed per prompt (made from the request id
    where the workload gives none), so two passes ask for the same draws; greedy passes send no seed."""
    wl = load_workload("chat-short")

    def firsts(rec: RecordingWorkload) -> list:
        return [s.first() for s in islice(rec.sessions(7), 4)]

    a, b = firsts(RecordingWorkload(wl, 8, 0.8)), firsts(RecordingWorkload(wl, 8, 0.8))
    assert [(r.request_id, r.temperature, r.seed, r.max_tokens <= 8) for r in a] == \
        [(r.request_id, 0.8, r.seed, True) for r in b]  # fmt: skip
    assert all(isinstance(r.seed, int) for r in a) and len({r.seed for r in a}) == 4
    assert {(r.temperature, r.seed) for r in firsts(RecordingWorkload(wl))} == {(0.0, None)}


def test_draws_send_every_session_k_times_with_a_seed_per_draw_and_pass():
    """--draws 3: each session three times in a row, each draw its own copy (a multi-turn session's next turn
    follows its own answer), ids ``~k``, one seed per draw, another in another pass (salt); the prompt of each id
    kept."""
    wl = load_workload("multiturn-chat")

    def firsts(rec: RecordingWorkload) -> list:
        return [(s, s.first()) for s in islice(rec.sessions(7), 6)]

    rec = RecordingWorkload(wl, 8, 0.8, draws=3)
    a, b = firsts(rec), firsts(RecordingWorkload(wl, 8, 0.8, draws=3))
    ids = [r.request_id for _, r in a]
    base = ids[0].rsplit("~", 1)[0]
    assert ids[:3] == [f"{base}~0", f"{base}~1", f"{base}~2"] and ids == [r.request_id for _, r in b]
    assert [r.seed for _, r in a] == [r.seed for _, r in b] and len({r.seed for _, r in a}) == 6
    assert len({str(r.prompt) for _, r in a[:3]}) == 1 and a[0][1].prompt != a[3][1].prompt  # draws of one prompt
    assert {rec.prompt_of[i] for i in ids[:3]} == {base}
    assert len({id(s.inner) for s, _ in a}) == 6  # every draw its own session
    nxt = [s.next(answer) for (s, _), answer in zip(a[:2], (" yes", " no"), strict=True)]
    if all(nxt):  # a second turn: each draw's prompt carries its own answer
        (_, r0), (_, r1) = nxt
        assert r0.request_id.endswith("~0") and r1.request_id.endswith("~1") and " yes" in str(r0.prompt) \
            and " no" in str(r1.prompt) and rec.answers[ids[0]] == " yes"  # fmt: skip
    other = RecordingWorkload(wl, 8, 0.8, draws=3)
    other.salt = "c004"  # another pass (run_verify salts each with its point id): other seeds, the same prompts
    c = firsts(other)
    assert [r.request_id for _, r in c] == ids and [str(r.prompt) for _, r in c] == [str(r.prompt) for _, r in a]
    assert not {r.seed for _, r in c} & {r.seed for _, r in a}
    assert RecordingWorkload(wl).describe().get("draws") is None and rec.describe()["draws"] == 3
    with pytest.raises(ValueError):
        RecordingWorkload(wl, draws=2)  # greedy: one outcome


def test_token_tops_reads_llama_server_and_vllm_logprobs():
    assert token_tops(LLAMA_ANSWER) == [(" Paris", [(" Paris", pytest.approx(-0.2484241)), (" the", pytest.approx(-2.7847447))])]
    assert token_tops(VLLM_ANSWER) == [(" Paris", [(" Paris", -0.25), (" the", -2.75)])]
    assert token_tops({"choices": [{"text": " Paris", "logprobs": None}]}) is None
    assert token_tops({"error": {"message": "no"}}) is None


def test_judge_tells_a_near_tie_from_a_wrong_token():
    tol = Tolerance(min_identical=0.9, near_tie=0.1)
    assert judge(10, 1.0, [], tol)[0] == "pass"
    assert judge(10, 0.9, [0.5], tol)[0] == "pass"  # within the identical share
    assert judge(10, 0.5, [0.01, 0.05], tol) == ("pass", "every divergence is a near-tie (margin < 0.1)")
    verdict, reason = judge(10, 0.5, [0.01, 2.0, None], tol)
    assert verdict == "fail" and "1 at a margin >= 0.1" in reason and "1 of unknown margin" in reason
    assert judge(10, 0.8, [None, None], tol)[0] == "fail"  # unknown margins: the identical share alone
    assert judge(0, None, [], tol)[0] == "fail"  # nothing compared is no pass
    with pytest.raises(ValueError):
        Tolerance(min_identical=1.5)


def _verify(url: str, out: Path, run_id: str, *extra: str) -> tuple[int, str, dict[str, dict]]:
    res = CliRunner().invoke(app, [
        "verify", *(["--url", url] if url else []), "--workload", "chat-short", "--num-requests", "16", "--max-tokens", "8", "--seed", "1",
        "--output-dir", str(out), "--run-id", run_id, *extra,
    ])  # fmt: skip
    points = json.loads((out / run_id / "summary.json").read_text())["points"] if res.exit_code in (0, 1) else []
    return res.exit_code, " ".join(res.output.split()), {p["point_id"]: p for p in points}


def test_verify_fails_exactly_where_the_server_goes_wrong(tmp_path):
    """Past 4 requests in flight the server changes the middle token (event 4 of 8: character 18): the
    points at concurrency 1 and 4 never exceed it and pass; at 8 the answers of requests that arrived with
    more than 4 in flight differ there, and the point fails (exit 1)."""
    with NullServerProcess(itl=0.002, diverge_above=4) as url:
        code, out, points = _verify(url, tmp_path, "wrong", "--concurrency", "1,4,8")
    assert code == 1, out
    assert list(points) == ["reference", "c001", "c004", "c008"]
    assert all(p["counts"]["errors"] == 0 and p["counts"]["ok"] == 16 for p in points.values())
    assert "quality" not in points["reference"]
    for pid in ("c001", "c004"):
        q = points[pid]["quality"]
        assert (q["verdict"], q["identical"], q["compared"], q["diverged"]) == ("pass", 1.0, 16, []), pid
    q = points["c008"]["quality"]
    assert q["verdict"] == "fail" and q["compared"] == 16 and 0 < q["identical"] < 1
    assert len(q["diverged"]) == round(16 * (1 - q["identical"]))
    assert {(d["at"], d["reference"][:4], d["answer"][:4], d["margin"]) for d in q["diverged"]} == {(18, "ok t", "ak t", None)}
    assert q["first_divergence"]["p50"] == 18 and q["margins_unknown"] == len(q["diverged"])
    assert "fail c008" in out and "fail c004" not in out and "verdict rests on the identical share alone" in out
    res = CliRunner().invoke(app, ["report", str(tmp_path / "wrong"), "-o", str(tmp_path / "r.html"), "--plotly", "cdn"])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "r.html").read_text()
    table = html[html.index("<h2>Answers against the reference</h2>"):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") == 4 and '<span class="up">fail</span>' in table  # header, c001, c004, c008
    assert "<td>c008</td><td>reference</td>" in table and "<td>c004</td><td>reference</td><td>100.0%</td>" in table


def test_gate_on_identical_fails_a_change_that_made_the_server_wrong(tmp_path):
    """bench gate --metric identical:-1% on two verify runs (2 trials each): the candidate server goes wrong
    past 4 in flight, so c008 regresses and c004 passes; the reference (no quality) is left out."""
    args = ("--concurrency", "4,8", "--repeat", "2")
    with NullServerProcess(itl=0.002) as url:
        code, out, base = _verify(url, tmp_path, "base", *args)
    assert code == 0, out
    assert all(p["quality"]["identical"] == 1.0 for pid, p in base.items() if pid != "reference")
    with NullServerProcess(itl=0.002, diverge_above=4) as url:
        code, out, _ = _verify(url, tmp_path, "cand", *args)
    assert code == 1, out
    res = CliRunner().invoke(app, ["gate", "--baseline", str(tmp_path / "base"), "--candidate", str(tmp_path / "cand"), "--metric", "identical:-1%",
                                   "--min-trials", "2", "--json", str(tmp_path / "gate.json")])  # fmt: skip
    assert res.exit_code == 1, res.output
    rep = json.loads((tmp_path / "gate.json").read_text())
    assert {c["point"]: c["verdict"] for c in rep["checks"]} == {"c004": "pass", "c008": "regression"}
    assert any(w.startswith("reference: metric identical") for w in rep["warnings"])


# the null server with its behaviour a grid parameter: d=null never diverges, d=N past N requests in flight
NULL_GRID = "python -m loadgen.testservers.null --port {port} --behaviour '{{\"itl\": 0.002, \"diverge_above\": {d}}}'"


def test_verify_grid_compares_every_configuration_with_the_first(tmp_path):
    """--server/--grid d=null,0,4: the first configuration (never wrong) gives the reference; d0 is wrong at
    every load, so its own reference pass, which agrees with its own load points, fails against the first's;
    d4 is right alone and wrong at concurrency 8. One results dir, points labelled by configuration."""
    code, out, points = _verify("", tmp_path, "grid", "--server", NULL_GRID, "--grid", "d=null,0,4",
                                "--concurrency", "8")  # fmt: skip
    assert code == 1, out
    assert list(points) == [f"{d}/{p}" for d in ("dnull", "d0", "d4") for p in ("reference", "c008")]
    assert all(p["counts"]["errors"] == 0 and p["counts"]["ok"] == 16 for p in points.values()), out
    assert points["d4/c008"]["labels"]["d"] == "4" and "server_launch" in points["d4/c008"]
    assert "quality" not in points["dnull/reference"]
    verdicts = {pid: (p["quality"]["against"], p["quality"]["verdict"]) for pid, p in points.items() if "quality" in p}
    assert verdicts == {"dnull/c008": ("dnull/reference", "pass"), "d0/reference": ("dnull/reference", "fail"),
                        "d0/c008": ("dnull/reference", "fail"), "d4/reference": ("dnull/reference", "pass"),
                        "d4/c008": ("dnull/reference", "fail")}  # fmt: skip
    assert points["d0/reference"]["quality"]["identical"] == 0.0
    assert {d["at"] for d in points["d0/reference"]["quality"]["diverged"]} == {18}
    assert "fail d0/reference" in out and "fail d4/c008" in out and "fail d4/reference" not in out
    html = (tmp_path / "grid" / "report.html").read_text()  # the report written at the end
    table = html[html.index('<div class="quality">'):]
    table = table[:table.index("</table>")]
    assert table.count("<td>dnull/reference</td>") == 5  # the against column of every configuration × point


@pytest.mark.parametrize("extra", [("--min-identical", "1.5"), ("--api", "embeddings"), ("--workload", "embeddings"),
                                   ("--concurrency", "0"),
                                   ("--max-tokens", "0"), ("--temperature", "-1"), ("--draws", "4"),
                                   ("--temperature", "0.8", "--draws", "0"), ("--confidence", "1"),
                                   ("--grid", "d=1,2"), ("--server", "srv {d} --port {port}")])  # fmt: skip
def test_verify_refuses_bad_input_with_exit_2(tmp_path, extra):
    res = CliRunner().invoke(app, ["verify", "--url", "http://127.0.0.1:9", "--output-dir", str(tmp_path), *extra])
    assert res.exit_code == 2, res.output
    assert "error" in res.output


# the null server sampling each answer's first token: seeded by the request's seed (and a salt), shifted past 4 in flight
SAMPLE = {" yes": 0.5, " no": 0.3, " the": 0.2}
SHIFTED = {" yes": 0.1, " no": 0.2, " the": 0.7}
DRAWS = ("--temperature", "0.8", "--draws", "12", "--num-requests", "8", "--max-tokens", "4")


def test_verify_draws_catch_a_shifted_first_token_distribution(tmp_path):
    """--draws 12: past 4 in flight the server draws its first token from another distribution. Alone (c001)
    its draws (each pass its own seeds: independent samples) come from the reference's distribution (measured: TVD
    0.05 under the resolution 0.07, p 0.81: pass); at concurrency 8 the distribution shifts and the permutation
    test rejects it (fail, exit 1). Each point sends 8 prompts x 12 draws; no draw is compared one by one."""
    # 4 tokens 20 ms apart: a request lasts ~80 ms, so at concurrency 8 the client's few ms between a session's
    # requests leave ~7 in flight at each arrival, even on a busy machine (at 2 ms, too few were shifted to rely on)
    with NullServerProcess(itl=0.02, sample=SAMPLE, shift_above=4, shifted=SHIFTED) as url:
        code, out, points = _verify(url, tmp_path, "shift", "--concurrency", "1,8", *DRAWS)
    assert code == 1, out
    assert all(p["counts"]["errors"] == 0 and p["counts"]["ok"] == 96 for p in points.values()), out
    q = points["c001"]["quality"]
    d = q["distribution"]
    assert (q["verdict"], q["identical"], q["compared"], q["diverged"], d["prompts"], d["draws"]) == \
        ("pass", None, 96, [], 8, 12), out  # fmt: skip
    assert d["p"] >= 0.05 and 0 < d["tvd"] < d["resolution"], d
    assert d["tokenizer"] == "bundled" and d["outcome"] == "first 4 tokens" and d["alpha"] == 0.05
    firsts = [pp["positions"][0] for pp in d["per_prompt"]]
    assert {k for f in firsts for k in f["reference"]} == set(SAMPLE)  # the tokenizer's first tokens
    assert all(sum(f["reference"].values()) == sum(f["answer"].values()) == 12 for f in firsts)
    assert all(len(pp["positions"]) == 4 for pp in d["per_prompt"])
    q = points["c008"]["quality"]
    d = q["distribution"]
    assert q["verdict"] == "fail" and d["p"] < 0.01 and d["tvd"] > d["resolution"], out
    assert "fail c008" in out and "fail c001" not in out and "first tokens' distributions" in out
    assert "verdict rests on the identical share alone" not in out
    assert "12 independent draws per prompt" in out  # the quality table
    html = (tmp_path / "shift" / "report.html").read_text()  # the report written at the end
    table = html[html.index('<div class="quality">'):]
    table = table[:table.index("</table>")]
    assert "<th>first-tokens distribution</th>" in table and "<td>c001</td><td>reference</td><td>-</td>" in table
    assert f"<td>TVD {d['tvd']:.2f}, p {d['p']:.2g} (12 draws" in table


# the same distribution, other draws in the second configuration (the seeded draw salted): speculative sampling's case
SALTED = ("python -m loadgen.testservers.null --port {port} --behaviour '{{\"itl\": 0.002, \"sample\": "
          + json.dumps(SAMPLE).replace("{", "{{").replace("}", "}}") + ', \"sample_salt\": {s}}}\'')


def test_verify_draws_pass_other_draws_from_the_same_distribution(tmp_path):
    """--grid s=0,1: the second configuration draws its first tokens from the same distribution another way (as
    speculative sampling does): the distribution test passes it, alone and under load, as it does the first
    configuration's own load point."""
    code, out, points = _verify("", tmp_path, "salt", "--server", SALTED, "--grid", "s=0,1", "--concurrency", "4", *DRAWS)
    assert code == 0, out
    assert list(points) == ["s0/reference", "s0/c004", "s1/reference", "s1/c004"]
    for pid in ("s0/c004", "s1/reference", "s1/c004"):
        q = points[pid]["quality"]
        d = q["distribution"]
        assert q["against"] == "s0/reference" and q["verdict"] == "pass" and q["identical"] is None, (pid, q["reason"])
        assert d["p"] >= 0.05 and 0 < d["tvd"] < d["resolution"], (pid, d["p"], d["tvd"], d["resolution"])
    assert points["s0/c004"]["quality"]["verdict"] == "pass"
