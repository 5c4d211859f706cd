"""A test server with a known answer: the null server's SSE protocol paced by a service model.

The model (:class:`ServiceModel`) is a small continuous-batching server:

* ``slots`` requests run at once; a request beyond them waits in a FIFO queue for a free slot;
* a request that gets a slot first prefills for ``prefill_base + prefill_per_token × prompt tokens``
  seconds, then streams its first token;
* every further token takes one decode step of ``decode_base + decode_per_seq × b`` seconds, ``b`` being
  the slots occupied when the step starts (a bigger batch makes every step slower);
* prompt tokens are whitespace-separated words (as the null server counts them), output tokens are
  ``max_tokens`` (one token per stream event).

:func:`simulate` runs the same model as a discrete-event simulation in virtual time, so the true
latencies at any load, and the true capacity under any SLO (:func:`true_capacity`), are derived, not
measured. The live server (``python -m loadgen.testservers.servicemodel``, :class:`ServiceModelProcess`)
follows the same rules on the wall clock, each step scheduled on an absolute time line so timer jitter does
not accumulate. :class:`SimProber` probes the simulation for :func:`loadgen.capacity.search.search`.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

from loadgen.capacity.probe import Probe, ProbeJudge, probe_requests, probe_result
from loadgen.capacity.sequential import Decision, Sequential
from loadgen.capacity.stats import Samples, check
from loadgen.metrics.slo import SLO
from loadgen.testservers.null import Conn, NullServerProcess, serve
from loadgen.testservers.stream import Behaviour, Stream, http_chunk


@dataclass(frozen=True)
class ServiceModel:
    """The model's costs (the module's docstring gives its rules); times in seconds."""

    slots: int = 8  # requests served at once; more wait in a FIFO queue
    prefill_base: float = 0.004  # a prefill's fixed cost ...
    prefill_per_token: float = 0.0001  # ... and its cost per prompt token
    decode_base: float = 0.004  # a decode step's fixed cost ...
    decode_per_seq: float = 0.001  # ... and its cost per occupied slot

    def __post_init__(self) -> None:
        if self.slots < 1 or min(self.prefill_base, self.prefill_per_token, self.decode_base, self.decode_per_seq) < 0:
            raise ValueError("service model: slots >= 1 and non-negative costs")

    def prefill(self, prompt_tokens: int) -> float:
        return self.prefill_base + self.prefill_per_token * prompt_tokens

    def step(self, occupied: int) -> float:
        return self.decode_base + self.decode_per_seq * occupied


@dataclass(frozen=True)
class Timeline:
    """One simulated request: arrival, first token and last token times (s)."""

    arrival: float
    first: float
    end: float
    output_tokens: int

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def e2e(self) -> float:
        return self.end - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def simulate(
    model: ServiceModel, jobs: Sequence[tuple[int, int]], arrivals: Sequence[float] | None = None,
    concurrency: int | None = None,
) -> list[Timeline]:  # fmt: skip
    """The model's exact timelines for ``jobs`` ``(prompt_tokens, output_tokens)`` in dispatch order: sent at
    ``arrivals`` (open loop) or by ``concurrency`` sessions that send the next job when theirs ends.

    One heap event per token (the hot loop of every virtual-time search): a token that is not a request's
    last replaces itself on the heap by the next one (one sift, not a pop and a push)."""
    if (arrivals is None) == (concurrency is None):
        raise ValueError("simulate: give arrivals (open loop) or concurrency (closed loop)")
    n = len(jobs)
    arrive, first, end = [0.0] * n, [0.0] * n, [0.0] * n
    outs = [out for _, out in jobs]
    left = outs.copy()
    prefill = [model.prefill(prompt) for prompt, _ in jobs]
    step = [model.step(b) for b in range(model.slots + 1)]
    # (time, seq, kind, job); kind 0 arrive, 1 token; seq (unique) breaks ties in push order
    events: list[tuple[float, int, int, int]] = []
    seq = itertools.count()
    push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace
    sent = 0
    if arrivals is not None:
        for j, t in enumerate(arrivals[:n]):
            push(events, (t, next(seq), 0, j))
        n = min(n, len(arrivals))
    else:
        for _ in range(min(concurrency or 1, n)):
            push(events, (0.0, next(seq), 0, sent))
            sent += 1
    busy, queue = 0, deque[int]()
    while events:
        t, _, kind, j = events[0]
        if kind:
            k = left[j]
            if k == outs[j]:
                first[j] = t
            left[j] = k - 1
            if k > 1:
                replace(events, (t + step[busy], next(seq), 1, j))
                continue
            pop(events)
            end[j] = t
            if queue:
                q = queue.popleft()
                push(events, (t + prefill[q], next(seq), 1, q))
            else:
                busy -= 1
            if concurrency is not None and sent < n:
                push(events, (t, next(seq), 0, sent))
                sent += 1
            continue
        pop(events)
        arrive[j] = t
        if busy < model.slots:
            busy += 1
            push(events, (t + prefill[j], next(seq), 1, j))
        else:
            queue.append(j)
    return [Timeline(arrive[j], first[j], end[j], outs[j]) for j in range(n)]


Job = tuple[int, int]  # (prompt tokens, output tokens)


def draw(jobs: Job | Sequence[Job], n: int, rng: np.random.Generator) -> list[Job]:
    """``n`` jobs in dispatch order: one job repeated, or each drawn at random from a mix of jobs (requests
    of different lengths, as a real workload sends them)."""
    if isinstance(jobs[0], int):
        return [jobs] * n  # type: ignore[list-item]
    mix = list(jobs)
    return [mix[i] for i in rng.integers(len(mix), size=n)]  # type: ignore[misc]


def latencies(timelines: Sequence[Timeline], metric: str) -> np.ndarray:
    values = [getattr(tl, metric) for tl in timelines]
    return np.asarray([v for v in values if v is not None], dtype=float)


def holds(model_timelines: Sequence[Timeline], slos: Sequence[Any]) -> bool:
    """Do the timelines meet every SLO? (:func:`loadgen.capacity.stats.check` with no allowance for sampling.)"""
    samples = Samples()
    for tl in model_timelines:
        samples.add(tl.ttft, tl.tpot, tl.e2e, False)
    return all(check(samples, s, 0.0).misses <= s.allowed * len(samples) for s in slos)


def true_capacity(
    model: ServiceModel, job: Job | Sequence[Job], slos: Sequence[Any], mode: str, process: str = "poisson",
    requests: int = 10000, seeds: int = 2, max_load: float = 4096, near: float | None = None,
) -> float:  # fmt: skip
    """The model's capacity under ``slos``: the highest concurrency (closed loop, steady state after a
    wave; one job: exact, a mix of jobs: over ``requests / 10`` of them) or the highest rate (open loop;
    Poisson: the exceedance over ``seeds`` × ``requests`` arrivals with common random numbers; constant:
    exact) at which every SLO holds. Rates to 0.2 %. ``near``: a guess of the load that saves simulations
    (the search still walks or widens until it holds)."""
    if mode == "concurrency":

        def holds_at(c: int) -> bool:
            n = max(requests // 10, 20 * c)
            return holds(simulate(model, draw(job, n + 2 * c, np.random.default_rng(0)), concurrency=c)[2 * c :], slos)

        c = max(1, int(near / 1.1)) if near else 1
        while c > 1 and not holds_at(c):  # the guess was high
            c -= 1
        while c <= max_load:
            if not holds_at(c):
                return float(c - 1)
            c += 1
        return math.inf
    unit = [np.random.default_rng(s).exponential(1.0, requests) for s in range(seeds)]
    if process == "constant":
        unit = [np.ones(requests)]

    def ok(rate: float) -> bool:
        warm = requests // 20
        return holds([tl for u in unit for tl in simulate(model, draw(job, requests, np.random.default_rng(0)), np.cumsum(u / rate).tolist())[warm:]],
                     slos)  # fmt: skip

    lo, hi = (near / 1.1, near * 1.1) if near else (1e-3, 1.0)
    while near and not ok(lo):
        lo, hi = lo / 1.1, lo
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > max_load:
            return math.inf
    while hi - lo > 2e-3 * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _samples(timeline: Sequence[Any], idx: np.ndarray, arrivals: np.ndarray) -> Samples:
    """The outcomes of the timeline's requests ``idx``, in arrival order."""
    samples = Samples()
    for x in (timeline[k] for k in idx[np.argsort(arrivals[idx], kind="stable")]):
        samples.add(x.ttft, x.tpot, x.e2e, False, x.arrival, x.end)
    return samples


