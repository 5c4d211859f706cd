"""The client's own ceiling on this machine, measured against the null server (``bench calibrate``; the command
and its tables are :mod:`loadgen.cli.calibrate`).

The null server runs in separate processes (their own event loops and cores; one per client worker
unless ``--servers`` says otherwise, each point checking that none was near a full core), so the figures are
what the client can drive: closed loop (req/s and events/s at a concurrency, achieved concurrency, per
worker count) and open loop (achieved vs requested rate, schedule lag), for one traffic: the prompt's length,
the output tokens (one per stream event) and the API (``--prompt-tokens``, ``--output-tokens``, ``--api``;
:attr:`NullTarget.traffic`). ``scripts/scale_check.py`` runs the same points (:class:`NullTarget`,
:func:`scaling`, :func:`open_loop`) at a many-core machine's scale.

The client-only micro-benchmark (:func:`stream_cost`, ``python -m loadgen.experiments.calibrate``) measures the same stream
on the same workload.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from backends.openai import OpenAIBackend
from loadgen.client.streamreader import StreamReader
from loadgen.dispatch.engine import PointOptions, run_point
from loadgen.dispatch.fleet import Fleet
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.records.writer import write_json
from loadgen.testservers.null import NullServerProcess
from loadgen.testservers.stream import Behaviour, Stream
from loadgen.timing.clock import RunClock
from workloads.base import ArrivalSpec, Session, SingleShot, Workload
from workloads.contracts import Api, GenRequest, RequestRecord
from workloads.text import PromptBuilder, builder_for

EVENTS = 200  # stream events per response (the null server's output tokens, one per event) by default


@dataclass
class FixedWorkload(Workload):
    """Identical requests (``extra_bodies`` cycle per request, e.g. null-server faults) on ``api``; for
    calibration and tests, where the prompt content does not matter. With ``prompt_tokens``, each request's
    prompt is instead its own text of that many tokens (the bundled tokenizer's), cut from the corpus as a
    synthetic workload cuts its prompts (:meth:`workloads.text.PromptBuilder.fill`)."""

    max_tokens: int = 16
    prompt: str = "Say something."
    cls: str = "fixed"
    extra_bodies: list[dict[str, Any]] = field(default_factory=lambda: [{}])
    name: str = "fixed"
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    prompt_tokens: int | None = None
    api: Api = "completions"
    builder: PromptBuilder | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # now, as a synthetic workload's: a missing tokenizer fails before any run starts, and the workers get
        # the builder (the corpus tokenized once) with the workload
        self.builder = builder_for() if self.prompt_tokens is not None else None

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = random.Random(seed)
        for i, extra in zip(itertools.count(), itertools.cycle(self.extra_bodies)):
            prompt, tokens = self._prompt(rng)
            yield SingleShot(GenRequest(f"r{i}", prompt, self.max_tokens, self.cls, self.api, tokens, extra_body=extra,
                                        seed=seed))  # fmt: skip

    def _prompt(self, rng: random.Random) -> tuple[str, int | None]:
        """The fixed prompt, or ``prompt_tokens`` of corpus text, with its tokens where known: a chat server
        adds its template's, so there the count is left to its usage (as with a synthetic workload)."""
        if self.builder is None or self.prompt_tokens is None:
            return self.prompt, None
        tokens = self.builder.fill_tokens(self.prompt_tokens) if self.api == "completions" else None
        return self.builder.fill(self.prompt_tokens, rng), tokens

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "max_tokens": self.max_tokens, "extra_bodies": self.extra_bodies,
                "prompt_tokens": self.prompt_tokens, "api": self.api}  # fmt: skip


async def calibrate(
    out_dir: Path, concurrency: int = 512, events: int = EVENTS, num_requests: int = 20000, rate: float = 300.0,
    duration: float = 30.0, client_kind: str = "aiohttp", workers: Sequence[int] = (1,), servers: int | None = None,
    prompt_tokens: int | None = None, api: Api = "completions",
) -> dict[str, Any]:  # fmt: skip
    """Run the closed-loop and the open-loop calibration points of one traffic (``prompt_tokens``-token
    prompts, default the short fixed one, on ``api``, ``events`` events each: :attr:`NullTarget.traffic`);
    returns {"traffic": ..., "closed": ..., "open": ...}.

    With several ``workers`` counts, the closed-loop point runs once per count (``--workers``) and
    ``scaling`` holds each count's ceiling, its scaling efficiency (req/s over ``n`` times the first
    count's per worker), the cores busy during it (client workers + null servers, of ``cores``) and the
    busiest null-server process (:func:`scaling`); the open-loop point runs with the first count. The null
    server runs as ``servers`` processes (default :func:`servers_for` the largest count)."""
    n_servers = servers or servers_for(max(workers))
    out: dict[str, Any] = {"load_average": os.getloadavg(), "client": client_kind, "cores": os.cpu_count() or 1,
                           "servers": n_servers}  # fmt: skip
    with NullTarget(events, client_kind, n_servers, prompt_tokens, api) as target:
        out["traffic"] = target.traffic
        rows = await scaling(target, out_dir, concurrency, num_requests, workers)
        out["closed"] = rows[0]
        if len(workers) > 1:
            out["scaling"] = rows
        out["open"] = await open_loop(target, out_dir / "open", rate, duration, workers[0])
    write_json(out_dir / "calibrate.json", out)
    return out


