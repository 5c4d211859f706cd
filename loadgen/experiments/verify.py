"""``bench verify``: does the server give the same answers under load? (the command: :mod:`loadgen.cli.verify`)

Real servers have shipped answers that change with the batch size, under preemption, on a prefix-cache hit
or on a speculative path. The check: the same prompts (one seed for every point), greedy (temperature 0),
first alone (the ``reference`` point: concurrency 1), then under each load point, all run by the one engine
(:func:`loadgen.dispatch.sweep.run_sweep`), so each point has its performance figures as in ``bench run``.
Each answer's text is captured through the session protocol (:class:`RecordingWorkload`: the engine hands
every answer to ``Session.next``), and each load point's answers are compared prompt by prompt with the
reference's: the share that is identical, and where each diverged one first differs (a character index:
the engine sees text, not token ids).

A divergence is either a wrong token or a near-tie that floating-point reordering (another batch shape, a
cached prefix) tipped over. Where the server gives logprobs, one request per diverged prompt (after the load,
alone, as the reference ran) continues the prompt from the reference's last space before the divergence
(most BPE tokens start with one, so that is a token boundary) up to the divergent token, with the top two
logprobs of each token (``POST /v1/completions``, ``logprobs: 2``: vLLM, SGLang, llama-server, the reference
server); the **margin** is logprob(top 1) − logprob(top 2) at the token holding the first differing character,
and the entry says whether the two answers went on with those top two, one each (a near-tie tipped over).
The verdict (:class:`Tolerance`): ``pass`` when the identical share is at least ``min_identical``, or when
every divergence has a known margin below ``near_tie``; else ``fail``.

Across server configurations (``--server``/``--grid``), every point is compared with the first
configuration's reference (``against`` in :func:`run_verify`). Sampled (``temperature`` > 0), every pass
asks for the same seeded draws (:class:`RecordingWorkload`): the comparison holds where the server's
sampling honours the seed. With ``draws`` K > 1 every prompt is sent K times (each draw its own seed, each pass
its own seeds: independent samples) and the answers' first tokens' distributions are compared instead of the
draws (:func:`distribution`: mean TVD, stratified permutation test), whether or not the server honours seeds.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from os.path import commonprefix
from typing import Any

import httpx

from backends.base import Backend
from loadgen.defaults import RUN_FILE, SUMMARY_FILE
from loadgen.dispatch.engine import DEFAULT_OPTIONS, PointOptions
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.dispatch.progress import Progress
from loadgen.dispatch.sweep import PointPlan, plan_points, run_sweep
from loadgen.experiments.margin import PROBE_TIMEOUT_S, Margin, margin
from loadgen.metrics.distcompare import permutation_test, tvd
from loadgen.metrics.percentiles import stats
from loadgen.records.results import ResultsDir
from loadgen.records.writer import write_json
from loadgen.timing.clock import RunClock
from workloads.base import Session, Workload
from workloads.contracts import GenRequest

REFERENCE = "reference"  # the point id of the pass that every load point is compared with
# A near-tie: a top-two margin below this many nats. bf16 logits of magnitude 16-32 step by 0.125, and summing in
# another order (another batch shape, a cached prefix, a draft verified as several rows) moves one by a few steps:
# measured on the reference server, every such divergence but one at a margin of 0-0.375 (docs/experiments.md).
NEAR_TIE = 0.5
DRAW_SEP = "~"  # request id ~ draw index (bench verify --draws)
FIRST_TOKENS = 4  # the positions of a sampled answer whose distributions --draws compares
ENDED = "<ended>"  # a distribution block's count of the draws that ended before a position


@dataclass(frozen=True)
class Tolerance:
    """When a point passes: at least ``min_identical`` of its answers identical to the reference's, or every
    divergence at a near-tie (a known margin below ``near_tie`` nats); sampled with K > 1 draws per prompt,
    when its answers' first tokens' distributions are not told apart from the reference's at ``confidence``
    (:func:`distribution`)."""

    min_identical: float = 1.0
    near_tie: float = NEAR_TIE
    confidence: float = 0.95  # sampled with draws K > 1: a point fails when its first tokens' distributions differ
    # from the reference's at this confidence (the permutation test's p < 1 - confidence)

    def __post_init__(self) -> None:
        if not 0 <= self.min_identical <= 1 or self.near_tie < 0 or not 0 < self.confidence < 1:
            raise ValueError("the tolerance needs 0 <= min_identical <= 1, near_tie >= 0 and 0 < confidence < 1, "
                             f"got {self}")


class RecordingWorkload(Workload):
    """``inner``'s sessions at ``temperature`` (0: greedy, no sampling seed; above 0: sampled with a seed per
    request, the workload's or one made from the request id, so every pass asks for the same draws; ``max_tokens``
    capped when given), and every answer's text kept in ``answers`` (by request id) and its request in ``requests``.

    ``draws`` K > 1 (sampled only): each session is sent K times, draw k its own copy of the session (``inner``
    yields the same sessions for the same seed) with ``~k`` after every request id and its own seed (made from
    the workload's seed, else the request id, k and ``salt``: :func:`run_verify` salts each pass with its point
    id, so the passes are independent samples, as the permutation test assumes; draws that share a seed across
    passes would be alike on a server that honours seeds, however their distributions differ), so a multi-turn
    session's later turns follow each draw's own answers; ``prompt_of`` maps each request id to the one of its
    prompt (the inner request id), whose K draws the distribution comparison pools."""

    def __init__(self, inner: Workload, max_tokens: int | None = None, temperature: float = 0.0, draws: int = 1) -> None:
        if draws < 1 or (draws > 1 and not temperature):
            raise ValueError(f"draws must be >= 1, and 1 unless sampled (temperature > 0); got {draws} at {temperature}")
        self.inner, self.max_tokens, self.temperature, self.draws = inner, max_tokens, temperature, draws
        self.name, self.arrival, self.finite = inner.name, inner.arrival, inner.finite
        self.answers: dict[str, str] = {}
        self.requests: dict[str, GenRequest] = {}
        self.prompt_of: dict[str, str] = {}
        self.salt = ""

    def sessions(self, seed: int) -> Iterator[Session]:
        copies = (self.inner.sessions(seed) for _ in range(self.draws))  # the same sessions, K times
        for draws in zip(*copies, strict=True):  # one session's K draws in a row
            for k, s in enumerate(draws):
                yield RecordingSession(s, self, k if self.draws > 1 else None)

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "greedy": not self.temperature, "temperature": self.temperature,
                "max_tokens_cap": self.max_tokens, **({"draws": self.draws} if self.draws > 1 else {})}  # fmt: skip

    def shares_prefix(self) -> bool | None:
        return self.inner.shares_prefix()

    def fix(self, req: GenRequest, draw: int | None = None) -> GenRequest:
        """``req`` capped, at the temperature, with its seed; draw k of K (``draw``): ``~k`` after its id."""
        cap = req.max_tokens if self.max_tokens is None else min(req.max_tokens, self.max_tokens)
        rid = req.request_id if draw is None else f"{req.request_id}{DRAW_SEP}{draw}"
        if not self.temperature:
            seed = None
        elif draw is None:
            seed = req.seed if req.seed is not None else zlib.crc32(rid.encode())
        else:
            seed = zlib.crc32(f"{req.request_id if req.seed is None else req.seed}{DRAW_SEP}{draw}{DRAW_SEP}{self.salt}".encode())
        fixed = replace(req, request_id=rid, temperature=self.temperature, seed=seed, max_tokens=cap)
        self.requests[rid], self.prompt_of[rid] = fixed, req.request_id
        return fixed


class RecordingSession(Session):
    """One session of a :class:`RecordingWorkload` (its draw ``draw`` of K, None when K is 1): its requests
    fixed (:meth:`RecordingWorkload.fix`), its answers recorded."""

    def __init__(self, inner: Session, owner: RecordingWorkload, draw: int | None = None) -> None:
        self.inner, self.owner, self.draw, self.at = inner, owner, draw, inner.at
        self.current: GenRequest | None = None

    @property
    def cls(self) -> str:  # type: ignore[override]
        return self.inner.cls

    def first(self) -> GenRequest:
        self.current = self.owner.fix(self.inner.first(), self.draw)
        return self.current

    def next(self, response_text: str) -> tuple[float, GenRequest] | None:
        assert self.current is not None, "first() comes first"
        self.owner.answers[self.current.request_id] = response_text
        nxt = self.inner.next(response_text)
        if nxt is None:
            return None
        think, req = nxt
        self.current = self.owner.fix(req, self.draw)
        return think, self.current


def divergence(reference: str, answer: str) -> int | None:
    """The character index where ``answer`` first differs from ``reference``; None when they are equal."""
    return None if reference == answer else len(commonprefix([reference, answer]))


def judge(compared: int, identical: float | None, margins: Sequence[float | None], tol: Tolerance) -> tuple[str, str]:
    """A point's verdict and why (see :class:`Tolerance`)."""
    if not compared or identical is None:
        return "fail", "no prompt was answered in both the reference and this point"
    if identical >= tol.min_identical:
        return "pass", f"identical {identical:.1%} >= {tol.min_identical:.1%}"
    if all(m is not None and m < tol.near_tie for m in margins):
        return "pass", f"every divergence is a near-tie (margin < {tol.near_tie:g})"
    unknown = sum(m is None for m in margins)
    wrong = sum(m is not None and m >= tol.near_tie for m in margins)
    parts = [f"{wrong} at a margin >= {tol.near_tie:g}"] if wrong else []
    parts += [f"{unknown} of unknown margin"] if unknown else []
    return "fail", f"identical {identical:.1%} < {tol.min_identical:.1%}; divergences: {', '.join(parts)}"