class SimProber:
    """Probes the service model in virtual time: open loop with Poisson (or constant) arrivals, or closed
    loop; decisions are checked every ``tick`` virtual seconds, as the live prober does."""

    def __init__(
        self, model: Any, jobs: Job | Sequence[Job], slos: Sequence[SLO], seed: int = 0, process: str = "poisson",
        tick: float = 0.25,
    ) -> None:  # fmt: skip
        self.model, self.job, self.slos, self.seed, self.process = model, jobs, list(slos), seed, process
        self.tick = tick
        self.count = 0

    async def probe(self, mode: str, load: float, seq: Sequential | None, max_seconds: float, index: int,
                    phase: str) -> Probe:  # fmt: skip
        self.count += 1
        rng = np.random.default_rng([self.seed, self.count])
        cap, sends = probe_requests(seq, load)
        # as the live prober: a pilot is a closed loop in either mode, and its warm-up ends before its measured
        # requests start, so they start on an idle server
        closed = mode == "concurrency" or phase == "pilot"
        if closed:
            tl = simulate(self.model, draw(self.job, sends, rng), concurrency=int(load))
        else:
            n = int(max(cap * 1.2, load * max_seconds * 1.2)) + 10
            gaps = rng.exponential(1 / load, n) if self.process == "poisson" else np.full(n, 1 / load)
            tl = simulate(self.model, draw(self.job, n, rng), arrivals=np.cumsum(gaps).tolist())
        t0 = min(x.arrival for x in tl)
        arrivals = np.asarray([x.arrival - t0 for x in tl])
        ends = np.asarray([x.end - t0 for x in tl])
        judge = ProbeJudge(self.slos, seq, cap, load, closed, not closed and self.process != "constant")
        decision: Decision | None = None
        t = 0.0
        while decision is None:
            t += self.tick
            pending = (ends > t) & (arrivals <= t)
            s_cut = float(arrivals[pending].min()) if pending.any() else t
            idx = np.nonzero(arrivals < s_cut if pending.any() else arrivals <= t)[0]
            over = t >= max_seconds or idx.size >= len(tl)
            decision = judge.look(int(idx.size), partial(_samples, tl, idx, arrivals), over, t, int(pending.sum()))
        samples = judge.samples
        done = ends <= t
        span = float(ends[done].max() - arrivals[done].min()) if done.sum() > 1 else None
        return probe_result(index, phase, mode, load, samples, seq, self.slos, decision, t, span)


