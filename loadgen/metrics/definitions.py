"""Metric definitions: the names and thresholds every figure of a run uses, and each metric of one request as
a pure function of its record (dicts as in ``requests.jsonl``); no HTTP here.

Formulas (docs/metrics.md has the full definitions, the proofs and the mapping to vLLM/AIPerf/guidellm):

* Events of one socket read share a timestamp and are merged into one event first (:func:`reads`).
* TTFT = first content event − sent; E2E = last content event − sent (the body's end, ``end``, is kept
  apart: ``tail`` = end − last content event); TPOT = (E2E − TTFT) / (out − tokens of the first read).
* ITL (token-weighted): a read carrying k > 0 tokens, a time g after the previous read that carried
  tokens (or the first read), contributes k values g/k; a read without tokens swallows no time. So a
  request's ITLs sum to last − first content event and their mean is its TPOT.
* ``*_from_intended``: the same latencies measured from the intended send time (coordinated omission).
* ``incomplete``: requests the harness cancelled (run end, Ctrl-C): neither ok nor errors.

A point's summary of them is :func:`loadgen.metrics.pointsummary.summarize`; every other figure of a request
(report series, capacity probes) calls these functions, and every distribution :func:`loadgen.metrics.percentiles.stats`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.metrics.percentiles import STAT_KEYS

Record = dict[str, Any]
UNIT_WORDS = {"s": "s", "tok/s": "tokens/s", "req/s": "requests/s", "in/s": "inputs/s", "ratio": "share"}  # a unit as titles spell it


@dataclass(frozen=True)
class Metric:
    """One figure of a PointSummary: the name users type, where it lives, and how tables and charts show it."""

    tag: str  # the short name users type (bench gate --metric, --slo): ttft, output_tok_s
    path: tuple[str, ...]  # where a PointSummary holds it
    unit: str  # of the value in summary.json: a key of UNIT_WORDS
    label: str  # a table's heading: TTFT, out tok/s
    name: str  # a title's words: time to first token
    doc: str  # its formula in one line, as docs/metrics.md gives it
    higher_is_better: bool
    distribution: bool = False  # the path holds stats() of it (STAT_KEYS), named tag_stat: ttft_p99
    scale: float = 1.0  # shown as value × scale in `shown`: seconds as ms
    shown: str = ""  # the unit shown, where not `unit`
    words: str = ""  # the unit in a title's words, where not UNIT_WORDS[unit]

    @property
    def shown_unit(self) -> str:
        return self.shown or self.unit

    @property
    def unit_words(self) -> str:
        return self.words or UNIT_WORDS[self.unit]

    def title(self, scope: str = "") -> str:
        """An axis title: ``time to first token, TTFT (s)``, ``output throughput, steady state (tokens/s)``."""
        qualifier = f", {scope}" if scope else f", {self.label}" if self.distribution else ""
        return f"{self.name}{qualifier} ({self.unit_words})"

    def whole(self) -> tuple[str, ...]:
        """Where a steady-state rate's whole-point twin lives (docs/metrics.md, Throughput and Goodput)."""
        if self.path[:2] == ("throughput", "steady"):
            return ("throughput", "whole", *self.path[2:])
        return (*self.path[:-1], self.path[-1] + "_whole")

    def of(self, summary: Mapping[str, Any], stat: str | None = None) -> Any:
        """Its value in ``summary`` (a distribution's at ``stat``); None where the summary has none."""
        v: Any = summary
        for key in (*self.path, stat) if stat else self.path:
            v = v.get(key) if isinstance(v, Mapping) else None
        return v


def _latency(tag: str, label: str, name: str, doc: str) -> Metric:
    return Metric(tag, ("latency", tag), "s", label, name, doc, False, True, 1e3, "ms")


TTFT = _latency("ttft", "TTFT", "time to first token", "events[0].t − sent")
TTFO = _latency("ttfo", "TTFO", "time to first output token", "events[first_output].t − sent")
TPOT = _latency("tpot", "TPOT", "time per output token", "(last − first content event) / (output_tokens − k₁)")
ITL = _latency("itl", "ITL", "inter-token latency", "for each later read with k > 0 tokens, a time g after the previous "
               "read that carried tokens (or the first read): k values g/k")  # fmt: skip
CHUNK_GAP = _latency("chunk_gap", "chunk gap", "gap between reads", "tᵢ − tᵢ₋₁ over reads")
E2E = _latency("e2e", "E2E", "end-to-end latency", "last content event − sent")
TAIL = _latency("tail", "tail", "tail after the answer", "end − last content event")
TTFT_INTENDED = _latency("ttft_from_intended", "TTFT from intended", "time to first token from the intended send",
                         "events[0].t − intended")  # fmt: skip
