"""One request can never stop the reference server: strict validation (4xx naming the field), faults
contained to one request or one step, engine death answered with 503 (never a hang), disconnected
non-streaming requests aborted, prefix-cache keys that cannot collide, last-step blocks published,
/metrics that count what they say, and real clients (the `openai` package, vLLM bench serve's and
guidellm's payloads) served without an error."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from reference_server.api.schemas import MAX_BODY_BYTES, UNSUPPORTED
from reference_server.config import EngineConfig
from reference_server.engine.block_manager import BlockManager
from reference_server.engine.engine import Engine
from reference_server.engine.policies import PriorityPolicy, SjfPolicy
from reference_server.engine.sequence import SamplingParams, Sequence
from reference_server.model import text as text_mod
from reference_server.model.sampler import sample
from reference_server.model_files import default_model_path

MAX_MODEL_LEN = 512


def _config(**kw: object) -> EngineConfig:
    args: dict = {"num_kv_blocks": 128, "max_model_len": MAX_MODEL_LEN, "threads": 1, **kw}
    return EngineConfig(model=default_model_path(), **args)


@pytest.fixture(scope="module")
def server(live_server):
    with live_server(Engine.on_own_thread(_config())) as running:
        yield running


def _post(server, body: object, path: str = "/v1/completions", **kw: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=kw.pop("timeout", 120), **kw)  # type: ignore[arg-type]


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _settled(server) -> None:
    """The engine is idle, alive and holds no KV block."""
    server.wait_idle()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert _metric(server, "servelab_engine_alive") == 1.0
    assert _metric(server, "servelab_kv_blocks_used") == 0.0
    assert server.engine.block_manager.num_free == server.engine.block_manager.num_blocks


# -- sampling ------------------------------------------------------------------------------------------
def test_tiny_temperature_is_greedy(server):
    """vLLM treats temperatures below 1e-5 as greedy; dividing by 1e-40 made NaN and killed the engine."""
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-5).greedy
    logits = torch_logits()
    seqs = [Sequence([1], SamplingParams(temperature=t)) for t in (1e-40, 5e-324, 1e-6)]
    assert sample(logits, seqs).tolist() == [int(logits[0].argmax())] * 3
    body = {"prompt": "The capital of France is", "max_tokens": 5}
    tiny = _post(server, {**body, "temperature": 1e-40})
    zero = _post(server, {**body, "temperature": 0})
    assert tiny.status_code == zero.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == zero.json()["choices"][0]["text"]
    _settled(server)


def torch_logits():  # noqa: ANN201
    import torch

    return torch.linspace(-30, 30, 49152).repeat(3, 1)


# -- validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "needles"),
    [
        ({"prompt": "hi", "max_tokens": 2, "seed": 10**27}, 400, ["seed", "9223372036854774784"]),
        ({"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1}, 400, ["seed"]),  # one double with 2**63 (schema)
        ({"prompt": "hi", "max_tokens": 2, "seed": -(2**63) - 1}, 400, ["seed"]),
        ({"prompt": "hi", "max_tokens": 100000}, 400, ["max_tokens", "512", "100000", "100001"]),
        ({"prompt": "hi", "max_tokens": 10**30}, 400, ["max_tokens", "512"]),
        ({"prompt": list(range(MAX_MODEL_LEN + 5))}, 400, ["prompt", "517", "512"]),
        ({"prompt": [1, 2, 10**12]}, 400, ["prompt", "49152"]),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(33)]}, 400, ["stop", "32"]),
        ({"prompt": "hi", "stop": "x" * 513}, 400, ["stop", "512"]),
        ({"prompt": "hi", "stop_token_ids": [-1]}, 400, ["stop_token_ids"]),
        ({"prompt": "hi", "stop_token_ids": list(range(1025))}, 400, ["stop_token_ids"]),
        ({"prompt": "hi", "top_logprobs": 1}, 400, ["top_logprobs", "not supported"]),  # chat's field
        ({"prompt": "hi", "echo": True}, 400, ["echo"]),
        ({"prompt": "hi", "best_of": 3}, 400, ["best_of"]),
        ({"prompt": "hi", "presence_penalty": 0.5}, 400, ["presence_penalty"]),
        ({"prompt": "hi", "frequency_penalty": -1}, 400, ["frequency_penalty"]),
        ({"prompt": "hi", "repetition_penalty": 1.2}, 400, ["repetition_penalty"]),
        ({"prompt": "hi", "logit_bias": {"50256": -100}}, 400, ["logit_bias"]),
        ({"prompt": "hi", "n": 2}, 400, ["n"]),
        ({"prompt": "hi", "priority": 3}, 400, ["priority", "--policy priority"]),
        ({"prompt": "hi", "temperature": 2.5}, 400, ["temperature"]),
        ({"prompt": "\ud800"}, 400, ["Unicode"]),
        (b'{"prompt": "hi", "temperature": NaN}', 400, ["NaN"]),
        (b"[" * 100000 + b"]" * 100000, 400, ["nested"]),
        (b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}', 413, [str(MAX_BODY_BYTES)]),
    ],
)
def test_bad_input_is_a_clear_4xx(server, body, status, needles):
    r = _post(server, body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(n in message for n in needles), message


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600},
         "600"),
    ],
)
def test_chat_rejects_what_it_does_not_do(server, path, body, needle):
    r = _post(server, body, path)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_null_and_default_fields_are_accepted(server):
    """What real clients send: vLLM bench serve (logprobs null, repetition_penalty 1.0, stream_options),
    guidellm (stop null, max_completion_tokens), and every unsupported field at null or its default."""
    bench = {"model": "smol", "prompt": "Hello", "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    guidellm = {"model": "smol", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                "max_tokens": 4, "max_completion_tokens": 4, "stop": None, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
    nulls = {"prompt": "Hello", "max_tokens": 3, **dict.fromkeys(UNSUPPORTED), "seed": None, "stop": None,
             "stream_options": None, "stop_token_ids": None, "model": None, "user": "someone"}
    defaults = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "logprobs": False,
                "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [],
                "tool_choice": "none", "response_format": {"type": "text"}, "n": 1, "seed": 2**62,
                "temperature": 0.7, "top_p": 0.9, "top_k": -1, "priority": 0}
    for path, body in (("/v1/completions", bench), ("/v1/chat/completions", guidellm),
                       ("/v1/completions", nulls), ("/v1/chat/completions", defaults)):
        r = _post(server, body, path)
        assert r.status_code == 200, (body, r.text)
        if body.get("stream"):
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 4
    _settled(server)


def test_openai_python_package_drives_the_server(server):
    import openai  # a dev dependency

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["smol"]
    c = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert c.usage.completion_tokens == 4 and c.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=4, temperature=0, seed=7, top_p=1.0, stop=None)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count to 5"}],
                                            max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model="smol", prompt="hi", max_tokens=2, seed=10**27)
    _settled(server)


# -- isolation -----------------------------------------------------------------------------------------
def test_a_detokenizer_fault_fails_that_request_alone(server, monkeypatch):
    """A request whose detokenizer raises (vLLM #17448: DecodeStream errors) gets a 500 naming the cause,
    or an error event on its stream; the requests beside it are served; its blocks come back."""
    add = text_mod.Detokenizer.add

    def planted(self: text_mod.Detokenizer, token_id: int) -> str:
        if "PLANTED" in self.stop:
            raise RuntimeError("planted detokenizer fault")
        return add(self, token_id)

    monkeypatch.setattr(text_mod.Detokenizer, "add", planted)

    async def run() -> list[httpx.Response]:
        good = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
        bad = {"prompt": "Once upon a time", "max_tokens": 24, "stop": ["PLANTED"]}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return list(await asyncio.gather(
                c.post("/v1/completions", json=good), c.post("/v1/completions", json=bad),
                c.post("/v1/completions", json={**bad, "stream": True}), c.post("/v1/completions", json=good)))

    ok1, failed, streamed, ok2 = asyncio.run(run())
    assert ok1.status_code == ok2.status_code == 200 and ok1.json()["usage"]["completion_tokens"] == 24
    assert failed.status_code == 500
    assert "planted detokenizer fault" in failed.json()["error"]["message"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "planted detokenizer fault" in json.loads(events[-2])["error"]["message"]
    monkeypatch.undo()
    _settled(server)
    assert _post(server, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_model_step_fault_fails_that_step_and_the_engine_goes_on(server, monkeypatch):
    engine = server.engine
    step = engine.runner.step
    planted = {"left": 1}

    def faulty(*a: object, **kw: object) -> object:
        if planted["left"]:
            planted["left"] -= 1
            raise RuntimeError("planted model fault")
        return step(*a, **kw)

    monkeypatch.setattr(engine.runner, "step", faulty)
    failed = _post(server, {"prompt": "Tell me a story", "max_tokens": 8})
    assert failed.status_code == 500 and "planted model fault" in failed.json()["error"]["message"]
    after = _post(server, {"prompt": "Tell me a story", "max_tokens": 8, "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    assert 'servelab_requests_finished_total{finish_reason="error"}' in httpx.get(server.url + "/metrics").text
    _settled(server)


def test_a_bug_in_the_http_layer_is_a_json_500_naming_it(server, monkeypatch):
    front = server.server.config.app.state.server

    def broken(*a: object) -> None:
        raise KeyError("planted front-end bug")

    monkeypatch.setattr(front, "_final", broken)
    r = _post(server, {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500 and "planted front-end bug" in r.json()["error"]["message"]
    monkeypatch.undo()
    _settled(server)


def test_engine_death_is_503_at_once_never_a_hang(live_server, monkeypatch):
    engine = Engine.on_own_thread(_config(num_kv_blocks=32))
    with live_server(engine) as srv:
        assert _post(srv, {"prompt": "hi", "max_tokens": 2}).status_code == 200

        def broken(*a: object) -> None:
            raise RuntimeError("planted scheduler bug")

        monkeypatch.setattr(engine.scheduler, "advance", broken)  # outside any per-request guard
        first = _post(srv, {"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert first.status_code == 503 and "planted scheduler bug" in first.json()["error"]["message"]
        t0 = time.monotonic()
        health = httpx.get(srv.url + "/health", timeout=10)
        later = _post(srv, {"prompt": "hi", "max_tokens": 2}, timeout=10)
        stream = _post(srv, {"prompt": "hi", "max_tokens": 2, "stream": True}, timeout=10)
        assert time.monotonic() - t0 < 10
        assert health.status_code == later.status_code == stream.status_code == 503
        assert "planted scheduler bug" in later.json()["error"]["message"]
        assert _metric(srv, "servelab_engine_alive") == 0.0


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    """A client that gives up on a non-streaming request no longer leaves it decoding to the end."""
    engine = server.engine
    _settled(server)
    aborted = engine.num_finished["abort"]
    with pytest.raises(httpx.ReadTimeout):
        _post(server, {"prompt": "Write a long story", "max_tokens": 480, "ignore_eos": True}, timeout=1)
    server.wait_idle()
    assert engine.num_finished["abort"] == aborted + 1
    assert _metric(server, 'servelab_requests_finished_total{finish_reason="abort"}') >= 1
    _settled(server)


# -- prefix cache ----------------------------------------------------------------------------------------
def _publish(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, SamplingParams())
    bm.admit(seq, bm.match_prefix(seq))
    bm.grow(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.commit(seq)
    return seq


def test_prefix_key_collision_cannot_return_another_prefix(monkeypatch):
    """Keys are sha256 over the parent key and the tokens, and a hit must match both exactly: even a
    digest that ignores the parent (the worst collision) never serves KV computed after another prefix."""
    import reference_server.engine.block_manager as bm_mod

    real = bm_mod.chain_hash
    monkeypatch.setattr(bm_mod, "chain_hash", lambda prev, toks: repr(toks).encode())
    bm = BlockManager(num_blocks=16, block_size=2)
    _publish(bm, [1, 1, 7, 7, 0])  # chain A: [1 1] -> [7 7]
    _publish(bm, [2, 2, 5, 5, 0])  # chain B: [2 2] -> [5 5]
    query = Sequence([2, 2, 7, 7, 0], SamplingParams())  # B's first block, then A's second block's tokens
    assert len(bm.match_prefix(query)) == 1  # [7 7] after [2 2] was never computed
    assert len(bm.match_prefix(Sequence([1, 1, 7, 7, 0], SamplingParams()))) == 2
    assert real(b"", (1, 2)) != real(real(b"", (9, 9)), (1, 2)) and len(real(b"", (1,))) == 32  # sha256


def test_blocks_of_the_last_step_are_published(server):
    """A max_tokens=1 request (a warm-up) caches its prompt: the same prompt then hits those blocks."""
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16
    first = _post(server, {"prompt": prompt, "max_tokens": 1})
    again = _post(server, {"prompt": prompt, "max_tokens": 1})
    assert first.status_code == again.status_code == 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    _settled(server)


# -- metrics and scheduling ------------------------------------------------------------------------------
def test_generation_tokens_count_every_emitted_token(server):
    before = _metric(server, "servelab_generation_tokens_total")
    r = _post(server, {"prompt": "Count: 1, 2, 3,", "max_tokens": 9, "ignore_eos": True})
    assert r.status_code == 200
    server.wait_idle()
    assert _metric(server, "servelab_generation_tokens_total") - before == 9


def test_accepted_draft_tokens_are_generation_not_prefill():
    from reference_server.model.gguf_loader import load_gguf
    from reference_server.model.model_runner import ModelRunner
    from reference_server.model.text import TextCodec

    cfg = EngineConfig(model=default_model_path(), dtype="fp32", threads=1, num_kv_blocks=64, spec="ngram")
    spec, weights = load_gguf(cfg.model)
    engine = Engine(cfg, ModelRunner(cfg, spec, weights), TextCodec(cfg.model))
    prompt = [int(t) for t in engine.codec.encode("a b c d a b c d a b c d a b c d a b c d a b c d")]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    recs = list(engine.iterations)
    assert engine.spec is not None and engine.spec.num_accepted > 0
    assert sum(r.output_tokens for r in recs) == len(out) == 24
    assert sum(r.prefill_tokens for r in recs) == len(prompt)  # verification rows are decode work


def test_aging_protects_a_request_from_being_the_victim_again_and_again():
    def seq(priority: int, waited: float, n: int = 8) -> Sequence:
        s = Sequence(list(range(1, 5)), SamplingParams(max_tokens=n), priority=priority)
        s.arrival -= waited
        return s

    p = PriorityPolicy(aging_s=1.0)
    old_low, new_low, new_high = seq(0, 60.0), seq(0, 0.0), seq(5, 0.0)
    assert p.should_preempt(new_high, [old_low]) is None  # 60 s in the system outranks priority 5
    assert p.should_preempt(new_high, [old_low, new_low]) is new_low
    assert p.victim([old_low, new_low]) is new_low
    s = SjfPolicy(aging_s=1.0, aging_tokens=64)
    old_long, new_short = seq(0, 60.0, n=500), seq(0, 0.0, n=50)
    assert s.victim([old_long, new_short]) is new_short
