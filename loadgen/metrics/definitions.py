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

from collections.abc import Sequence
from typing import Any

import numpy as np

Record = dict[str, Any]
LATENCIES = ("ttft", "ttfo", "tpot", "itl", "chunk_gap", "e2e", "tail", "ttft_from_intended", "e2e_from_intended")
SLO_KEYS = ("ttft", "tpot", "e2e")
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