E2E_INTENDED = _latency("e2e_from_intended", "E2E from intended", "end-to-end latency from the intended send",
                        "last content event − intended")  # fmt: skip
SCHEDULE_LAG = Metric("schedule_lag", ("client", "schedule_lag"), "s", "lag", "schedule lag", "sent − intended", False,
                      True, 1e3, "ms")  # fmt: skip
OUTPUT_TOK_S = Metric("output_tok_s", ("throughput", "steady", "output_tok_per_s"), "tok/s", "out tok/s",
                      "output throughput", "Σ f · out / (b − a)", True)  # fmt: skip
TOTAL_TOK_S = Metric("total_tok_s", ("throughput", "steady", "total_tok_per_s"), "tok/s", "total tok/s",
                     "total throughput", "Σ f · (out + prompt) / (b − a)", True)  # fmt: skip
INPUTS_S = Metric("inputs_s", ("throughput", "steady", "inputs_per_s"), "in/s", "inputs/s", "input throughput",
                  "Σ f · inputs / (b − a)", True)  # fmt: skip
REQ_S = Metric("req_s", ("throughput", "steady", "req_per_s"), "req/s", "req/s", "request throughput",
               "Σ f / (b − a)", True)  # fmt: skip
ERROR_RATE = Metric("error_rate", ("errors", "rate"), "ratio", "error rate", "error rate", "errors / (ok + errors)",
                    False)  # fmt: skip
GOODPUT = Metric("goodput", ("goodput", "req_per_s"), "req/s", "goodput", "goodput",
                 "steady req_per_s × good / successful", True, words="requests/s within SLOs")  # fmt: skip
CACHE_HIT_RATE = Metric("cache_hit_rate", ("prefix_cache", "hit_rate"), "ratio", "cached", "prefix-cache hits",
                        "cached_tokens / prompt_tokens", True, scale=100, shown="%")  # fmt: skip
IDENTICAL = Metric("identical", ("quality", "identical"), "ratio", "identical", "answers identical to the reference",
                   "identical / compared (bench verify)", True, scale=100, shown="%")  # fmt: skip
REGISTRY = {m.tag: m for m in (TTFT, TTFO, TPOT, ITL, CHUNK_GAP, E2E, TAIL, TTFT_INTENDED, E2E_INTENDED, SCHEDULE_LAG,
                               OUTPUT_TOK_S, TOTAL_TOK_S, INPUTS_S, REQ_S, ERROR_RATE, GOODPUT, CACHE_HIT_RATE,
                               IDENTICAL)}  # fmt: skip
LATENCIES = tuple(tag for tag, m in REGISTRY.items() if m.path[0] == "latency")
SLO_KEYS = (TTFT.tag, TPOT.tag, E2E.tag)  # what a request's --slo limits (meets_slo)


def resolve(name: str) -> tuple[Metric, str | None]:
    """A tag (``output_tok_s``), or a distribution's tag with a stat (``ttft_p99``): its metric and stat."""
    if (m := REGISTRY.get(name)) is not None and not m.distribution:
        return m, None
    tag, _, stat = name.rpartition("_")
    if (m := REGISTRY.get(tag)) is not None and m.distribution and stat in STAT_KEYS:
        return m, stat
    raise KeyError(name)


def examples() -> list[str]:
    """The names a message suggests: every scalar tag, and p99 of the first three latencies."""
    return sorted(t for t, m in REGISTRY.items() if not m.distribution) + [f"{t}_p99" for t in LATENCIES[:3]]
SLO_FROM = ("sent", "intended")
INCOMPLETE_KINDS = ("cancelled",)  # ended by the harness (end of a duration-bound run, Ctrl-C), not the server
# The thresholds the summary (loadgen.metrics.pointsummary), the run table and capacity probes warn at.
LAG_WARN_S = 0.010  # schedule lag p99 above this: the client, not the server, is late
SHORTFALL = 0.95  # achieved below 95 % of requested rate/concurrency: client-limited
LITTLE_WARN = 0.10  # the two steady request-rate estimates differ by more than this: say so
# A workload that shares no prefix yet got more than this share of its prompt tokens from the server's
# prefix cache: the server had seen the prompts before. Not near 0: a chat template's first tokens are
# shared by every request (a block or two of a short prompt) and hit legitimately.
CACHE_WARN = 0.5
PROMPT_MISMATCH = 0.02  # the server counted the prompts this much longer or shorter than intended: say so
RERUN_SPREAD = 0.10  # a p50 whose 95 % interval reaches further than this either side is said to be unsettled


def tokens_of(event: Sequence[float | None]) -> int:
    """An event's token delta; ``None`` (count not stated, not yet resolved from a total) counts as one."""
    k = event[1]
    return 1 if k is None else int(k)


