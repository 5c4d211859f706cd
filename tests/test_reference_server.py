"""Reference server over real HTTP: OpenAI shapes, streaming, errors, 429, aborts free KV blocks."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.model_files import default_model_path


@pytest.fixture(scope="module")
def server(live_server):
    cfg = EngineConfig(model=default_model_path(), num_kv_blocks=256, max_waiting=4, threads=1)
    with live_server(Engine.on_own_thread(cfg)) as running:  # as `python -m reference_server` builds it
        yield running


def test_engine_steps_on_the_thread_that_built_it(server):
    """All torch work of a served engine runs on one thread (one OpenMP team: see Engine.on_own_thread)."""
    seen: set[int] = set()
    server.engine.on_iteration.append(lambda _rec: seen.add(threading.get_ident()))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    finally:
        server.engine.on_iteration.pop()
    thread = server.engine._thread
    assert thread is not None and thread.name == "engine"
    assert seen == {thread.ident} and thread.ident != threading.get_ident()


def test_engine_on_own_thread_errors_and_early_stop():
    with pytest.raises(ValueError, match="policy"):  # raised on the engine's thread, re-raised here
        Engine.on_own_thread(EngineConfig(model=default_model_path(), num_kv_blocks=16, threads=1, policy="nope"))
    engine = Engine.on_own_thread(EngineConfig(model=default_model_path(), num_kv_blocks=16, threads=1))
    assert engine._thread is not None and engine._thread.is_alive()
    engine.stop()  # never started: its thread must still exit
    assert not engine._thread.is_alive()


def wait_idle(engine: Engine, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work() or engine.num_waiting():
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.05)


def test_completion_and_models(server):
    r = httpx.get(server.url + "/v1/models")
    assert r.json()["data"][0]["id"] == "smol"
    r = httpx.post(server.url + "/v1/completions", json={"model": "smol", "prompt": "The capital of France is",
                                                         "max_tokens": 5, "temperature": 0}, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    assert "Paris" in body["choices"][0]["text"]


def _events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def test_chat_stream_usage_and_done(server):
    req = {"messages": [{"role": "user", "content": "Count from 1 to 20."}], "max_tokens": 12, "temperature": 0,
           "stream": True, "ignore_eos": True,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=req, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = _events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_string_not_emitted(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0,
                                                         "stop": [" 8"]}, timeout=60)
    text = r.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and " 7" in text and "8" not in text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "not valid JSON"),
        (json.dumps({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": "5"}), 400, "max_tokens"),
        (json.dumps({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
        (json.dumps({"prompt": 5}), 400, "prompt"),
        (json.dumps({"prompt": "hi", "model": "gpt-4"}), 404, "does not exist"),
        (json.dumps({"prompt": "word " * 5000}), 400, "context"),
    ],
)
def test_bad_input_is_a_4xx_openai_error(server, body, status, needle):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_chat_bad_messages(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=60)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_queue_over_max_waiting_is_429(server):
    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            reqs = [client.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
                    for _ in range(40)]
            return [r.status_code for r in await asyncio.gather(*reqs)]

    codes = asyncio.run(burst())
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    wait_idle(server.engine)


def test_aborted_streams_free_their_blocks(server):
    engine = server.engine
    wait_idle(engine)
    free0 = engine.block_manager.num_free

    async def abort_one(client: httpx.AsyncClient, i: int) -> None:
        req = {"prompt": f"Story number {i}: once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with client.stream("POST", server.url + "/v1/completions", json=req) as resp:
            if resp.status_code == 429:
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # first token arrived: hang up mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            for start in range(0, 200, 4):  # 4 at a time stays under --max-waiting
                await asyncio.gather(*(abort_one(client, i) for i in range(start, start + 4)))

    asyncio.run(run())
    wait_idle(engine)
    assert engine.block_manager.num_free == free0
    m = httpx.get(server.url + "/metrics").text
    assert "servelab_kv_blocks_total 256.0" in m and "servelab_time_to_first_token_seconds_count" in m


def test_iterations_endpoint(server):
    page = httpx.get(server.url + "/v1/iterations", params={"since": 0, "limit": 5}).json()
    assert len(page["iterations"]) == 5 and page["next"] == page["iterations"][-1]["i"] + 1
    rec = page["iterations"][0]
    assert rec["t_end_unix"] >= rec["t_unix"] and rec["seq_ids"] and rec["kv_blocks_total"] == 256
    tail = httpx.get(server.url + "/v1/iterations", params={"since": 1 << 40}).json()
    assert tail["iterations"] == [] and tail["next"] == server.engine.num_iterations


def test_a_mix_of_classes_asks_for_the_models_each_names(server, tmp_path):
    """Issue 36: a workload's classes name the served model (or LoRA adapter) their requests ask for; `bench run`
    sends each class's name: the one this server serves is answered, another is its 404 `model_not_found`."""
    import json

    from typer.testing import CliRunner

    from loadgen.cli.app import app
    from workloads.contracts import read_jsonl

    wl = tmp_path / "models.toml"
    wl.write_text('[[classes]]\nname = "served"\nmodel = "smol"\nprompt = 8\noutput = 4\n'
                  '[[classes]]\nname = "other"\nmodel = "lora-x"\nprompt = 8\noutput = 4\n')  # fmt: skip
    res = CliRunner().invoke(app, ["run", "--url", server.url, "--workload", str(wl), "--num-requests", "16",
                                   "--concurrency", "2", "--max-error-rate", "1", "--output-dir", str(tmp_path),
                                   "--run-id", "m"])  # fmt: skip
    assert res.exit_code == 0, res.output
    (point,) = json.loads((tmp_path / "m" / "summary.json").read_text())["points"]
    recs = read_jsonl(tmp_path / "m" / "points" / point["point_id"] / "requests.jsonl")
    served = [r for r in recs if r["cls"] == "served"]
    other = [r for r in recs if r["cls"] == "other"]
    assert served and other and len(served) + len(other) == 16
    assert all(r["error"] is None and r["output_tokens"] == 4 for r in served)
    assert all(r["status"] == 404 and "lora-x" in r["error"]["message"] for r in other), other[0]
