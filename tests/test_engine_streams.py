"""The dispatcher and client against the real null/fault server on loopback: what each request's stream
records (faults, token counts, chat, reasoning) and what it leaves behind."""

import asyncio
import gc

import pytest
from support.points import ns, point

from backends.launcher import free_port
from backends.openai import OpenAIBackend
from loadgen.client.http import execute, make_client
from loadgen.dispatch.loadspec import LoadSpec
from loadgen.experiments.calibrate import FixedWorkload
from loadgen.metrics import definitions as metrics
from loadgen.timing.clock import RunClock
from workloads.contracts import GenRequest, RequestRecord

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


async def test_a_stream_held_open_after_done_is_complete_not_a_stall(null_server, tmp_path):
    """Reading stops at [DONE]: a server (or proxy) that keeps the finished stream open costs at most
    DONE_GRACE_S, never a stall error, and the answer's latency ends at its last token."""
    from loadgen.client.http import DONE_GRACE_S

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
    from loadgen.cli.run import notes

    assert any("18 reasoning tokens (38% of the output)" in line for line in notes(s))
    plain, recs = await point(null_server, tmp_path / "plain", LoadSpec("closed", concurrency=2, num_requests=4),
                              FixedWorkload(max_tokens=8, api="chat"))  # fmt: skip
    assert all(r["first_output"] == 0 for r in recs) and plain["counts"]["reasoning_tokens"] == 0
    assert plain["latency"]["ttfo"]["p50"] == plain["latency"]["ttft"]["p50"]
