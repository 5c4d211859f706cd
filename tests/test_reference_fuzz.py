"""Property-based fuzzing of the reference server over HTTP on loopback: request bodies generated from the
server's own OpenAPI schema (/openapi.json), each field either a value of its schema or a hostile one
(wrong type, extreme number, unicode with lone surrogates, empty or huge), plus token-id prompts and
bodies that are not JSON objects at all. Sent 8 at a time, streaming and not: never a 5xx, every 4xx a
JSON error with a message, every 200 complete, and afterwards the engine alive and every KV block free.

Bounded: a 64-token context caps each request's work, and the example count is fixed (derandomized,
so CI runs the same bodies every time)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HOSTILE: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.just(""), st.just({}), st.just([]),
    st.integers(), st.sampled_from([-(2**63) - 1, 2**63, 10**30, -1, 0, 2**31]),
    st.floats(allow_nan=False), st.sampled_from([1e-320, 1e308, -0.0, 1e-40]),
    st.text(max_size=40), st.text(st.characters(codec=None, categories=["Cs", "Co", "Cn", "So"]), max_size=8),
    st.just("x" * 5000), st.lists(st.integers(-5, 60000), max_size=80),
    st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
    st.lists(st.text(max_size=5), max_size=40),
)


def from_schema(s: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that conform to a JSON schema (the subset pydantic writes), kept small."""
    if "anyOf" in s:
        return st.one_of([from_schema(x) for x in s["anyOf"]])
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    kind = s.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = s.get("minimum"), s.get("maximum")
        near = st.integers(lo if lo is not None else 0, min(hi if hi is not None else 2000, (lo or 0) + 2000))
        return st.one_of(near, near, near, st.integers(lo, hi))
    if kind == "number":
        return st.floats(s.get("minimum", s.get("exclusiveMinimum")), s.get("maximum"), allow_nan=False,
                         allow_infinity=False, exclude_min="exclusiveMinimum" in s)
    if kind == "string":
        return st.one_of(st.text(min_size=1, max_size=60), st.text(min_size=1, max_size=60), st.text(max_size=2))
    if kind == "array":
        return st.lists(from_schema(s.get("items", {})), min_size=s.get("minItems", 0), max_size=4)
    if kind == "object" or "properties" in s:
        props = s.get("properties", {})
        required = set(s.get("required", []))
        return st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v) for k, v in props.items() if k not in required})
    return HOSTILE


def bodies(schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """A body of the schema's fields (the model left out: another name is a plain 404), then up to two
    fields, or unknown ones, set to hostile values; or no JSON object at all."""
    props = schema["properties"]
    typed = {k: v for k, v in props.items() if k != "model" and ("type" in v or "anyOf" in v)}
    required = set(schema.get("required", []))
    base = st.fixed_dictionaries({k: from_schema(v) for k, v in typed.items() if k in required},
                                 optional={k: from_schema(v) for k, v in typed.items() if k not in required})
    mutations = st.lists(st.tuples(st.sampled_from([*props, "unknown_field"]), HOSTILE), max_size=2)
    obj = st.builds(lambda d, m: {**d, **dict(m)}, base, st.one_of(st.just([]), st.just([]), mutations))
    as_json = obj.map(lambda d: json.dumps(d).encode())
    junk = st.one_of(HOSTILE.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64))
    return st.one_of(as_json, as_json, as_json, as_json, junk)


def _schemas(url: str) -> dict[str, dict[str, Any]]:
    spec = httpx.get(url + "/openapi.json", timeout=30).json()
    return {path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank")}


async def _send(client: httpx.AsyncClient, path: str, body: bytes) -> tuple[int, str]:
    async with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
        return r.status_code, (await r.aread()).decode("utf-8", "replace")


def _check(path: str, body: bytes, status: int, text: str) -> None:
    where = f"{path} {body[:300]!r} -> {status} {text[:300]}"
    assert status < 500, where
    if status >= 400:
        assert json.loads(text)["error"]["message"], where
        return
    assert status == 200, where
    if text.startswith("data: "):  # a stream: complete, and no error event
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all('"error"' not in e[:12] for e in events), where
    elif path == "/v1/embeddings":
        assert all(d["embedding"] for d in json.loads(text)["data"]), where
    elif path == "/v1/rerank":
        assert json.loads(text)["results"], where
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length"), where


def test_fuzzed_requests_never_5xx_and_leak_nothing(small_server):
    schemas = _schemas(small_server.url)
    assert {"prompt", "max_tokens", "logprobs"} <= set(schemas["/v1/completions"]["properties"])
    requests = st.lists(st.one_of(*(st.tuples(st.just(p), bodies(s)) for p, s in schemas.items())),
                        min_size=8, max_size=8)
    counts = {"2xx": 0, "4xx": 0}

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(batch=requests)
    def fire(batch: list[tuple[str, bytes]]) -> None:
        async def run() -> list[tuple[int, str]]:
            async with httpx.AsyncClient(base_url=small_server.url, timeout=180) as client:
                return list(await asyncio.gather(*(_send(client, p, b) for p, b in batch)))

        for (path, body), (status, text) in zip(batch, asyncio.run(run()), strict=True):
            _check(path, body, status, text)
            counts["2xx" if status < 300 else "4xx"] += 1

    fire()
    assert counts["2xx"] >= 30 and counts["4xx"] >= 30, counts  # both valid and rejected bodies were exercised
    small_server.wait_idle()
    assert httpx.get(small_server.url + "/health", timeout=30).status_code == 200
    metrics = httpx.get(small_server.url + "/metrics", timeout=30).text
    assert "servelab_engine_alive 1.0" in metrics and "servelab_kv_blocks_used 0.0" in metrics
    assert small_server.engine.block_manager.num_free == small_server.engine.block_manager.num_blocks
