"""A load point's metrics from its request records (:func:`summarize`: the metric part of a PointSummary,
with ``per_class`` holding the same for every workload class), and what a PointSummary gets added once the
point has run (the prefix cache's share, energy per token, the note on a reasoning model).

* Steady-state window = [first send + one median request length, last send], valid when at least one
  median request length long; the request rate inside it is output tok/s ÷ mean output tokens, cross-
  checked by Little's law (:func:`steady_window`, :func:`summarize`).
* ``incomplete``: requests the harness cancelled (run end, Ctrl-C): neither ok nor errors.
* Goodput: successful requests meeting every given SLO, per second.

Each request's figures are :mod:`loadgen.metrics.definitions`' definitions; each distribution
:func:`loadgen.metrics.percentiles.stats`.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from loadgen.metrics.definitions import (
    CACHE_WARN,
    LAG_WARN_S,
    LITTLE_WARN,
    PROMPT_MISMATCH,
    SHORTFALL,
    SLO_FROM,
    Record,
    e2e,
    incomplete,
    inputs,
    itl_of_reads,
    last_content,
    meets_slo,
    reads,
    reasoning_tokens,
    tail,
    tpot_of_reads,
    ttfo,
    ttft,
)
from loadgen.metrics.percentiles import stats


def spec_decode(records: Sequence[Record]) -> dict[str, Any] | None:
    """Speculative-decoding acceptance over successful requests whose server reported counts."""
    counts = [c for r in records if r["error"] is None and (c := r.get("extra", {}).get("spec_decode"))]
    if not counts:
        return None
    drafted, accepted = sum(c["drafted"] for c in counts), sum(c["accepted"] for c in counts)
    return {"requests": len(counts), "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None}  # fmt: skip


def prefix_cache(records: Sequence[Record]) -> dict[str, Any] | None:
    """Prompt tokens the server's prefix cache served, over successful requests whose responses said
    (usage ``cached_tokens``, llama.cpp ``timings.cache_n``); None when none did."""
    said = [r for r in records if r["error"] is None and r.get("cached_tokens") is not None]
    if not said:
        return None
    cached, prompt = sum(r["cached_tokens"] for r in said), sum(r["prompt_tokens"] or 0 for r in said)
    return {"source": "responses", "requests": len(said), "cached_tokens": cached, "prompt_tokens": prompt,
            "hit_rate": cached / prompt if prompt else None}  # fmt: skip


def prompt_lengths(records: Sequence[Record]) -> dict[str, Any] | None:
    """The prompt tokens the server counted (usage) against those the workload's tokenizer intended, over
    successful requests that have both; with a warning when they differ by more than
    :data:`PROMPT_MISMATCH` (the prompts are not the lengths asked: another model's tokenizer). None
    when no request has both (a chat prompt's template tokens are the server's, so it has no intent)."""
    both = [r for r in records if r["error"] is None and r.get("prompt_tokens_intended") is not None
            and r["prompt_tokens_source"] in ("usage", "chunk_usage")]  # fmt: skip
    if not both:
        return None
    intended, counted = sum(r["prompt_tokens_intended"] for r in both), sum(r["prompt_tokens"] for r in both)
    out: dict[str, Any] = {"requests": len(both), "intended": intended, "counted": counted,
                           "ratio": counted / intended if intended else None}  # fmt: skip
    if out["ratio"] is not None and abs(out["ratio"] - 1) > PROMPT_MISMATCH:
        out["warning"] = (f"the server counted {counted:,} prompt tokens where the workload's tokenizer made "
                          f"{intended:,} ({out['ratio'] - 1:+.1%}): the prompts are not the lengths asked; "
                          "give the served model's tokenizer (--tokenizer)")  # fmt: skip
    return out


def add_prefix_cache(point: dict[str, Any], shares_prefix: bool | None) -> None:
    """Set a PointSummary's ``prefix_cache`` from its responses, else from the server's counters over the
    point (warm-up included), and warn where a workload that shares no prefix (``shares_prefix`` False;
    None: unknown) got more than :data:`CACHE_WARN` of its prompt tokens from the cache."""
    pc = point.get("prefix_cache")
    if pc is None:
        counted = (((point.get("server") or {}).get("point") or {}).get("prefix_cache"))
        if counted is None:
            return
        pc = point["prefix_cache"] = {"source": "server counters (whole point, warm-up included)", **counted}
    rate = pc.get("hit_rate")
    if shares_prefix is False and rate is not None and rate > CACHE_WARN:
        pc["warning"] = (f"{rate:.0%} of the prompt tokens came from the server's prefix cache, yet the workload "
                         "shares no prefix: the server had seen these prompts before (a run with the same --seed?), "
                         "so latency and throughput are a warm cache's; run with a new --seed, or --reset-cache")  # fmt: skip


def pooling(point: dict[str, Any]) -> bool:
    """A pooling run's point (embeddings, rerank): it counts inputs and generated no token."""
    return "inputs" in point.get("counts", {})


def reasoning_note(point: dict[str, Any]) -> str | None:
    """The line a point's table and report carry when its model reasoned before answering."""
    n, lat = point["counts"].get("reasoning_tokens"), point["latency"]
    if not n or "ttfo" not in lat or lat["ttfo"]["p50"] is None:
        return None
    share = n / point["counts"]["output_tokens"] if point["counts"]["output_tokens"] else 0.0
    return (f"the model reasoned before answering: {n:,} reasoning tokens ({share:.0%} of the output); time to "
            f"its first answer token (TTFO) p50 {lat['ttfo']['p50'] * 1e3:,.1f} ms, p99 {lat['ttfo']['p99'] * 1e3:,.1f} "
            "ms, where TTFT is the first token of either")  # fmt: skip


class Window(NamedTuple):
    """The steady-state window; when not ``valid`` it is the whole run and ``reason`` says why."""

    start: float
    end: float
    valid: bool
    reason: str | None


# bench verify's quality table (the terminal's and the report's): a row per point compared with a reference
QUALITY_HEADER = ("point", "against", "identical", "compared", "diverged", "first div p50", "worst margin", "top two",
                  "first-tokens distribution", "verdict")  # fmt: skip
QUALITY_NOTE = ("first divergence: a character index; worst margin: the reference's top-two logprob gap at the "
                "divergent token, asked of the point's server alone (- unknown); top two: divergences where the two "
                "answers went on with that server's top two tokens, one each; first-tokens distribution (sampled, several draws per "
                "prompt): the mean total variation distance from the reference's and its permutation test's p")  # fmt: skip


def quality_cells(point_id: str, q: dict[str, Any]) -> list[str]:
    """A point's row of :data:`QUALITY_HEADER` from its ``quality`` section (bench verify)."""
    p50, worst = q["first_divergence"]["p50"], q["worst_margin"]
    unknown = f" ({q['margins_unknown']} unknown)" if q["margins_unknown"] else ""
    return [point_id, q.get("against", "reference"), "-" if q["identical"] is None else f"{q['identical']:.1%}",
            str(q["compared"]), str(len(q["diverged"])), "-" if p50 is None else f"{p50:.0f}",
            ("-" if worst is None else f"{worst:.3f}") + unknown,
            f"{q['top_two']}/{known}" if (known := len(q["diverged"]) - q["margins_unknown"]) and "top_two" in q
            else "-", distribution_cell(q.get("distribution")), q["verdict"]]  # fmt: skip


def distribution_cell(d: dict[str, Any] | None) -> str:
    """A sampled point's first tokens' distributions against the reference's: "TVD 0.04, p 0.61" ("-": not sampled
    with several draws)."""
    if not d:
        return "-"
    if d.get("p") is None:
        return "nothing compared"
    return f"TVD {d['tvd']:.2f}, p {d['p']:.2g} ({d['draws']} draws, res. {d['resolution']:.2f})"


def steady_window(records: Sequence[Record]) -> Window:
    """[first measured send + d, last measured send], d = the median request length (send to end of
    body) of the successful measured requests.

    Before first send + d the system is still filling (open loop: the in-flight count grows for about
    one request length; closed loop: no slot has completed yet, so completions are impossible); after
    the last send it drains. In between the load is fully applied. It also starts no earlier than the
    last warm-up request's end (a warm-up still in flight holds a seat whose tokens are not counted).
    Valid when at least d long, i.e. it holds a whole request length of steady state; else the whole
    run [first send, last end] with ``valid = False`` and the reason."""
    measured = [r for r in records if not r["warmup"]]
    if not measured:
        return Window(0.0, 0.0, False, "no measured request")
    s0, s1 = min(r["sent"] for r in measured), max(r["sent"] for r in measured)
    whole = (s0, max(r["end"] for r in measured))
    ok = [r for r in measured if r["error"] is None]
    if not ok:
        return Window(*whole, False, "no successful request")
    d = float(np.median([r["end"] - r["sent"] for r in ok]))
    a = max(s0 + d, max((r["end"] for r in records if r["warmup"]), default=s0))
    if s1 - a >= d and s1 > a:
        return Window(a, s1, True, None)
    return Window(*whole, False, (
        f"the load was applied for {max(s1 - a, 0.0):.3g} s after the ramp-up, less than one request length "
        f"({d:.3g} s): sends spanned {s1 - s0:.3g} s; the whole run is reported"
    ))  # fmt: skip


def summarize(
    records: Sequence[Record], load: dict[str, Any] | None = None, slo: dict[str, float] | None = None,
    client_cpu: float | None = None, client_wait: float | None = None, slo_from: str = "sent",
) -> dict[str, Any]:
    """Metrics of one load point; ``load`` (requested rate/concurrency) feeds the client-health part."""
    if slo_from not in SLO_FROM:
        raise ValueError(f"slo_from must be one of {', '.join(SLO_FROM)}, got {slo_from!r}")
    window = steady_window(records)
    core = _core(records, window, slo, slo_from)
    out = copy.deepcopy(core)
    out["window"] = [window.start, window.end]
    out["client"] = client_health(records, (window.start, window.end), load or {}, client_cpu, client_wait,
                                  steady=window.valid)
    out["per_class"] = {}
    for c in sorted({r["cls"] for r in records if not r["warmup"]}):
        mine = [r for r in records if r["cls"] == c]
        out["per_class"][c] = core if len(mine) == len(records) else _core(mine, window, slo, slo_from)  # one class: all
    return out


def _core(records: Sequence[Record], window: Window, slo: dict[str, float] | None, slo_from: str) -> dict[str, Any]:
    measured = [r for r in records if not r["warmup"]]
    ok = [r for r in measured if r["error"] is None]
    n_inc = sum(1 for r in measured if incomplete(r))
    judged = len(measured) - n_inc  # ok + errors: the denominator of error rate and goodput fraction
    span = (max(r["end"] for r in measured) - min(r["sent"] for r in measured)) if measured else 0.0
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    with_events = [r for r in ok if r["events"]]
    rd = [reads(r) for r in ok]  # once per request: TPOT, ITL and chunk gaps all start from the reads
    lat = {
        "ttft": stats(ttft(r) for r in with_events),  # type: ignore[misc]
        "ttfo": stats(v for r in with_events if (v := ttfo(r)) is not None),
        "tpot": stats(v for r, (t, k) in zip(ok, rd, strict=True) if (v := tpot_of_reads(t, k, r["output_tokens"] or 0)) is not None),
        "itl": stats(np.concatenate([itl_of_reads(t, k) for t, k in rd]) if ok else np.empty(0)),
        "chunk_gap": stats(np.concatenate([np.diff(t) for t, _ in rd]) if ok else np.empty(0)),
        "e2e": stats(e2e(r) for r in ok),
        "tail": stats(tail(r) for r in ok),
        "ttft_from_intended": stats(r["events"][0][0] - r["intended"] for r in with_events),
        "e2e_from_intended": stats(last_content(r) - r["intended"] for r in ok),
    }
    texts = [n for r in ok if (n := inputs(r)) is not None]  # a pooling run's inputs (or documents)
    whole = _rates(len(ok), out_tokens, in_tokens, span, sum(texts) if texts else None)
    steady = _steady(ok, rd, window, bool(texts)) if window.valid else {**whole, "req_per_s_little": None, "req_per_s_completed": None, "output_tok_per_s_events": None}
    steady.update(valid=window.valid, reason=window.reason, note=None)
    little, req = steady["req_per_s_little"], steady["req_per_s"]
    if little and req and abs(little / req - 1) > LITTLE_WARN:
        steady["note"] = (f"request rate {req:.3g}/s from tokens vs {little:.3g}/s from Little's law: "
                          "the load was not steady in the window")
    kinds = Counter(r["error"]["kind"] for r in measured if r["error"] is not None and not incomplete(r))
    res: dict[str, Any] = {
        "counts": {
            "requests": len(measured), "ok": len(ok), "errors": judged - len(ok), "incomplete": n_inc,
            "warmup": len(records) - len(measured), "output_tokens": out_tokens, "prompt_tokens": in_tokens,
            "output_tokens_sources": dict(Counter(r["output_tokens_source"] for r in ok)),
            "reasoning_tokens": sum(reasoning_tokens(r) for r in ok),
        },  # fmt: skip
        "latency": lat,
        "throughput": {"whole": whole, "steady": steady},
        "errors": {"rate": (judged - len(ok)) / judged if judged else 0.0, "by_kind": dict(sorted(kinds.items()))},
    }
    if texts:
        res["counts"]["inputs"] = sum(texts)
    if n_inc:  # what is known of their latency: a lower bound (they ran at least this long)
        res["latency"]["incomplete_age"] = stats(r["end"] - r["sent"] for r in measured if incomplete(r))
    if (spec := spec_decode(measured)) is not None:
        res["spec_decode"] = spec
    if (pc := prefix_cache(measured)) is not None:
        res["prefix_cache"] = pc
    if (pl := prompt_lengths(measured)) is not None:
        res["prompt_lengths"] = pl
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo, slo_from))
        share = good / len(ok) if ok else 0.0
        res["goodput"] = {
            "slo": slo, "slo_from": slo_from, "good": good, "fraction": good / judged if judged else 0.0,
            "req_per_s": steady["req_per_s"] * share if steady["req_per_s"] is not None else None,
            "req_per_s_whole": good / span if span > 0 else None,
        }  # fmt: skip
    return res


