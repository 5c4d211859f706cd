"""Logprobs from the reference server over real HTTP: the completions API's legacy shape and chat's, raw (before
temperature), the same streamed as whole, repeatable, the target's under speculative decoding, the 4xx answers,
the ``openai`` client, and ``bench verify``'s margin asked of it."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from backends.openai import OpenAIBackend
from loadgen.experiments.margin import margin
from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.sequence import SamplingParams
from reference_server.model_files import default_model_path
from workloads.contracts import GenRequest

PROMPT = "The capital of France is Paris. The capital of Germany is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(live_server):
    # no prefix caching: a repeated request computes its whole prompt again, in the same shapes, so its logprobs
    # are compared exactly (a cache hit runs fewer rows: another kernel path, other roundings, under int4 weights)
    cfg = EngineConfig(model=default_model_path(), num_kv_blocks=128, threads=1, max_model_len=512, max_waiting=64,
                       enable_prefix_caching=False)
    with live_server(Engine.on_own_thread(cfg)) as running:
        yield running


def _post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "smol", **body}, timeout=120)


def _complete(server, **body: object) -> dict:
    r = _post(server, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(server, body: dict, path: str = "/v1/completions") -> list[dict]:
    r = _post(server, {**body, "stream": True}, path)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_completion_logprobs_shape_and_values(server):
    body = _complete(server, logprobs=5)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert {k: len(v) for k, v in lp.items()} == dict.fromkeys(("tokens", "token_logprobs", "top_logprobs", "text_offset"), n)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(n)]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert top[token] == chosen == values[0]  # greedy: the chosen token is the top one
        assert sum(map(math.exp, values)) <= 1 + 1e-6
    assert _complete(server, logprobs=5)["choices"][0]["logprobs"] == lp  # the same request, the same values
    for none in ({}, {"logprobs": None}, {"logprobs": False}):  # not asked, as clients' defaults say it: none
        assert _complete(server, **none)["choices"][0]["logprobs"] is None


def test_logprobs_are_raw_and_zero_gives_the_chosen_token_only(server):
    """Before temperature and top-p (vLLM's raw_logprobs): a sampled request's first position has the greedy one's
    distribution; ``logprobs: 0`` lists the chosen token alone, which sampling may take from outside the top."""
    greedy = _complete(server, logprobs=3, max_tokens=1)["choices"][0]["logprobs"]
    sampled = _complete(server, logprobs=3, max_tokens=1, temperature=1.5, top_p=0.5, seed=1)["choices"][0]["logprobs"]
    assert greedy["top_logprobs"][0].items() <= sampled["top_logprobs"][0].items()  # (and the chosen one)
    zero = _complete(server, logprobs=0, temperature=1.0, seed=3)["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[t] for t in zero["tokens"]]
    assert all(t[tok] == v <= 0 for t, tok, v in zip(zero["top_logprobs"], zero["tokens"], zero["token_logprobs"], strict=True))


def test_streamed_logprobs_equal_the_whole_answer(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = _complete(server, **body)["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in _streamed(server, body)]
    joined = {k: [v for c in chunks for v in c[k]] for k in whole}
    assert joined == whole


def test_chat_logprobs_shape_whole_and_streamed(server):
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    r = _post(server, body, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                       reverse=True)
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0
    streamed = [e for c in _streamed(server, body, "/v1/chat/completions") for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    plain = _post(server, {**body, "top_logprobs": None}, "/v1/chat/completions").json()["choices"][0]["logprobs"]
    assert plain["content"][0]["top_logprobs"] == [] and plain["content"][0]["logprob"] == content[0]["logprob"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),  # chat's field
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
])
def test_bad_logprobs_are_a_400(server, path, body, param):
    r = _post(server, {**body, "max_tokens": 1}, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_package_reads_them(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    c = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) == 2 for t in lp.top_logprobs) and lp.token_logprobs[0] <= 0
    chat = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_verify_margin_is_the_divergent_tokens(server):
    """``bench verify``'s probe at a divergence: the reference's top-two margin, in nats, at the token that holds
    the first differing character (here the middle of the answer's fourth token), and whether the answer under
    load and the reference went on with the top two there, one each."""
    whole = _complete(server, max_tokens=6, logprobs=2)["choices"][0]
    tokens, tops = whole["logprobs"]["tokens"], whole["logprobs"]["top_logprobs"]
    reference, start = whole["text"], sum(map(len, tokens[:3]))
    at = start + len(tokens[3]) // 2 + 1 if len(tokens[3]) > 1 else start
    second = min(tops[3], key=tops[3].get)
    backend = OpenAIBackend(server.url, model="smol")
    req = GenRequest("r0", PROMPT, 8)

    async def probe(answer: str) -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            return (await margin(client, backend, req, reference, at)).cells(reference, answer)

    took = asyncio.run(probe(reference[:start] + second + "!"))
    # the probe prefills the position the whole answer decoded: matmuls of other shapes, rounded otherwise
    # (float32 on an AMD Zen 3: 6.6e-6 nats apart)
    assert took["margin"] == pytest.approx(max(tops[3].values()) - min(tops[3].values()), abs=1e-4)
    assert (took["token"], took["second"], took["top_two"]) == (tokens[3], second, True)
    assert asyncio.run(probe(reference[:at] + "\u2603"))["top_two"] is False


def test_speculative_logprobs_are_the_target_models():
    """With n-gram drafts accepted, each token's logprob is what the model without speculation gives (the
    verification pass batches rows otherwise: equal up to rounding, in fp32; bf16 rounding moved one by 0.13)."""
    prompt_text = "one two three four five six. one two three four five six. one two three four"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    found = {}
    for spec in ("off", "ngram"):
        engine = Engine(EngineConfig(model=default_model_path(), num_kv_blocks=64, threads=1, max_model_len=256, spec=spec,
                                     dtype="fp32"))
        seq = engine.add_request(engine.codec.encode(prompt_text), params)
        outs = []
        while not outs or not outs[-1].finished:
            outs += [o for o in engine.step() if o.seq_id == seq.seq_id]
        found[spec] = [(t, lp) for o in outs for t, lp in zip(o.token_ids, o.logprobs or [], strict=True)]
        assert len(found[spec]) == 12
    assert seq.spec_accepted > 0
    for (tok, lp), (tok_s, lp_s) in zip(found["off"], found["ngram"], strict=True):
        assert tok == tok_s and lp.top[0][0] == tok and lp_s.top[0][0] == tok
        assert lp_s.logprob == lp_s.top[0][1] and lp_s.logprob == pytest.approx(lp.logprob, abs=1e-3)
