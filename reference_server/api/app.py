"""The FastAPI app: the OpenAI endpoints (embeddings included), ``/v1/rerank``, ``/v1/models``, ``/health``,
``/metrics``, ``/tokenize``, ``/reset_prefix_cache`` and ``/v1/iterations`` over one front end, and the JSON error
handlers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from reference_server.api import pooling
from reference_server.api.errors import ApiError
from reference_server.api.frontend import Server
from reference_server.api.schemas import (
    GENERATION_RESPONSES,
    HEALTH_RESPONSES,
    POOLING_RESPONSES,
    TOKENIZE_RESPONSES,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    TokenizeRequest,
    embedding_schema,
    generation_schema,
    rerank_schema,
    tokenize_schema,
    validated,
)
from reference_server.engine.engine import Engine

log = logging.getLogger(__name__)


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app; starts the engine thread on startup and stops it on shutdown."""
    server = Server(engine, model_name)

    vocab, priorities = engine.runner.spec.vocab, engine.config.policy == "priority"

    def schema(model: type[GenerationRequest]) -> dict[str, Any]:
        return generation_schema(model, vocab, engine.max_model_len, priorities)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        engine.start(server.sink)
        watchdog = asyncio.create_task(server.watchdog())
        yield
        watchdog.cancel()
        engine.stop()

    app = FastAPI(title="servelab reference server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Response:  # a JSON 500 naming the cause, not a bare one
        log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error").response()

    @app.post("/v1/completions", openapi_extra=schema(CompletionRequest), responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=schema(ChatRequest), responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.post("/v1/embeddings", openapi_extra=embedding_schema(vocab, engine.max_model_len, priorities),
              responses=POOLING_RESPONSES)
    async def embeddings(request: Request) -> Response:
        return await pooling.embeddings(server, request)

    @app.post("/v1/rerank", openapi_extra=rerank_schema(priorities), responses=POOLING_RESPONSES)
    async def rerank(request: Request) -> Response:
        return await pooling.rerank(server, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "servelab",
                                             "max_model_len": engine.max_model_len}]}

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> Response:
        if not engine.alive:
            return ApiError(503, f"the engine has stopped ({engine.fatal or 'shutting down'})", None,
                            "engine_dead").response()
        return Response(json.dumps({"status": "ok"}), media_type="application/json")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=tokenize_schema(), responses=TOKENIZE_RESPONSES)  # vLLM's shape: what a client needs to build prompts of exact length for this model
    async def tokenize(request: Request) -> dict[str, Any]:
        req = validated(TokenizeRequest, await server.read_body(request))
        server.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give `prompt` (text) or `messages` (chat), one of them", "prompt")
        ids = await asyncio.to_thread(server.chat_prompt if req.messages is not None else
                                      lambda r: server.encode(r.prompt), req)  # fmt: skip
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/reset_prefix_cache")  # vLLM's path (a dev-mode endpoint there): benchmarks reset both alike
    async def reset_prefix_cache() -> Response:
        engine.reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/iterations")
    async def iterations(since: int = 0, limit: int = 1000) -> dict[str, Any]:
        recs = engine.iterations_since(since, max(1, min(limit, 10000)))
        nxt = recs[-1].i + 1 if recs else engine.num_iterations
        return {"iterations": [r.to_dict() for r in recs], "next": nxt}

    return app
