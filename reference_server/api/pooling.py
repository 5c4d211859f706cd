"""``POST /v1/embeddings`` and ``POST /v1/rerank`` over the front end: each text is one pooling request
(``Sequence`` with no sampling parameters), which the engine schedules beside the generation requests."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from reference_server.api.errors import ApiError
from reference_server.api.frontend import Server, Stream, until_disconnect
from reference_server.api.schemas import (
    MAX_POOLING_INPUTS,
    POOLING_UNSUPPORTED,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    validated,
)
from reference_server.engine.engine import RequestOutput

_Pooling = TypeVar("_Pooling", bound=PoolingRequest)


async def _pooling_request(server: Server, request: Request, model: type[_Pooling]) -> _Pooling:
    server.check_alive()
    body = await server.read_body(request)
    server.check_supported(body, POOLING_UNSUPPORTED)
    req = validated(model, body)
    server.check_model(req.model)
    server.note_extra(req)
    server.check_priority(req.priority)
    return req


def _pooling_prompt(server: Server, text_or_ids: str | list[int], param: str, what: str) -> list[int]:
    """One text's (or token-id list's) prompt of a pooling request: not empty, token ids in the
    vocabulary, the whole within the context (no output follows it)."""
    ids = server.encode(text_or_ids, param) if isinstance(text_or_ids, str) else text_or_ids
    limit = server.engine.max_model_len
    if not ids:
        raise ApiError(400, f"{what} is empty", param)
    if len(ids) > limit:
        raise ApiError(400, f"{what} has {len(ids)} tokens but this model's context holds {limit}; shorten it",
                       param, "context_length_exceeded")
    return server.token_ids(ids, param)


def _embedding_prompts(server: Server, inp: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(inp, str) or inp and isinstance(inp[0], int):  # one text, or one token-id list
        return [_pooling_prompt(server, inp, "input", "the input")]  # type: ignore[arg-type]
    if not inp:
        raise ApiError(400, "the input is empty: give a text, a list of texts or of token-id lists", "input")
    if len(inp) > MAX_POOLING_INPUTS:
        raise ApiError(400, f"at most {MAX_POOLING_INPUTS} inputs per request (got {len(inp)})", "input")
    return [_pooling_prompt(server, x, "input", f"input {i}") for i, x in enumerate(inp)]  # type: ignore[arg-type]


async def embeddings(server: Server, request: Request) -> Response:
    """``POST /v1/embeddings``: each input's embedding is the model's final-norm hidden states over its
    tokens, mean-pooled and L2-normalised (the engine computes them: ``Sequence``, ``model/pooling.py``)."""
    req = await _pooling_request(server, request, EmbeddingRequest)
    prompts = await asyncio.to_thread(_embedding_prompts, server, req.input)

    def answer(vectors: list[list[float]], tokens: int) -> dict[str, Any]:
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": server.model_name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await _pool(server, request, "embeddings", prompts, req.priority, answer)


async def rerank(server: Server, request: Request) -> Response:
    """``POST /v1/rerank``, a bi-encoder rerank (not a cross-encoder): a document's relevance score is the
    cosine similarity of its embedding and the query's (the embeddings of :func:`embeddings`)."""
    req = await _pooling_request(server, request, RerankRequest)

    def texts() -> list[list[int]]:
        return [_pooling_prompt(server, req.query, "query", "the query"),
                *(_pooling_prompt(server, d, "documents", f"document {i}") for i, d in enumerate(req.documents))]

    prompts = await asyncio.to_thread(texts)

    def answer(vectors: list[list[float]], tokens: int) -> dict[str, Any]:
        scores = np.asarray(vectors[1:], dtype=np.float32) @ np.asarray(vectors[0], dtype=np.float32)
        results = []
        for i in np.argsort(-scores, kind="stable")[: req.top_n or None].tolist():
            result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
            if req.return_documents is not False:
                result["document"] = {"text": req.documents[i]}
            results.append(result)
        return {"id": "rerank-" + uuid.uuid4().hex, "model": server.model_name,
                "usage": {"total_tokens": tokens}, "results": results}

    return await _pool(server, request, "rerank", prompts, req.priority, answer)


async def _pool(server: Server, request: Request, endpoint: str, prompts: list[list[int]], priority: int,
                answer: Callable[[list[list[float]], int], dict[str, Any]]) -> Response:
    """Queue one pooling request per prompt; the body is ``answer`` of their embeddings (in order) and
    their tokens."""
    server.admit()
    queued = server.enqueue(prompts, None, priority)

    async def last(seq_id: str, stream: Stream) -> RequestOutput:
        outs = [out async for out in server.outputs(seq_id, stream)]
        return outs[-1]

    async def work() -> Response:
        vectors = []
        for out in await asyncio.gather(*(last(*q) for q in queued)):
            if out.embedding is None:  # it failed
                return server.error(out).response()
            vectors.append(out.embedding)
        tokens = sum(map(len, prompts))
        server.metrics.on_pooled(endpoint, len(prompts), tokens)
        return Response(json.dumps(answer(vectors, tokens)), media_type="application/json")

    return await until_disconnect(request, work())


def _encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or with ``base64`` its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