def _steady(ok: Sequence[Record], rd: Sequence[tuple[np.ndarray, np.ndarray]], w: Window, pooling: bool) -> dict[str, Any]:
    """Rates inside a valid window from each request's share of it: f = |[sent, end] ∩ window| /
    (end − sent). req/s = Σ f / length; output (total) tok/s = Σ f · output (+ prompt) tokens / length.
    Unbiased in a steady state whatever the request lengths and wherever the window's edges fall inside
    requests (docs/metrics.md has the proof); completions in the window are not, as none can happen
    early in it when every request started at once. Cross-checks: Little's law (mean in-flight ÷ mean
    request length), completions in the window, and output tokens whose events arrived in it (from ``rd``, each
    request's :func:`reads`)."""
    a, b = w.start, w.end
    wlen = b - a
    if not ok:
        return {**_rates(0, 0, 0, wlen, 0 if pooling else None), "req_per_s_little": None, "req_per_s_completed": 0.0,
                "output_tok_per_s_events": 0.0}  # fmt: skip
    share = np.asarray([_share(r["sent"], r["end"], a, b) for r in ok])
    out = np.asarray([r["output_tokens"] or 0 for r in ok], dtype=float)
    prompt = np.asarray([r["prompt_tokens"] or 0 for r in ok], dtype=float)
    inflight = sum(max(0.0, min(r["end"], b) - max(r["sent"], a)) for r in ok) / wlen
    mean_len = float(np.mean([r["end"] - r["sent"] for r in ok]))
    events = sum(int(k[(t > a) & (t <= b)].sum()) for t, k in rd)
    rates = {
        "seconds": wlen, "req_per_s": float(share.sum()) / wlen, "output_tok_per_s": float(share @ out) / wlen,
        "total_tok_per_s": float(share @ (out + prompt)) / wlen,
        "req_per_s_little": inflight / mean_len if mean_len > 0 else None,
        "req_per_s_completed": sum(1 for r in ok if a < r["end"] <= b) / wlen,
        "output_tok_per_s_events": events / wlen,
    }  # fmt: skip
    if pooling:
        rates["inputs_per_s"] = float(share @ np.asarray([inputs(r) or 0 for r in ok], dtype=float)) / wlen
    return rates


