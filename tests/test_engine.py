"""The dispatcher and client against the real null/fault server on loopback."""

import asyncio
import dataclasses
import gc
import json
from dataclasses import dataclass, field

import pytest

from backends.launcher import free_port
from backends.openai import OpenAIBackend
from loadgen import metrics
from loadgen.calibrate import FixedWorkload
from loadgen.client import execute, make_client
from loadgen.clock import RunClock
from loadgen.engine import LoadSpec, run_point
from workloads.base import ArrivalSpec, Session, SingleShot, Workload
from workloads.contracts import GenRequest, RequestRecord, read_jsonl


def ns(**kw):
    return {"nullserver": kw}


async def point(url, tmp_path, load, wl=None, backend=None, **kw):
    backend = backend or OpenAIBackend(url, model="null")
    s = await run_point(backend, wl or FixedWorkload(max_tokens=8), load, tmp_path / "p", RunClock(), **kw)
    return s, read_jsonl(tmp_path / "p" / "requests.jsonl")


FAULTS = [
    (ns(), None),
    (ns(fault="500"), "http_5xx"),
    (ns(fault="429"), "http_429"),
    (ns(fault="html"), "protocol"),
    (ns(fault="garbage", fault_after=2), "protocol"),
    (ns(fault="bad_json", fault_after=2), "protocol"),
    (ns(fault="error_event", fault_after=1), "stream_error"),
    (ns(fault="error_payload", fault_after=1), "stream_error"),
    (ns(fault="disconnect", fault_after=3), "disconnect"),
    (ns(fault="no_done"), "truncated"),
    (ns(fault="cut", fault_after=4), "truncated"),
    (ns(fault="stall", fault_after=2), "stall"),
    (ns(fault="hang"), "timeout"),
    (ns(ttft=0.05, itl=0.005), None),
]


async def test_every_fault_is_recorded_with_its_kind_and_the_run_completes(null_server, tmp_path):
    wl = FixedWorkload(max_tokens=8, extra_bodies=[b for b, _ in FAULTS])
    load = LoadSpec("closed", concurrency=4, num_requests=2 * len(FAULTS), stall_timeout=0.5)
    s, recs = await point(null_server, tmp_path, load, wl)
    assert len(recs) == 2 * len(FAULTS)
    by_id = {r["id"]: r for r in recs}
    for i in range(2 * len(FAULTS)):
        r = by_id[f"r{i}"]
        expected = FAULTS[i % len(FAULTS)][1]
        assert (r["error"] or {}).get("kind") == expected, (i, r["error"])
        if expected is None:
            assert r["output_tokens"] == 8 and r["output_tokens_source"] == "usage" and len(r["events"]) == 8
    assert s["counts"]["errors"] == 2 * (len(FAULTS) - 2)
    assert s["errors"]["by_kind"]["truncated"] == 4
    partial = next(r for r in recs if r["id"] == "r8")  # disconnect after 3 events keeps those events
    assert len(partial["events"]) == 3 and partial["status"] == 200
    assert "injected server error" in by_id["r1"]["error"]["message"]


async def test_connection_refused_is_a_connect_error_and_aborts_the_point(tmp_path):
    """Nobody listening: the first request is a connect error, the health probes confirm it, and the
    point stops there (aborted) instead of spinning through the other requests as instant errors."""
    url = f"http://127.0.0.1:{free_port()}"
    s, recs = await point(url, tmp_path, LoadSpec("closed", concurrency=2, num_requests=50))
    assert [r["error"]["kind"] for r in recs] == ["connect", "connect"]
    assert recs[0]["status"] is None and recs[0]["retries"] == 0  # a fresh connection is never retried
    assert s["status"] == "aborted" and "stopped accepting connections" in s["aborted"]["reason"]


@pytest.mark.parametrize("continuous", [True, False])
async def test_multi_token_chunks(null_server, tmp_path, continuous):
    backend = OpenAIBackend(null_server, model="null", continuous_usage=continuous)
    wl = FixedWorkload(max_tokens=12, extra_bodies=[ns(tokens_per_event=3, itl=0.002)])
    s, recs = await point(null_server, tmp_path, LoadSpec(num_requests=3), wl, backend)
    for r in recs:
        assert [k for _, k in r["events"]] == [3, 3, 3, 3]
        assert r["output_tokens"] == 12 and r["output_tokens_source"] == "usage"
        assert r["event_tokens"] == ("stated" if continuous else "spread")
    # events of one socket read are merged into one read (on a busy machine two 2 ms-apart events can be)
    reads = [metrics.reads(r) for r in recs]
    assert s["latency"]["itl"]["count"] == sum(12 - int(k[0]) for _, k in reads)  # 3 x 9 when none merged
    assert s["latency"]["chunk_gap"]["count"] == sum(len(t) - 1 for t, _ in reads)  # 3 x 3 when none merged