CORES_BUSY = 0.85  # client workers + null server using more than this share of the machine's cores: its limit
SERVER_BUSY = 0.5  # a null-server process busier than this share of one core may be what limits the client
SERVER_NICE = 10  # the null servers' nice value: a client worker woken for a send is not queued behind one


def servers_for(workers: int) -> int:
    """Null-server processes for ``workers`` client workers by default: one each. A null server spends about
    a fifth of the client's CPU per 200-event request (0.10-0.11 ms, docs/performance.md), so one per worker
    stays near a fifth of a core at full client speed, with room under :data:`SERVER_BUSY`
    for the kernel's uneven deal of connections (one per two would sit at the threshold); each point checks
    it (``servers_limit``). An idle server costs nothing."""
    return workers


class NullTarget:
    """The null server as a calibration target (``with NullTarget(events, client, servers) as t:``): its
    ``servers`` processes (:class:`NullServerProcess`), the backend and workload that stream ``events``
    events per request from it (one output token each) for prompts of ``prompt_tokens`` tokens (default:
    :class:`FixedWorkload`'s short fixed prompt) on ``api``, one run clock, and a CPU meter per server process."""

    def __init__(self, events: int, client_kind: str, servers: int, prompt_tokens: int | None = None,
                 api: Api = "completions") -> None:  # fmt: skip
        self.events, self.client_kind = events, client_kind
        self.srv = NullServerProcess(processes=servers)
        self.workload = FixedWorkload(max_tokens=events, prompt_tokens=prompt_tokens, api=api)
        self.clock = RunClock()

    @property
    def traffic(self) -> dict[str, Any]:
        """Which traffic the points measure: ``api``, ``prompt_tokens`` (None: the short fixed prompt) and
        ``events`` per response (= output tokens)."""
        return {"api": self.workload.api, "prompt_tokens": self.workload.prompt_tokens, "events": self.events}

    def __enter__(self) -> NullTarget:
        try:
            self.backend = OpenAIBackend(self.srv.start(), model="null")
            self.cpu = [_Cpu(pid) for pid in self.srv.pids()]
            for pid in self.srv.pids():  # the rig yields to the client it measures when they share a core
                os.setpriority(os.PRIO_PROCESS, pid, SERVER_NICE)
        except BaseException:
            self.srv.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.srv.stop()

    async def point(self, load: LoadSpec, out_dir: Path, workers: int) -> dict[str, Any]:
        """One point against the null server; its brief (:func:`_brief`) with the server processes' CPU
        (``server_cpu``: all of them, in cores; ``server_cpu_max``: the busiest, and ``servers_limit``
        when it is above :data:`SERVER_BUSY`) and the cores busy (client workers + servers), all over the
        workers' load phases (``load_s``: warm-up and measured; not their start-up or the records' merge,
        which the point's whole wall time ``point_s`` includes)."""
        for c in self.cpu:
            c.reset()
        t0 = time.perf_counter()
        s = await run_point(self.backend, self.workload, load, out_dir, self.clock,
                            options=PointOptions(client_kind=self.client_kind, fleet=Fleet(workers)))  # fmt: skip
        point_s = time.perf_counter() - t0
        wall = max((w["wall_s"] for w in s["workers"]["per_worker"] if w.get("wall_s")), default=point_s)
        shares = [c.seconds() / wall for c in self.cpu]
        busy = s["workers"]["cpu_s"] / wall + sum(shares)
        return {"workers": workers, **_brief(s, self.events), "server_cpu": sum(shares), "server_cpu_max": max(shares),
                "servers_limit": max(shares) > SERVER_BUSY, "cores_busy": busy, "load_s": wall, "point_s": point_s}  # fmt: skip