@dataclass(frozen=True)
class FirstTokens:
    """A sampled draw's outcome for the distribution comparison: its answer's first :data:`FIRST_TOKENS` tokens
    under ``tokenizer`` (named ``name``), as text, one per position (fewer: the answer ended). Any function of the
    text gives a valid test (both passes are read the same way); the served model's tokenizer makes them the tokens
    the server drew. Several positions, because a speculative decoder samples its first token from the prefill,
    before any draft: only the later ones show whether its drafted tokens keep the distribution."""

    name: str
    tokenizer: Any  # a tokenizers.Tokenizer; None: the first words (each with its leading spaces) instead

    def __call__(self, text: str) -> tuple[str, ...]:
        if self.tokenizer is None:
            return tuple(re.findall(r"\s*\S+", text)[:FIRST_TOKENS])
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return tuple(self.tokenizer.decode([i]) for i in ids[:FIRST_TOKENS])

    @classmethod
    def of(cls, workload: Workload) -> FirstTokens:
        """The tokenizer ``workload`` cuts its prompts with (a synthetic, dataset or trace workload's: ``--tokenizer``,
        which ``auto`` resolves to the served model's where it can, else the workload file's, ``bundled`` the
        reference server's model's); a workload with none reads the first words."""
        builder, spec = getattr(workload, "builder", None), getattr(workload, "spec", None)
        if builder is None:
            return cls("none: the first words", None)
        return cls(str(getattr(spec, "tokenizer", "the workload's")), builder.tokenizer)