async def test_chat_api_and_prompt_tokens(null_server, tmp_path):
    backend = OpenAIBackend(null_server, model="null", api="chat")
    s, recs = await point(null_server, tmp_path, LoadSpec(num_requests=2), FixedWorkload(max_tokens=5, prompt="a b c"),
                          backend)
    assert all(r["error"] is None and r["output_tokens"] == 5 for r in recs)
    assert recs[0]["prompt_tokens"] == 3 and recs[0]["prompt_tokens_source"] == "usage"


async def test_closed_loop_warmup_and_count(null_server, tmp_path):
    load = LoadSpec("closed", concurrency=3, num_requests=10, warmup=4)
    s, recs = await point(null_server, tmp_path, load)
    assert len(recs) == 14 and sum(r["warmup"] for r in recs) == 4
    assert s["counts"]["requests"] == 10 and s["counts"]["warmup"] == 4
    assert all(0 <= r["sent"] - r["intended"] < 0.5 for r in recs)  # closed loop: sent when the slot freed
    # isolated: every warm-up ends before the first measured send (vLLM bench serve, AIPerf)
    warm, measured = [r for r in recs if r["warmup"]], [r for r in recs if not r["warmup"]]
    assert max(r["end"] for r in warm) <= min(r["sent"] for r in measured) == pytest.approx(s["t_measured"], abs=0.05)
    assert s["errors"]["rate"] == 0


@pytest.mark.parametrize("process", ["constant", "poisson"])
async def test_open_loop_warmups_end_before_the_measured_schedule_starts(null_server, tmp_path, process):
    wl = FixedWorkload(max_tokens=20, extra_bodies=[ns(itl=0.01)])  # 0.2 s responses at 50 req/s: overlapping
    load = LoadSpec(process, rate=50.0, num_requests=10, warmup=5)
    s, recs = await point(null_server, tmp_path, load, wl)
    warm, measured = [r for r in recs if r["warmup"]], [r for r in recs if not r["warmup"]]
    assert len(warm) == 5 and len(measured) == 10 and s["counts"]["errors"] == 0
    assert max(r["end"] for r in warm) <= min(r["intended"] for r in measured)
    assert min(r["intended"] for r in measured) - s["t_measured"] < 0.2  # a fresh schedule from the phase's start


async def test_open_loop_constant_schedule(null_server, tmp_path):
    load = LoadSpec("constant", rate=100.0, num_requests=30)
    s, recs = await point(null_server, tmp_path, load)
    intended = sorted(r["intended"] for r in recs)
    gaps = [b - a for a, b in zip(intended, intended[1:], strict=False)]
    assert gaps == pytest.approx([0.01] * 29, abs=1e-9)
    assert all(r["sent"] >= r["intended"] for r in recs)
    assert s["client"]["schedule_lag"]["p50"] < 0.1  # loose: timing precision is measured by bench calibrate
    assert s["client"]["scheduled_rate"] == pytest.approx(100.0)


def test_open_loop_never_sends_early_under_uvloop(null_server, tmp_path):
    """uvloop timers wake up to ~1 ms early; every request must still go out at or after its intended time."""
    from loadgen.engine import run_async

    load = LoadSpec("poisson", rate=400.0, num_requests=200, seed=3)
    run_async(run_point(OpenAIBackend(null_server, model="null"), FixedWorkload(max_tokens=2), load,
                        tmp_path / "p", RunClock()))
    recs = read_jsonl(tmp_path / "p" / "requests.jsonl")
    assert len(recs) == 200
    early = [r["intended"] - r["sent"] for r in recs if r["sent"] < r["intended"]]
    assert early == []


@pytest.mark.parametrize("continuous", [False, True])
async def test_usage_on_the_finish_chunk_is_the_final_total(null_server, tmp_path, continuous):
    """llama.cpp puts the final usage on the finish_reason chunk: counted once, not as a per-chunk delta."""
    wl = FixedWorkload(max_tokens=12, extra_bodies=[ns(usage_on_finish=True, tokens_per_event=3)])
    backend = OpenAIBackend(null_server, model="null", continuous_usage=continuous)
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=2, num_requests=4), wl, backend)
    assert s["counts"]["errors"] == 0
    for r in recs:
        assert r["output_tokens"] == 12
        assert r["output_tokens_source"] == ("chunk_usage" if continuous else "usage")
        assert [k for _, k in r["events"]] == [3, 3, 3, 3]
    assert s["counts"]["output_tokens"] == 48


