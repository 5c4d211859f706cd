"""``POST /v1/embeddings`` and ``POST /v1/rerank`` of the reference server over real HTTP: OpenAI's and the
rerank shapes, unit-norm mean-pooled embeddings computed by the engine beside generation requests (batch
invariance), base64, the ``openai`` client, bi-encoder ranking, the 4xx answers and the metrics."""

from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import openai
import pytest
from support.cli import cli_point
from support.pooling import embeddings_end_to_end

from reference_server import metric_names as M
from reference_server.api.schemas import MAX_POOLING_INPUTS
from reference_server.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.engine.sequence import SamplingParams
from reference_server.model_files import default_model_path

CONTEXT = 1024
CAT = "the cat sat on the mat"
TEXTS = [CAT, "A small kitten is sleeping on the rug by the fire.",
         "Quarterly earnings beat expectations as bond yields rose and the central bank held interest rates."]


@pytest.fixture(scope="module")
def server(live_server):
    # a 16-token budget: longer inputs are prefilled in chunks, in steps shared with other requests
    cfg = EngineConfig(model=default_model_path(), num_kv_blocks=256, threads=1, max_num_batched_tokens=16,
                       max_model_len=CONTEXT, max_waiting=64)
    with live_server(Engine.on_own_thread(cfg)) as running:
        yield running


def _embed(server, inputs: object, **extra: object) -> list[np.ndarray]:
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "smol", "input": inputs, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [np.asarray(d["embedding"], dtype=np.float64) for d in body["data"]]