# --- the live server ---------------------------------------------------------------------------------


class _Slots:
    """The model's slots and FIFO queue on the event loop. A slot passes to the next in line at the model
    time its holder was due to end, not when the late timer fired, so timer lateness does not accumulate
    into the queue (the server stays on the model's time line)."""

    def __init__(self, n: int) -> None:
        self.n, self.busy = n, 0
        self.waiting: deque[asyncio.Future[float]] = deque()

    async def acquire(self, now: float) -> float:
        """Wait for a slot; returns the model time the slot was free from."""
        if self.busy < self.n:
            self.busy += 1
            return now
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot was handed over just now: pass it on
                self.release(fut.result())
            raise

    def release(self, at: float) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(at)  # the slot passes to the next in line; busy stays
                return
        self.busy -= 1


class _ModelConn(Conn):
    fast = False

    def __init__(self, model: ServiceModel, slots: _Slots) -> None:
        super().__init__(Behaviour())
        self.model, self.slots = model, slots

    async def _paced(self, stream: Stream, b: Behaviour) -> None:
        t = self.transport
        assert t is not None
        loop = asyncio.get_running_loop()
        t.write(self._head())
        due = await self.slots.acquire(loop.time())
        try:
            due += self.model.prefill(stream.prompt_tokens)
            for i in range(stream.n):
                if i:
                    due += self.model.step(self.slots.busy)
                while (delay := due - loop.time()) > 0:
                    await asyncio.sleep(delay)
                if t.is_closing():
                    return
                t.write(http_chunk(stream.event(i)))
        finally:
            self.slots.release(min(due, loop.time()))
        t.write(http_chunk(stream.tail()))
        t.write(b"0\r\n\r\n")
        self.busy = False
        self._done()
        self._next()


class ServiceModelProcess(NullServerProcess):
    """The service-model server in a child process; ``with ServiceModelProcess(ServiceModel()) as url: ...``."""

    module = "loadgen.testservers.servicemodel"

    def __init__(self, model: ServiceModel, host: str = "127.0.0.1") -> None:
        super().__init__(host)
        self.model = model

    def options(self) -> list[str]:
        return ["--model", json.dumps(asdict(self.model))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadgen.testservers.servicemodel", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8098)
    ap.add_argument("--model", default="{}", help="JSON object of ServiceModel fields")
    ap.add_argument("--slots", type=int, default=None, help="slots (overrides --model; for --server/--grid np=...)")
    args = ap.parse_args(argv)
    model = ServiceModel(**{**json.loads(args.model), **({"slots": args.slots} if args.slots else {})})
    slots = _Slots(model.slots)

    async def run() -> None:
        await serve(args.host, args.port, Behaviour(), protocol=lambda: _ModelConn(model, slots))

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())


if __name__ == "__main__":
    main()