async def test_spec_decode_counts_reach_the_record_and_the_point(null_server, tmp_path):
    wl = FixedWorkload(max_tokens=8, extra_bodies=[ns(spec_decode=[10, 4]), ns(spec_decode=[6, 5]), ns()])
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=1, num_requests=3), wl)
    by_id = {r["id"]: r for r in recs}
    assert by_id["r0"]["extra"]["spec_decode"] == {"drafted": 10, "accepted": 4}
    assert "spec_decode" not in by_id["r2"]["extra"]
    assert s["spec_decode"] == {"requests": 2, "drafted": 16, "accepted": 9, "acceptance": pytest.approx(9 / 16)}


async def test_poisson_schedule_is_seeded(null_server, tmp_path):
    runs = []
    for i, seed in enumerate((7, 7, 8)):
        load = LoadSpec("poisson", rate=200.0, num_requests=20, seed=seed)
        s = await run_point(OpenAIBackend(null_server, model="null"), FixedWorkload(), load, tmp_path / str(i),
                            RunClock())
        recs = read_jsonl(tmp_path / str(i) / "requests.jsonl")
        runs.append(sorted(round(r["intended"] - s["t_measured"], 9) for r in recs))
    assert runs[0] == runs[1] != runs[2]


async def test_duration_stops_dispatch_and_cancels_the_rest(null_server, tmp_path):
    wl = FixedWorkload(max_tokens=1000, extra_bodies=[ns(itl=0.01)])  # 10 s responses
    load = LoadSpec("closed", concurrency=2, duration=0.4, drain=0.2)
    s, recs = await point(null_server, tmp_path, load, wl)
    assert len(recs) == 2
    assert all(r["error"]["kind"] == "cancelled" and 0 < len(r["events"]) < 1000 for r in recs)
    assert s["t_end"] - s["t_start"] < 3


@dataclass
class _Trace(Workload):
    ats: list = field(default_factory=list)
    name: str = "trace"
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)

    def sessions(self, seed):
        for i, at in enumerate(self.ats):
            yield SingleShot(GenRequest(f"t{i}", "x", 2), at=at)


async def test_trace_replay_honours_at_and_speedup(null_server, tmp_path):
    ats = [0.0, 0.05, 0.06, 0.2, 0.3]
    s, recs = await point(null_server, tmp_path, LoadSpec("trace", speedup=2.0), _Trace(ats=ats))
    got = sorted(r["intended"] - s["t_measured"] for r in recs)
    assert got == pytest.approx([a / 2 for a in ats])
    assert all(r["sent"] >= r["intended"] for r in recs) and s["client"]["schedule_lag"]["p50"] < 0.1


class _Chat(Session):
    cls = "multi"

    def __init__(self, i):
        self.i, self.seen = i, []

    def first(self):
        return GenRequest(f"m{self.i}-0", "hello", 3, "multi")

    def next(self, response_text):
        self.seen.append(response_text)
        if len(self.seen) == 3:
            return None
        return 0.05, GenRequest(f"m{self.i}-{len(self.seen)}", "again", 3, "multi")


@dataclass
class _MultiTurn(Workload):
    made: list = field(default_factory=list)
    name: str = "multi"
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)

    def sessions(self, seed):
        for i in range(2):
            self.made.append(_Chat(i))
            yield self.made[-1]


async def test_multi_turn_sessions_get_responses_and_think_time(null_server, tmp_path):
    wl = _MultiTurn()
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=2, num_requests=100), wl)
    assert len(recs) == 6
    assert all(sess.seen == [" tok" * 3] * 3 for sess in wl.made)
    by_id = {r["id"]: r for r in recs}
    for i in range(2):
        for t in (1, 2):
            prev, cur = by_id[f"m{i}-{t - 1}"], by_id[f"m{i}-{t}"]
            assert cur["intended"] == pytest.approx(prev["end"] + 0.05)
            assert cur["sent"] >= cur["intended"] and cur["turn"] == t and cur["session"] == prev["session"]


class _Sidecar:
    name = "probe"

    def __init__(self):
        self.calls = []

    def start(self, clock, point_dir):
        self.calls.append(("start", point_dir))

    def stop(self, window):
        self.calls.append(("stop", window))
        return {"samples": 3}