async def scaling(
    target: NullTarget, out_dir: Path, concurrency: int, num_requests: int | None, workers: Sequence[int],
    max_s: float | None = None, until: float | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The closed-loop ceiling once per worker count (the first into ``out_dir/closed``, the others into
    ``closed-w<n>``), each row with its scaling efficiency (req/s over ``n`` times the first count's per
    worker) and ``cores_limit`` (the machine's cores, not the client or the server, set the limit). A point
    ends after ``num_requests`` or ``max_s`` seconds, whichever comes first; no count starts after the
    ``time.monotonic()`` instant ``until`` (the rows are those of the counts that ran)."""
    closed = LoadSpec("closed", concurrency=concurrency, num_requests=num_requests, duration=max_s, warmup=concurrency)
    cores = os.cpu_count() or 1
    rows = []
    for n in workers:
        if until is not None and time.monotonic() >= until:
            break
        rows.append(await target.point(closed, out_dir / ("closed" if n == workers[0] else f"closed-w{n}"), n))
    base = rows[0]["req_per_s"] / workers[0] if rows and rows[0]["req_per_s"] else None
    for row in rows:
        row["efficiency"] = row["req_per_s"] / (row["workers"] * base) if base and row["req_per_s"] else None
        row["cores_limit"] = row["workers"] + 1 > cores or row["cores_busy"] > CORES_BUSY * cores
    return rows


async def open_loop(target: NullTarget, out_dir: Path, rate: float, duration: float, workers: int) -> dict[str, Any]:
    """The open-loop point: Poisson arrivals at ``rate`` for ``duration`` s (after a second of warm-up
    arrivals) over ``workers`` workers; achieved vs requested rate and the schedule lag."""
    load = LoadSpec("poisson", rate=rate, duration=duration, warmup=int(rate), seed=1)
    return await target.point(load, out_dir, workers)


class _Cpu:
    """CPU seconds of another (single-threaded) process since ``reset``: its main thread's time on a CPU, in
    nanoseconds (Linux schedstat), not clock ticks, so that a short point's few milliseconds count. A process
    that cannot be read (gone, no schedstat) raises ``OSError``: a server's CPU is never guessed as 0."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reset()

    def _read(self) -> float:
        return int(Path(f"/proc/{self.pid}/schedstat").read_text().split()[0]) / 1e9

    def reset(self) -> None:
        self.cpu = self._read()

    def seconds(self) -> float:
        return self._read() - self.cpu


def _brief(s: dict[str, Any], events: int) -> dict[str, Any]:
    thr, cl = s["throughput"]["steady"], s["client"]
    lag = cl["schedule_lag"]
    return {
        "requests": s["counts"]["requests"], "errors": s["counts"]["errors"],
        "req_per_s": thr["req_per_s"], "events_per_s": (thr["req_per_s"] or 0) * events,
        "achieved_concurrency": cl["achieved_concurrency"], "requested_concurrency": cl["requested_concurrency"],
        "achieved_rate": cl["achieved_rate"], "scheduled_rate": cl["scheduled_rate"], "requested_rate": cl["requested_rate"],
        "lag_p50_ms": lag["p50"] * 1e3 if lag["p50"] is not None else None,
        "lag_p99_ms": lag["p99"] * 1e3 if lag["p99"] is not None else None,
        "client_cpu": cl["cpu"], "client_cpu_wait": cl["cpu_wait"], "warnings": cl["warnings"],
        # CPU time the client (all its workers) spent per request: one free core's ceiling is 1 / this
        "cpu_ms_per_request": s["workers"]["cpu_s"] / max(s["counts"]["requests"] + s["counts"]["warmup"], 1) * 1e3,
    }  # fmt: skip


def stream_cost(events: int = EVENTS, read_size: int = 16384, repeat: int = 2000) -> float:
    """Client CPU seconds to turn one null-server response of ``events`` events, read ``read_size``
    bytes at a time, into its finished record line: the client's per-event work without the network
    (``python -m loadgen.experiments.calibrate``). Best of 5 rounds of ``repeat`` requests."""
    body = {"prompt": "Say something.", "max_tokens": events, "stream_options": {"include_usage": True}}
    stream = Stream(body, Behaviour())
    raw = b"".join(map(stream.event, range(stream.n))) + stream.tail()
    chunks = [raw[i : i + read_size] for i in range(0, len(raw), read_size)]
    backend, clock, req = OpenAIBackend("http://127.0.0.1", model="null"), RunClock(), GenRequest("r", "x", events)

    def one() -> RequestRecord:
        rec = RequestRecord(id="r")
        reader = StreamReader(backend, rec, clock)
        for chunk in chunks:
            if reader.feed(chunk, clock.now()):
                break
        else:
            reader.close(clock.now())
        reader.finish(req)
        orjson.dumps(rec.to_dict(), option=orjson.OPT_APPEND_NEWLINE)
        if rec.error is not None or len(rec.events) != events:
            raise RuntimeError(f"null stream misread: {rec.error}, {len(rec.events)} events")
        return rec

    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(repeat):
            one()
        best = min(best, (time.process_time() - t) / repeat)
    return best


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m loadgen.experiments.calibrate", description=stream_cost.__doc__)
    ap.add_argument("--events", type=int, default=EVENTS)
    ap.add_argument("--read-size", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=2000)
    a = ap.parse_args()
    sec = stream_cost(a.events, a.read_size, a.repeat)
    print(f"{sec * 1e6:.0f} us CPU per {a.events}-event response ({sec * 1e6 / a.events:.2f} us per event)")