def _share(sent: float, end: float, a: float, b: float) -> float:
    """The fraction of [sent, end] inside [a, b] (1 or 0 for an instantaneous request)."""
    if end <= sent:
        return 1.0 if a <= sent <= b else 0.0
    return max(0.0, min(end, b) - max(sent, a)) / (end - sent)


def _rates(requests: int, out_tokens: int, in_tokens: int, seconds: float, texts: int | None) -> dict[str, float | None]:
    """Whole-span rates; ``texts`` (a pooling run's inputs) adds ``inputs_per_s``."""
    ok = seconds > 0
    out = {
        "seconds": seconds, "req_per_s": requests / seconds if ok else None,
        "output_tok_per_s": out_tokens / seconds if ok else None,
        "total_tok_per_s": (out_tokens + in_tokens) / seconds if ok else None,
    }  # fmt: skip
    if texts is not None:
        out["inputs_per_s"] = texts / seconds if ok else None
    return out


def client_health(
    records: Sequence[Record], window: tuple[float, float], load: dict[str, Any], client_cpu: float | None = None,
    client_wait: float | None = None, steady: bool = True,
) -> dict[str, Any]:
    """Is the client keeping its schedule? Schedule lag, achieved vs requested load, warnings. Without a
    steady state (``steady`` false: the window is the whole run, ramp and drain included) the achieved
    concurrency is reported but not judged."""
    measured = sorted((r for r in records if not r["warmup"]), key=lambda r: r["sent"])
    lag = stats(r["sent"] - r["intended"] for r in measured)
    a, b = window
    wlen = b - a
    inflight = sum(max(0.0, min(r["end"], b) - max(r["sent"], a)) for r in records)
    out: dict[str, Any] = {
        "schedule_lag": lag,
        "achieved_concurrency": inflight / wlen if wlen > 0 else None,
        "requested_concurrency": load.get("concurrency") if load.get("process") == "closed" else None,
        "achieved_rate": None, "scheduled_rate": None, "requested_rate": load.get("rate"),
        "cpu": client_cpu, "cpu_wait": client_wait, "limited": False, "warnings": [],
    }  # fmt: skip
    if len(measured) > 1:
        sent_span = measured[-1]["sent"] - measured[0]["sent"]
        intended = sorted(r["intended"] for r in measured)
        if sent_span > 0:
            out["achieved_rate"] = (len(measured) - 1) / sent_span
        if intended[-1] > intended[0]:
            out["scheduled_rate"] = (len(measured) - 1) / (intended[-1] - intended[0])
    warnings: list[str] = out["warnings"]
    open_loop = load.get("process") not in (None, "closed")
    if open_loop and lag["p99"] is not None and lag["p99"] > LAG_WARN_S:
        warnings.append(f"client schedule lag p99 {lag['p99'] * 1e3:.1f} ms > {LAG_WARN_S * 1e3:.0f} ms")
    if open_loop and out["achieved_rate"] and out["scheduled_rate"]:
        if out["achieved_rate"] < SHORTFALL * out["scheduled_rate"]:
            warnings.append(f"achieved {out['achieved_rate']:.1f} req/s of {out['scheduled_rate']:.1f} scheduled")
    req_c, got_c = out["requested_concurrency"], out["achieved_concurrency"]
    if steady and req_c and got_c is not None and got_c < SHORTFALL * req_c and not load.get("think_time"):
        warnings.append(f"achieved concurrency {got_c:.1f} of {req_c} requested")
    if client_cpu is not None and client_cpu > 0.9:
        warnings.append(f"client process used {client_cpu:.0%} of a CPU core")
    if client_wait is not None and client_wait > 0.2:
        warnings.append(f"client waited for a free CPU {client_wait:.0%} of the time: the machine is overloaded")
    out["limited"] = bool(warnings)
    return out


def joules_per_output_token(telemetry_summary: dict[str, Any], output_tokens: float) -> float | None:
    """GPU energy in the steady window per output token produced in that window, when power is known."""
    energy = telemetry_summary.get("gpu_energy_j")
    if energy is None or output_tokens <= 0:
        return None
    return float(energy) / output_tokens


def add_energy_per_token(point: dict[str, Any]) -> None:
    """Set ``telemetry.joules_per_output_token`` of a PointSummary from its steady-window energy and the
    metrics' steady-window output tokens (both over the same window); no-op without power readings."""
    tel, steady = point.get("telemetry"), point.get("throughput", {}).get("steady", {})
    if not isinstance(tel, dict) or not steady.get("output_tok_per_s") or not steady.get("seconds"):
        return
    jpt = joules_per_output_token(tel, steady["output_tok_per_s"] * steady["seconds"])
    if jpt is not None:
        tel["joules_per_output_token"] = jpt