async def test_sidecars_start_before_and_stop_after(null_server, tmp_path):
    sc = _Sidecar()
    s, _ = await point(null_server, tmp_path, LoadSpec(num_requests=2), sidecars=[sc])
    assert [c[0] for c in sc.calls] == ["start", "stop"]
    assert s["probe"] == {"samples": 3}
    assert json.loads((tmp_path / "p" / "summary.json").read_text())["probe"] == {"samples": 3}


def test_load_spec_rejects_unbounded_or_bad_input():
    with pytest.raises(ValueError, match="bound"):
        LoadSpec("closed", concurrency=1)
    with pytest.raises(ValueError, match="rate"):
        LoadSpec("poisson", num_requests=1)
    with pytest.raises(ValueError, match="unknown arrival"):
        LoadSpec("bursty", num_requests=1)
    assert LoadSpec("closed", concurrency=16, num_requests=1).point_id() == "c016"
    assert LoadSpec("poisson", rate=12.5, num_requests=1).point_id() == "r012.5"


async def test_a_stream_held_open_after_done_is_complete_not_a_stall(null_server, tmp_path):
    """Reading stops at [DONE]: a server (or proxy) that keeps the finished stream open costs at most
    DONE_GRACE_S, never a stall error, and the answer's latency ends at its last token."""
    from loadgen.client import DONE_GRACE_S

    wl = FixedWorkload(max_tokens=8, extra_bodies=[ns(fault="linger", itl=0.005)])
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=2, num_requests=4, stall_timeout=5), wl)
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] == 4
    for r in recs:
        assert r["output_tokens"] == 8 and r["end"] - r["events"][-1][0] < DONE_GRACE_S + 1.0
    assert s["latency"]["e2e"]["max"] < 1.0 and s["latency"]["tail"]["max"] < DONE_GRACE_S + 1.0


async def test_a_successful_request_leaves_no_cyclic_garbage(null_server):
    """Objects in reference cycles wait for the cyclic GC, whose passes over them paused the loop for 5-6 ms
    every ~600 requests (docs/performance.md): a plain streamed request must be freed by reference counts."""

    client, backend, clock = make_client(), OpenAIBackend(null_server, model="null"), RunClock()

    async def one(i: int) -> RequestRecord:
        rec = RequestRecord(id=f"r{i}")
        await execute(client, backend, GenRequest(f"r{i}", "Say something.", 50), rec, clock)
        return rec

    for i in range(5):  # the pool's connections and first-use caches
        await one(i)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        recs = await asyncio.gather(*(one(i) for i in range(20)))
        recs += [await one(i) for i in range(20)]
        gc.collect()
        garbage = [type(o).__qualname__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await client.aclose()
    assert [r.error for r in recs] == [None] * 40 and all(len(r.events) == 50 for r in recs)
    assert garbage == []


@dataclass
class SlowlyBuilt(FixedWorkload):
    """Each first request takes ``build_s`` to build (a sleep: the GIL is free meanwhile, as in the
    tokenizer's native code)."""

    build_s: float = 0.03

    def sessions(self, seed: int):
        for sess in super().sessions(seed):
            yield SlowSession(sess, self.build_s)


@dataclass
class SlowSession(Session):
    inner: Session = field(default=None)  # type: ignore[assignment]
    build_s: float = 0.0

    def __init__(self, inner: Session, build_s: float) -> None:
        self.inner, self.build_s = inner, build_s

    @property
    def cls(self) -> str:  # type: ignore[override]
        return self.inner.cls

    def first(self) -> GenRequest:
        import time

        time.sleep(self.build_s)
        return self.inner.first()


async def test_building_prompts_does_not_delay_sends_or_reads(null_server, tmp_path):
    """Prompts are built ahead on a thread: a workload that takes 30 ms to build each request, sent at
    20/s (60 % of the builder's pace) with 10 ms between a stream's events, keeps its schedule and its
    TTFT; built on the event loop, every build held up the sends and the reads behind it for 30 ms."""
    wl = SlowlyBuilt(max_tokens=4, extra_bodies=[ns(itl=0.01)])
    load = LoadSpec("constant", rate=20.0, num_requests=90, seed=1)
    s, recs = await point(null_server, tmp_path, load, wl)
    measured = [r for r in recs if not r["warmup"]]
    assert s["counts"]["errors"] == 0 and len(measured) == 90
    # on the loop, builds would hold it 60 % of the time: most sends and first reads late by up to 30 ms
    lag = sorted(r["sent"] - r["intended"] for r in measured)
    assert lag[80] < 0.01, lag[75:]  # 9 sends in 10 within 10 ms of their time
    ttft = sorted(r["events"][0][0] - r["sent"] for r in measured)
    assert ttft[80] < 0.015, ttft[75:]  # the null server's first event comes at once


class SlowTurns(FixedWorkload):
    """Three-turn sessions whose later turns take ``build_s`` each to build (as a long conversation's
    transcript takes to count), a sleep: the GIL is free meanwhile."""

    build_s: float = 0.03

    def sessions(self, seed: int):
        for sess in super().sessions(seed):
            yield ThreeTurns(sess.first(), self.build_s)


class ThreeTurns(Session):
    def __init__(self, req: GenRequest, build_s: float) -> None:
        self.req, self.build_s, self.turn = req, build_s, 0

    @property
    def cls(self) -> str:  # type: ignore[override]
        return self.req.workload_class

    def first(self) -> GenRequest:
        return self.req

    def next(self, response_text: str):
        import time

        if self.turn == 2:
            return None
        self.turn += 1
        time.sleep(self.build_s)
        return 0.0, dataclasses.replace(self.req, request_id=f"{self.req.request_id}.{self.turn}")


async def test_building_later_turns_does_not_delay_sends_or_reads(null_server, tmp_path):
    """A conversation's later turns are built off the loop too: with 20 turns/s taking 30 ms each to build
    (60 % of one thread), new sessions still start on schedule and every stream's first event is read at
    once; built on the loop, each build held up the sends and reads behind it for 30 ms."""
    wl = SlowTurns(max_tokens=4, extra_bodies=[ns(itl=0.01)])
    load = LoadSpec("constant", rate=10.0, num_requests=120, seed=1)  # requests: turns included
    s, recs = await point(null_server, tmp_path, load, wl)
    measured = [r for r in recs if not r["warmup"]]
    assert s["counts"]["errors"] == 0 and len(measured) == 120
    firsts = sorted(r["sent"] - r["intended"] for r in measured if r["turn"] == 0)
    assert len(firsts) >= 40 and sum(r["turn"] == 2 for r in measured) >= 35  # the later turns were built
    assert firsts[int(0.9 * len(firsts))] < 0.01, firsts[30:]  # 9 in 10 new sessions sent within 10 ms
    ttft = sorted(r["events"][0][0] - r["sent"] for r in measured)
    assert ttft[108] < 0.015, ttft[100:]


async def test_a_client_that_cannot_keep_up_marks_the_point(null_server, tmp_path):
    """20,000 arrivals/s is beyond one client process (~2,000/s here): the sends fall behind, and the point
    says so in its summary and in the results table, so that its latencies are not read as the server's."""
    from rich.console import Console

    from loadgen.run_cli import summary_table

    load = LoadSpec("poisson", rate=20_000.0, duration=0.5, drain=5.0, seed=2)
    s, recs = await point(null_server, tmp_path, load, FixedWorkload(max_tokens=2))
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] > 100
    c = s["client"]
    assert c["limited"] and any("achieved" in w or "lag" in w for w in c["warnings"]), c["warnings"]
    console = Console(width=300, record=True)
    console.print(summary_table([s]))
    assert f"{s['point_id']} !" in console.export_text()