def distribution(reference: RecordingWorkload, point: RecordingWorkload, outcome: FirstTokens, tol: Tolerance) -> dict[str, Any]:
    """A sampled point's ``distribution`` block: per prompt its draws' first tokens (``outcome``) in the reference
    and the point, the mean TVD between their frequencies over the prompts and positions, its stratified permutation test
    (:mod:`loadgen.metrics.distcompare`) and the verdict: ``pass`` when p >= 1 - ``tol.confidence``."""

    def by_prompt(rec: RecordingWorkload) -> dict[str, list[tuple[str, ...]]]:
        out: dict[str, list[tuple[str, ...]]] = {}
        for rid, text in rec.answers.items():
            out.setdefault(rec.prompt_of[rid], []).append(outcome(text))
        return out

    ref, got = by_prompt(reference), by_prompt(point)
    ids = sorted(ref.keys() & got.keys())
    alpha = round(1 - tol.confidence, 12)
    block: dict[str, Any] = {"outcome": f"first {FIRST_TOKENS} tokens", "tokenizer": outcome.name, "draws": point.draws,
                             "statistic": "mean TVD", "alpha": alpha, "prompts": len(ids)}  # fmt: skip
    if not ids:
        return {**block, "tvd": None, "p": None, "resolution": None, "verdict": "fail",
                "reason": "no prompt was answered in both the reference and this point"}  # fmt: skip
    test = permutation_test([(ref[i], got[i]) for i in ids])
    ok = test.p >= alpha
    return {
        **block, "tvd": test.statistic, "p": test.p, "resolution": test.null_q95, "n_perm": test.n_perm,
        "perm_seed": test.seed, "verdict": "pass" if ok else "fail",
        "reason": f"first tokens' distributions: mean TVD {test.statistic:.3f} over {len(ids)} prompts and "
                  f"{FIRST_TOKENS} positions, permutation p "
                  f"{test.p:.3g} {'>=' if ok else '<'} {alpha:g} (resolution: a mean TVD of {test.null_q95:.3f} is "
                  f"what these draws tell apart from noise)",
        "per_prompt": [{"id": i, "positions": [_position(ref[i], got[i], j) for j in range(FIRST_TOKENS)]} for i in ids],
    }  # fmt: skip


def _position(ref: Sequence[tuple[str, ...]], got: Sequence[tuple[str, ...]], j: int) -> dict[str, Any]:
    """One prompt's token counts at position ``j`` in both passes, and their TVD (``ENDED``: the answer was shorter)."""
    a, b = (Counter(d[j] if j < len(d) else ENDED for d in draws) for draws in (ref, got))
    return {"reference": dict(a.most_common()), "answer": dict(b.most_common()), "tvd": tvd(a, b)}