def _tokens(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_embeddings_shape_unit_norm_and_usage(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "smol" and len(body["data"]) == 3
    hidden = server.engine.runner.spec.hidden
    for i, d in enumerate(body["data"]):
        assert d["object"] == "embedding" and d["index"] == i and len(d["embedding"]) == hidden
        assert abs(np.linalg.norm(d["embedding"]) - 1) < 1e-5
    tokens = sum(len(_tokens(server, t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_embedding_does_not_depend_on_the_batch(server):
    """Alone, then among inputs of other lengths while a generation request decodes in the same steps."""
    alone = _embed(server, CAT)[0]
    assert np.array_equal(_embed(server, CAT)[0], alone)  # the same text, alone again: the same vector
    long = " ".join(["The history of the lighthouse begins in the ancient world."] * 6)
    gen = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                           kwargs={"json": {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True},
                                   "timeout": 120})
    gen.start()
    batch = _embed(server, [long, "Hi", CAT, TEXTS[2]])
    gen.join()
    assert float(batch[2] @ alone) >= 0.999
    assert float(batch[3] @ _embed(server, TEXTS[2])[0]) >= 0.999
    server.wait_idle()
    bm = server.engine.block_manager
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks  # the pooling requests freed their blocks


def test_token_id_inputs_and_base64(server):
    ids = [_tokens(server, t) for t in TEXTS[:2]]
    as_text = _embed(server, TEXTS[:2])
    as_ids = _embed(server, ids)
    assert all(float(a @ b) >= 0.999 for a, b in zip(as_text, as_ids, strict=True))
    assert float(_embed(server, ids[0])[0] @ as_text[0]) >= 0.999  # one token-id list
    # one input alone: the same computation each time (several may share their first step or not)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": CAT, "encoding_format": "base64"}, timeout=120)
    decoded = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, _embed(server, CAT, encoding_format="float")[0].astype(np.float32))


def test_openai_client(server):
    """The ``openai`` package asks for base64 unless told otherwise, and sends its own defaults."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    got = client.embeddings.create(model="smol", input=TEXTS[:2])
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens > 0
    floats = _embed(server, TEXTS[:2])
    assert all(float(np.dot(d.embedding, f)) >= 0.999 for d, f in zip(got.data, floats, strict=True))
    alone = client.embeddings.create(model="smol", input=CAT)  # decoded from base64 by the client
    one = client.embeddings.create(model="smol", input=CAT, encoding_format="float", user="u1")
    assert np.array_equal(np.float32(alone.data[0].embedding), np.float32(one.data[0].embedding))


def test_rerank_ranks_the_related_document_first(server):
    docs = [TEXTS[2], "A cat is sitting on a rug.", "Stock markets fell after the bank raised rates."]
    r = httpx.post(server.url + "/v1/rerank", json={"model": "smol", "query": CAT, "documents": docs}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert [x["index"] for x in results][0] == 1 and len(results) == 3
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and all(x["document"]["text"] == docs[x["index"]] for x in results)
    query, *embedded = _embed(server, [CAT, *docs])
    # the cosine, to the float rounding of two computations that may batch their texts differently
    assert all(abs(x["relevance_score"] - float(query @ embedded[x["index"]])) < 2e-3 for x in results)
    assert body["usage"]["total_tokens"] == sum(len(_tokens(server, t)) for t in [CAT, *docs])
    r = httpx.post(server.url + "/v1/rerank", json={"query": CAT, "documents": docs, "top_n": 2,
                                                    "return_documents": False}, timeout=120)
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and all("document" not in x for x in top)


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/embeddings", {"input": []}, 400, None),
    ("/v1/embeddings", {"input": ""}, 400, None),
    ("/v1/embeddings", {"input": ["a", ""]}, 400, None),
    ("/v1/embeddings", {"input": [[1, 2], []]}, 400, None),
    ("/v1/embeddings", {"input": [1, 10**9]}, 400, None),
    ("/v1/embeddings", {"input": ["a", [1]]}, 400, None),
    ("/v1/embeddings", {"input": [7] * (CONTEXT + 1)}, 400, "context_length_exceeded"),
    ("/v1/embeddings", {"input": ["a"] * (MAX_POOLING_INPUTS + 1)}, 400, None),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400, None),
    ("/v1/embeddings", {"input": "a", "dimensions": 64}, 400, "unsupported_parameter"),
    ("/v1/embeddings", {"input": "a", "normalize": False}, 400, "unsupported_parameter"),
    ("/v1/embeddings", {"input": "a", "priority": 3}, 400, None),
    ("/v1/embeddings", {"input": "a", "model": "other"}, 404, "model_not_found"),
    ("/v1/embeddings", {}, 400, None),
    ("/v1/rerank", {"query": CAT, "documents": []}, 400, None),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, 400, None),
    ("/v1/rerank", {"query": CAT, "documents": ["a", ""]}, 400, None),
    ("/v1/rerank", {"query": CAT, "documents": [1]}, 400, None),
    ("/v1/rerank", {"query": CAT, "documents": ["a"], "top_n": -1}, 400, None),
    ("/v1/rerank", {"query": CAT, "documents": ["a", "word " * (CONTEXT + 1)]}, 400, "context_length_exceeded"),
])
def test_bad_bodies_are_4xx_json(server, path, body, status, code):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]


def test_null_defaults_accepted_and_full_context(server):
    assert server.engine.max_model_len == CONTEXT
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [5] * CONTEXT, "encoding_format": None, "dimensions": None,
                                                        "user": None, "truncate_prompt_tokens": None, "normalize": True,
                                                        "priority": 0}, timeout=300)
    assert r.status_code == 200, r.text  # an embedding needs no room for output: the whole context
    r = httpx.post(server.url + "/v1/rerank", json={"query": CAT, "documents": ["a"], "top_n": None,
                                                    "return_documents": None, "model": None}, timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["document"] == {"text": "a"}


def _counter(server, name: str, endpoint: str) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    line = f'{M.total(name)}{{endpoint="{endpoint}"}} '
    return next((float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line)), 0.0)


def test_metrics_count_requests_inputs_and_tokens(server):
    before = [_counter(server, name, "embeddings") for name in (M.POOLING_REQUESTS, M.POOLING_INPUTS, M.POOLING_TOKENS)]
    rerank = _counter(server, M.POOLING_INPUTS, "rerank")
    _embed(server, TEXTS)
    tokens = sum(len(_tokens(server, t)) for t in TEXTS)
    after = [_counter(server, name, "embeddings") for name in (M.POOLING_REQUESTS, M.POOLING_INPUTS, M.POOLING_TOKENS)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3, tokens]
    httpx.post(server.url + "/v1/rerank", json={"query": CAT, "documents": ["a", "b"]}, timeout=60)
    assert _counter(server, M.POOLING_INPUTS, "rerank") == rerank + 3
    assert 'servelab_requests_finished_total{finish_reason="pooled"}' in httpx.get(server.url + "/metrics").text


def test_pooling_request_preempted_and_recomputed_without_prefix_hits():
    """On a 12-block pool a long input, the latest arrival, is preempted again and again by two generation
    requests: each recompute starts its sum afresh (float32 model: the same vector to 1e-5). The same text
    again takes no prefix hit from the blocks it published: pooling needs every token's hidden state."""
    cfg = EngineConfig(model=default_model_path(), dtype="fp32", threads=1, num_kv_blocks=12, block_size=4,
                       max_num_batched_tokens=8)
    engine = Engine(cfg)
    text = ("the cat sat on the mat and looked out of the window at the birds that were singing in the old oak "
            "tree beside the river, where the children played every summer")
    gen = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt in ("Once upon a time there was", "The weather today is"):
        engine.add_request(engine.codec.encode(prompt), gen)
    first = engine.add_request(engine.codec.encode(text), None)
    while engine.scheduler.has_work() or engine.num_waiting():
        engine.step()
    again = engine.add_request(engine.codec.encode(text), None)
    while engine.scheduler.has_work() or engine.num_waiting():
        engine.step()
    assert first.num_preemptions > 0 and again.num_preemptions == 0 and again.num_cached_tokens == 0
    assert first.embedding is not None and again.embedding is not None
    assert float(first.embedding @ again.embedding) >= 1 - 1e-5
    assert engine.num_finished["pooled"] == 2 and engine.block_manager.num_used == 0


def test_bench_measures_the_embeddings_endpoint_end_to_end(server, tmp_path):
    """Issue 36: this server's /v1/embeddings through bench run, sweep, the report and the gate."""
    embeddings_end_to_end(server.url, tmp_path)


def test_bench_run_measures_the_rerank_endpoint(server, tmp_path):
    """Issue 36: `bench run` of a rerank workload (a query and 3 documents per request) against this server: every
    request ok, its documents counted, no TTFT; the server's count repeats the query per document, so it is
    not compared with the workload's."""
    wl = tmp_path / "rerank.toml"
    wl.write_text('api = "rerank"\n[[classes]]\nname = "p"\nprompt = 12\ninputs = 3\n')
    point, out = cli_point(server.url, wl, tmp_path, "rerank", 4)
    assert point["counts"]["inputs"] == 12 and point["latency"]["ttft"]["count"] == 0 and "inputs/s" in out
    assert "prompt_lengths" not in point and point["counts"]["prompt_tokens"] > 0
