"""The dispatcher against the real null server on loopback: the load's shape (warm-up, closed and open loop,
schedules, bounds, trace replay, multi-turn sessions, sidecars) and sends kept on time."""

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
from support.points import ns, point

from backends.openai import OpenAIBackend
from loadgen.dispatch.engine import run_point
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.timing.clock import RunClock
from workloads.base import ArrivalSpec, Session, SingleShot, Workload
from workloads.contracts import GenRequest, read_jsonl


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
    from loadgen.dispatch.signals import run_async

    load = LoadSpec("poisson", rate=400.0, num_requests=200, seed=3)
    run_async(run_point(OpenAIBackend(null_server, model="null"), FixedWorkload(max_tokens=2), load,
                        tmp_path / "p", RunClock()))
    recs = read_jsonl(tmp_path / "p" / "requests.jsonl")
    assert len(recs) == 200
    early = [r["intended"] - r["sent"] for r in recs if r["sent"] < r["intended"]]
    assert early == []


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

    from loadgen.cli.run import summary_table

    load = LoadSpec("poisson", rate=20_000.0, duration=0.5, drain=5.0, seed=2)
    s, recs = await point(null_server, tmp_path, load, FixedWorkload(max_tokens=2))
    assert s["counts"]["errors"] == 0 and s["counts"]["ok"] > 100
    c = s["client"]
    assert c["limited"] and any("achieved" in w or "lag" in w for w in c["warnings"]), c["warnings"]
    console = Console(width=300, record=True)
    console.print(summary_table([s]))
    assert f"{s['point_id']} !" in console.export_text()