async def quality(
    backend: Backend, reference: RecordingWorkload, point: RecordingWorkload, tol: Tolerance,
    asked: dict[tuple[str, str], Margin], outcome: FirstTokens | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A load point's ``quality`` section: its answers against the reference's, margins asked for the
    diverged ones (``asked``: margins already asked, by request id and common text, shared by the points); sampled
    with K > 1 draws, independent of the reference's, its ``distribution`` block instead (:func:`distribution`,
    ``outcome`` each draw's), whose verdict is the point's: draws of other seeds are not compared one by one."""
    ids = sorted(reference.answers.keys() & point.answers.keys())
    if point.draws > 1:
        dist = distribution(reference, point, outcome or FirstTokens.of(point.inner), tol)
        return {"identical": None, "compared": len(ids), "diverged": [], "at_unit": "char", "first_divergence": stats([]),
                "worst_margin": None, "margins_unknown": 0, "top_two": 0, "distribution": dist,
                "tolerance": asdict(tol), "verdict": dist["verdict"], "reason": dist["reason"]}  # fmt: skip
    diverged: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False, headers=backend.auth_headers()) as client:
        for rid in ids:
            ref, got = reference.answers[rid], point.answers[rid]
            if (at := divergence(ref, got)) is None:
                continue
            key = (rid, ref[:at])
            if key not in asked:
                asked[key] = await margin(client, backend, reference.requests[rid], ref, at)
            diverged.append({"id": rid, "at": at, "reference": ref[at:at + 40], "answer": got[at:at + 40],
                             **asked[key].cells(ref, got)})  # fmt: skip
    identical = (len(ids) - len(diverged)) / len(ids) if ids else None
    margins = [d["margin"] for d in diverged]
    verdict, reason = judge(len(ids), identical, margins, tol)
    known = [m for m in margins if m is not None]
    return {
        "identical": identical, "compared": len(ids), "diverged": diverged, "at_unit": "char",
        "first_divergence": stats(d["at"] for d in diverged), "worst_margin": max(known, default=None),
        "margins_unknown": len(margins) - len(known), "top_two": sum(bool(d.get("top_two")) for d in diverged),
        "tolerance": asdict(tol), "verdict": verdict, "reason": reason,
    }  # fmt: skip


def plan_verify(workload: Workload, reference: LoadSpec, loads: Sequence[LoadSpec], repeat: int = 1,
                max_tokens: int | None = None, temperature: float = 0.0, draws: int = 1) -> list[PointPlan]:  # fmt: skip
    """The ``reference`` point (``reference`` load: concurrency 1), then each load (× ``repeat`` trials), every
    one with the reference's seed (the same prompts) and a fresh :class:`RecordingWorkload`; ``draws`` K: each
    prompt sent K times, so each point's request count is K times the load's."""
    plans = [PointPlan(REFERENCE, workload, reference), *plan_points([workload], loads, repeat)]
    return [replace(p, workload=RecordingWorkload(workload, max_tokens, temperature, draws),
                    load=replace(p.load, seed=reference.seed,
                                 num_requests=None if p.load.num_requests is None else p.load.num_requests * draws))
            for p in plans]  # fmt: skip


async def run_verify(
    backend: Backend, plans: Sequence[PointPlan], results: ResultsDir, clock: RunClock, config: dict[str, Any],
    tol: Tolerance, *, against: PointPlan | None = None, options: PointOptions = DEFAULT_OPTIONS,
    live: Callable[[PointPlan, Progress], AbstractContextManager[Any]] | None = None,
    run_extra: dict[str, Any] | None = None, previous: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``plans`` (:func:`plan_verify`) and add a ``quality`` section to the summary (its own
    ``summary.json`` and the run's) of every point but the one compared with: ``against``, the reference
    point of a server grid's first configuration, else this server's own (``plans[0]``); its ``against``
    names it. Margins are asked of this server (``backend``). ``previous``: as for
    :func:`loadgen.dispatch.sweep.run_sweep`. Returns this server's PointSummaries, its reference's first."""
    for plan in plans:  # sampled draws: each pass its own seeds (RecordingWorkload), named by its final point id
        assert isinstance(plan.workload, RecordingWorkload)
        plan.workload.salt = plan.point_id
    summaries = await run_sweep(backend, plans, results, clock, config, options=options, live=live, previous=previous,
                                run_extra={**(run_extra or {}), "verify": {"tolerance": asdict(tol)}})  # fmt: skip
    ref = against or plans[0]
    assert isinstance(ref.workload, RecordingWorkload)
    asked: dict[tuple[str, str], Margin] = {}
    outcome = FirstTokens.of(ref.workload.inner)
    for plan, s in zip(plans, summaries, strict=False):  # an interrupted run has fewer summaries
        assert isinstance(plan.workload, RecordingWorkload)
        if plan is ref:
            continue
        s["quality"] = {"against": ref.point_id, **await quality(backend, ref.workload, plan.workload, tol, asked, outcome)}
        write_json(results.point_dir(plan.point_id) / SUMMARY_FILE, s)
    results.write_summary(json.loads((results.path / RUN_FILE).read_text()), [*previous, *summaries])
    return summaries