async def test_a_thinking_models_reasoning_is_timed_and_counted_apart(null_server, tmp_path):
    """A chat stream whose first 3 of 8 events are reasoning: TTFT is the first token of any kind, TTFO the
    first of the answer (3 events of 10 ms later), 3 reasoning tokens a request, TPOT over all 8 tokens."""
    wl = FixedWorkload(max_tokens=8, api="chat", extra_bodies=[ns(reasoning=3, itl=0.01)])
    s, recs = await point(null_server, tmp_path, LoadSpec("closed", concurrency=2, num_requests=6), wl)
    assert s["counts"]["errors"] == 0 and len(recs) == 6
    assert all(r["first_output"] == 3 and len(r["events"]) == 8 for r in recs)
    assert s["counts"]["reasoning_tokens"] == 18 and s["counts"]["output_tokens"] == 48
    gap = s["latency"]["ttfo"]["p50"] - s["latency"]["ttft"]["p50"]
    assert 0.025 < gap < 0.1, gap
    assert 0.008 < s["latency"]["tpot"]["p50"] < 0.03
    from loadgen.run_cli import notes

    assert any("18 reasoning tokens (38% of the output)" in line for line in notes(s))
    plain, recs = await point(null_server, tmp_path / "plain", LoadSpec("closed", concurrency=2, num_requests=4),
                              FixedWorkload(max_tokens=8, api="chat"))  # fmt: skip
    assert all(r["first_output"] == 0 for r in recs) and plain["counts"]["reasoning_tokens"] == 0
    assert plain["latency"]["ttfo"]["p50"] == plain["latency"]["ttft"]["p50"]