def reads(r: Record) -> tuple[np.ndarray, np.ndarray]:
    """The content events as (times, tokens), consecutive events with the same timestamp (parsed from
    one socket read) merged into one: they arrived together, so no time passed between them."""
    ev = np.array(r["events"], dtype=float).reshape(-1, 2)  # an unresolved count (None) becomes NaN
    t, kf = ev[:, 0], ev[:, 1]
    k = np.where(np.isnan(kf), 1, kf).astype(np.int64)  # ... and counts as one token (tokens_of)
    if t.size < 2 or np.all(t[1:] != t[:-1]):
        return t, k
    starts = np.flatnonzero(np.concatenate(([True], t[1:] != t[:-1])))
    return t[starts], np.add.reduceat(k, starts)


def ttft(r: Record) -> float | None:
    return r["events"][0][0] - r["sent"] if r["events"] else None


def first_output(r: Record) -> int | None:
    """Index of the request's first answer event: the events before it carried the model's reasoning.
    None when there is no answer (a stream cut inside the reasoning, or no event at all)."""
    return r.get("first_output", 0) if r["events"] else None


def ttfo(r: Record) -> float | None:
    """Time to first output token (AIPerf's TTFO): to the first answer event, reasoning not counted; TTFT
    where the model does not reason."""
    i = first_output(r)
    return r["events"][i][0] - r["sent"] if i is not None else None


def inputs(r: Record) -> int | None:
    """The texts a pooling request (embeddings, rerank) sent: its inputs or documents; None for a generation."""
    return (r.get("extra") or {}).get("inputs")


def reasoning_tokens(r: Record) -> int:
    """Reasoning tokens: the server's count where its usage states one (``completion_tokens_details``), else
    the tokens of the reasoning events before the answer."""
    stated = (r.get("extra") or {}).get("reasoning_tokens")
    if isinstance(stated, int):
        return stated
    i = first_output(r)
    return sum(tokens_of(e) for e in r["events"][: len(r["events"]) if i is None else i])


def last_content(r: Record) -> float:
    """When the answer was complete: the last content event (the body's end when there is none)."""
    return r["events"][-1][0] if r["events"] else r["end"]


def e2e(r: Record) -> float:
    return last_content(r) - r["sent"]


def tail(r: Record) -> float:
    """From the last content event to the end of the body (usage chunk, ``[DONE]``, closing)."""
    return r["end"] - last_content(r)


def tpot(r: Record) -> float | None:
    """(last − first content event) / (output tokens − tokens of the first read); None when no token
    came after the first read."""
    return tpot_of_reads(*reads(r), r.get("output_tokens") or 0)


def itl(r: Record) -> np.ndarray:
    """Token-weighted inter-token latencies; tokens of the first read have none, and a read that
    carried no token passes its time on to the next one that did."""
    return itl_of_reads(*reads(r))


def chunk_gaps(r: Record) -> np.ndarray:
    """Gaps between consecutive reads that carried content (vLLM's "ITL" when one chunk = one read)."""
    return np.diff(reads(r)[0])


def tpot_of_reads(t: np.ndarray, k: np.ndarray, out: int) -> float | None:
    """:func:`tpot` from the request's :func:`reads` and output tokens (for a caller that has the reads)."""
    after_first = out - (int(k[0]) if k.size else 0)
    return float(t[-1] - t[0]) / after_first if t.size and after_first > 0 else None


def itl_of_reads(t: np.ndarray, k: np.ndarray) -> np.ndarray:
    """:func:`itl` from the request's :func:`reads` (for a caller that has them)."""
    if t.size < 2:
        return np.empty(0)
    anchor = k > 0
    anchor[0] = True  # gaps run from the first read, then from each read that carried tokens
    gaps, kk = np.diff(t[anchor]), k[anchor][1:]
    return np.repeat(gaps / kk, kk)


def incomplete(r: Record) -> bool:
    """Cancelled by the harness: counted apart from ok and errors."""
    return r["error"] is not None and r["error"]["kind"] in INCOMPLETE_KINDS


def meets_slo(r: Record, slo: dict[str, float], slo_from: str = "sent") -> bool:
    """Did a successful request meet every SLO? ``slo_from="intended"`` judges TTFT and E2E from the
    intended send time, so a client that ran late cannot make goodput look better."""
    if r["error"] is not None:
        return False
    origin = r["intended"] if slo_from == "intended" else r["sent"]
    first = r["events"][0][0] - origin if r["events"] else None
    values = {"ttft": first, "tpot": tpot(r), "e2e": last_content(r) - origin}
    for key, limit in slo.items():
        v = values[key]
        if key == "tpot" and v is None:
            continue  # a one-token answer has no TPOT and cannot violate it
        if v is None or v > limit:
            return False
    return True
