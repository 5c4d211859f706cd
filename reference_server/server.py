"""OpenAI-compatible HTTP front end (FastAPI + uvicorn) over the engine thread.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming with ``[DONE]``), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus) and ``GET /v1/iterations?since=N`` (exact per-step records).

One request can never stop the server: bad input is a 4xx naming the field (as strict as vLLM; a field
the server does not implement is rejected unless null or its neutral default, so that vLLM's `bench serve`,
guidellm and the `openai` package work unchanged), a fault while serving one request is a 500 (or an
``error`` event on its stream) for that request alone, a client that goes away has its request aborted
(streaming or not), and if the engine loop ever dies ``/health`` and every request answer 503 at once.

Size: the server's whole HTTP surface: the OpenAI endpoints with their request models and validation,
streaming, /metrics, /v1/iterations and the grouped flag help, one FastAPI app whose routes share the engine
handle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, TypeVar

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from reference_server import metric_names as M
from reference_server.config import EngineConfig
from reference_server.engine import Engine, EngineDead, IterationRecord, RequestOutput
from reference_server.quant import linear_bytes
from reference_server.sequence import SamplingParams

log = logging.getLogger(__name__)

# -- limits ----------------------------------------------------------------------------------------------
MAX_BODY_BYTES = 4 << 20  # a 32k-token prompt is ~0.2 MB as text or as token ids
MAX_STOP_STRINGS = 32  # stop strings are scanned on the engine thread for every token
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds (as vLLM) and priorities


def _neutral(*values: object) -> Callable[[object], bool]:
    """A test for "this field asks for nothing": null or one of ``values`` (same type: True is not 1)."""
    def test(v: object) -> bool:
        return v is None or any(type(v) is type(x) and v == x for x in values) or (
            isinstance(v, float) and any(type(x) is int and v == x for x in values))
    return test


# Fields of the OpenAI/vLLM APIs that this server does not implement: accepted only when they ask for
# nothing (clients such as vLLM's bench serve send ``"logprobs": null, "repetition_penalty": 1.0``),
# otherwise a 400 -- never silently ignored.
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "logprobs": _neutral(False), "top_logprobs": _neutral(0), "prompt_logprobs": _neutral(),
    "echo": _neutral(False), "best_of": _neutral(1), "suffix": _neutral(""),
    "presence_penalty": _neutral(0), "frequency_penalty": _neutral(0), "repetition_penalty": _neutral(1),
    "length_penalty": _neutral(1), "min_p": _neutral(0), "min_tokens": _neutral(0),
    "logit_bias": _neutral({}), "allowed_token_ids": _neutral(), "bad_words": _neutral([]),
    "response_format": _neutral({"type": "text"}), "tools": _neutral([]), "functions": _neutral([]),
    "tool_choice": _neutral("none", "auto"), "function_call": _neutral("none", "auto"),
    "guided_json": _neutral(), "guided_regex": _neutral(), "guided_choice": _neutral(),
    "guided_grammar": _neutral(), "structured_outputs": _neutral(), "prediction": _neutral(),
    "use_beam_search": _neutral(False), "include_stop_str_in_output": _neutral(False),
    "skip_special_tokens": _neutral(True), "truncate_prompt_tokens": _neutral(),
    "add_generation_prompt": _neutral(True), "continue_final_message": _neutral(False),
    "chat_template": _neutral(), "chat_template_kwargs": _neutral({}), "return_tokens_as_token_ids": _neutral(False),
}


# -- request bodies --------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)  # --policy priority: higher first


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart]


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completions ``prompt`` or chat ``messages`` (templated as a chat request is)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's; the prompt is encoded as the completions API encodes it


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict[str, Any]:
        kind = {429: "rate_limit_error", 404: "not_found_error", 413: "request_too_large",
                500: "internal_server_error", 503: "service_unavailable"}.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII JSON: a message quoting the client's text may hold lone surrogates, which UTF-8 cannot
        return Response(json.dumps(self.body), status_code=self.status, media_type="application/json")


def _clip(value: object, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


# -- metrics ---------------------------------------------------------------------------------------------
class Metrics:
    """Prometheus series in a registry of their own (one per app)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge(M.REQUESTS_RUNNING, "Requests in the running batch", registry=r)
        self.waiting = Gauge(M.REQUESTS_WAITING, "Requests waiting for admission", registry=r)
        self.kv_used = Gauge(M.KV_BLOCKS_USED, "KV-cache blocks referenced by requests", registry=r)
        self.kv_total = Gauge(M.KV_BLOCKS_TOTAL, "KV-cache blocks in the pool", registry=r)
        self.preemptions = Counter(M.PREEMPTIONS, "Requests preempted (recomputed later)", registry=r)
        self.prefix_queries = Counter(M.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter(M.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache", registry=r)
        self.iterations = Counter(M.ITERATIONS, "Engine steps", registry=r)
        self.prompt_tokens = Counter(M.PROMPT_TOKENS, "Prompt tokens computed (prefill)", registry=r)
        self.generation_tokens = Counter(M.GENERATION_TOKENS, "Tokens generated (accepted draft tokens included)",
                                         registry=r)
        self.requests = Counter(M.REQUESTS_FINISHED, "Requests ended, by finish reason (stop, length, "
                                "abort: the client went away, error: failed on the server)", ["finish_reason"], registry=r)
        self.alive = Gauge(M.ENGINE_ALIVE, "1 while the engine loop runs, 0 once it has died", registry=r)
        buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        self.tokens_per_iter = Histogram(M.TOKENS_PER_ITERATION, "Tokens computed per engine step",
                                         buckets=buckets, registry=r)
        lat = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
        self.ttft = Histogram(M.TIME_TO_FIRST_TOKEN, "Time to first token", buckets=lat, registry=r)
        self.itl = Histogram(M.INTER_TOKEN_LATENCY, "Time between output tokens", buckets=lat, registry=r)
        self.spec_drafted = Counter(M.SPEC_DRAFT_TOKENS, "Speculative draft tokens verified", registry=r)
        self.spec_accepted = Counter(M.SPEC_ACCEPTED_TOKENS, "Speculative draft tokens accepted", registry=r)
        self.spec_steps = Counter(M.SPEC_VERIFY_STEPS, "Verification passes that carried a draft", registry=r)
        self.kv_total.set(engine.block_manager.num_blocks)
        # read when scraped, so they are current while the engine idles (after aborts, say)
        self.running.set_function(lambda: len(engine.scheduler.running))
        self.waiting.set_function(engine.num_waiting)
        self.kv_used.set_function(lambda: engine.block_manager.num_used)
        self.alive.set_function(lambda: int(engine.alive))
        self.open = Gauge(M.REQUESTS_OPEN, "Requests the HTTP front end holds an output queue for", registry=r)
        self._engine = engine
        self._seen = (0, 0, 0, 0, 0, 0)

    def on_finish(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def on_iteration(self, rec: IterationRecord) -> None:
        """Engine-thread hook: per-step histogram and counter deltas."""
        bm, sch = self._engine.block_manager, self._engine.scheduler
        self.iterations.inc()
        self.prompt_tokens.inc(rec.prefill_tokens)
        self.generation_tokens.inc(rec.output_tokens)
        self.tokens_per_iter.observe(rec.prefill_tokens + rec.decode_tokens)
        spec = self._engine.spec
        now = (sch.num_preemptions, bm.prefix_queries, bm.prefix_hits,
               *((spec.num_drafted, spec.num_accepted, spec.num_steps) if spec else (0, 0, 0)))
        counters = (self.preemptions, self.prefix_queries, self.prefix_hits, self.spec_drafted, self.spec_accepted,
                    self.spec_steps)
        for counter, new, old in zip(counters, now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now


# -- the app ---------------------------------------------------------------------------------------------
class _Stream:
    """One request's side of the engine: its output queue and timing for TTFT/ITL."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.start = time.perf_counter()
        self.last: float | None = None


class Server:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = Metrics(engine)
        engine.on_iteration.append(self.metrics.on_iteration)
        engine.on_finish.append(self.metrics.on_finish)
        self.metrics.open.set_function(lambda: len(self.streams))
        self.streams: dict[str, _Stream] = {}
        self._noted: set[str] = set()  # unknown request fields already logged
        self.loop: asyncio.AbstractEventLoop | None = None

    def sink(self, outputs: list[RequestOutput]) -> None:
        """Engine thread -> event loop, one hop per step."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            st = self.streams.get(out.seq_id)
            if st is None:
                continue
            (self.metrics.ttft.observe(now - st.start) if st.last is None else self.metrics.itl.observe(now - st.last))
            st.last = now
            st.queue.put_nowait(out)

    async def watchdog(self, period: float = 1.0) -> None:
        """Fails the open requests once the engine has died (its loop fails them itself; this is the
        guarantee that no client waits on a dead engine even if that hand-over did not happen)."""
        while self.engine.alive or self.engine.fatal is None:
            await asyncio.sleep(period)
        while True:
            for seq_id, st in list(self.streams.items()):
                st.queue.put_nowait(RequestOutput(seq_id, "", [], True, "error", 0, 0, 0,
                                                  error=f"the engine stopped: {self.engine.fatal}"))
            await asyncio.sleep(period)

    # -- request handling ---------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, ""):
            raise ApiError(404, f"model {_clip(model)} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model", "model_not_found")

    def _params(self, req: _Common, max_tokens: int) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise ApiError(400, "stop strings must not be empty", "stop")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters "
                                f"each (got {len(stop)}, the longest {max(len(s) for s in stop)})", "stop")
        vocab = self.engine.runner.spec.vocab
        stop_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_ids):
            raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        if req.priority and self.engine.config.policy != "priority":
            raise ApiError(400, f"priority {req.priority} needs a server started with --policy priority "
                                f"(this one runs --policy {self.engine.config.policy})", "priority")
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k), seed=req.seed,
            max_tokens=max_tokens, ignore_eos=req.ignore_eos, stop=stop, stop_token_ids=stop_ids,
        )

    def _submit(self, prompt_ids: list[int], params: SamplingParams, explicit_max: bool,
                priority: int = 0) -> tuple[str, _Stream]:
        """Queue the request; ``params.max_tokens`` asked for explicitly must fit the context (as in
        vLLM), the default is cut to what is left of it."""
        limit = self.engine.max_model_len
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens but this model's context holds {limit} "
                                "(prompt and output together); shorten the prompt", "prompt", "context_length_exceeded")
        room = limit - len(prompt_ids)
        if explicit_max and params.max_tokens > room:
            raise ApiError(400, f"this model's context holds {limit} tokens, but {len(prompt_ids)} prompt tokens + "
                                f"{params.max_tokens} max_tokens = {len(prompt_ids) + params.max_tokens}; lower "
                                f"max_tokens to at most {room} or shorten the prompt", "max_tokens",
                           "context_length_exceeded")
        params.max_tokens = min(params.max_tokens, room) if params.max_tokens else room
        if self.engine.num_waiting() >= self.engine.config.max_waiting:
            raise ApiError(429, f"too many requests waiting (--max-waiting {self.engine.config.max_waiting}); "
                                "retry later", None, "queue_full")
        seq_id = uuid.uuid4().hex
        stream = _Stream()
        self.streams[seq_id] = stream
        try:
            self.engine.add_request(prompt_ids, params, seq_id, priority)
        except EngineDead as e:
            self.streams.pop(seq_id, None)
            raise ApiError(503, str(e), None, "engine_dead") from None
        return seq_id, stream

    async def _outputs(self, seq_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """This request's outputs until it finishes; aborts it in the engine if the caller goes away."""
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            self.streams.pop(seq_id, None)
            if not finished:
                self.engine.abort(seq_id)

    def _error(self, out: RequestOutput) -> ApiError:
        """The error a failed request answers with: 503 once the engine is gone, else a 500 naming the cause."""
        if not self.engine.alive:
            return ApiError(503, out.error or "the engine stopped", None, "engine_dead")
        return ApiError(500, out.error or "internal error", None, "internal_error")

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the request, read up to MAX_BODY_BYTES (413 beyond)."""
        too_large = ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", None, "request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body arrived: nothing was queued, nobody reads an answer
            raise ApiError(499, "the client closed the connection") from None
        try:
            body = json.loads(b"".join(chunks), parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    @staticmethod
    def _check_supported(body: dict[str, Any]) -> None:
        for name, neutral in UNSUPPORTED.items():
            if name in body and not neutral(body[name]):
                raise ApiError(400, f"{name!r} is not supported by this server (got {_clip(body[name])}); "
                                    "leave it out or send null", name, "unsupported_parameter")

    def _note_extra(self, req: _Common) -> None:
        """Fields outside the API (and outside UNSUPPORTED) are accepted, as by vLLM, and logged once."""
        for name in (req.model_extra or {}).keys() - self._noted:
            if len(self._noted) < 1000:
                self._noted.add(name)
                log.warning("request field %s is not part of the API and is ignored", _clip(name))

    def _encode(self, text: str) -> list[int]:
        try:
            return self.engine.codec.encode(text)
        except (UnicodeError, TypeError) as e:  # lone surrogates (valid JSON, not valid Unicode text)
            raise ApiError(400, f"the prompt is not valid Unicode text: {e}", "prompt") from None

    def _chat_prompt(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        assert req.messages is not None
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in req.messages]
        try:
            text = self.engine.codec.apply_chat_template(messages)
        except jinja2.TemplateError as e:
            raise ApiError(400, f"the chat template rejects these messages: {e}", "messages") from None
        return self._encode(text)

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            return self._encode(p)
        if len(p) >= self.engine.max_model_len:  # before looking at each id
            raise ApiError(400, f"the prompt has {len(p)} tokens but this model's context holds "
                                f"{self.engine.max_model_len}; shorten the prompt", "prompt", "context_length_exceeded")
        vocab = self.engine.runner.spec.vocab
        if any(not 0 <= t < vocab for t in p):  # type: ignore[operator]
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return [int(t) for t in p]  # type: ignore[arg-type]

    async def handle(self, request: Request, chat: bool) -> Response:
        if not self.engine.alive:
            raise ApiError(503, f"the engine has stopped ({self.engine.fatal or 'shutting down'})", None, "engine_dead")
        body = await self._body(request)
        self._check_supported(body)
        req = _validated(ChatRequest if chat else CompletionRequest, body)
        self._check_model(req.model)
        self._note_extra(req)
        if isinstance(req, ChatRequest):
            prompt_ids = await asyncio.to_thread(self._chat_prompt, req)
            asked = req.max_completion_tokens or req.max_tokens
            max_tokens = asked or 0
        else:
            assert isinstance(req, CompletionRequest)
            prompt_ids = await asyncio.to_thread(self._completion_prompt, req)
            asked = req.max_tokens
            max_tokens = asked or 16  # the OpenAI default for completions
        seq_id, stream = self._submit(prompt_ids, self._params(req, max_tokens), asked is not None, req.priority)
        rid = ("chatcmpl-" if chat else "cmpl-") + seq_id
        if req.stream:
            opts = req.stream_options or StreamOptions()
            return StreamingResponse(self._sse(rid, seq_id, stream, chat, opts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _until_disconnect(request, self._complete(rid, seq_id, stream, chat))

    async def _complete(self, rid: str, seq_id: str, stream: _Stream, chat: bool) -> Response:
        text, last = [], None
        async for out in self._outputs(seq_id, stream):
            text.append(out.text)
            last = out
        assert last is not None
        if last.error is not None:
            return self._error(last).response()
        return Response(json.dumps(self._final(rid, chat, "".join(text), last)), media_type="application/json")

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                                 "total_tokens": out.prompt_tokens + out.completion_tokens,
                                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
        if self.engine.spec is not None:
            usage["spec_decode"] = {"draft_tokens": out.spec_drafted, "accepted_tokens": out.spec_accepted}
        return usage

    def _final(self, rid: str, chat: bool, text: str, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": self._usage(out)}

    async def _sse(self, rid: str, seq_id: str, stream: _Stream, chat: bool, opts: StreamOptions) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
            data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": choices}
            if usage is not None:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        first = True
        last: RequestOutput | None = None
        async for out in self._outputs(seq_id, stream):
            last = out
            if out.error is not None:  # as vLLM: an error event, then [DONE]
                yield b"data: " + json.dumps(self._error(out).body).encode() + b"\n\n"
                break
            if not out.text and not out.finished:
                continue
            if chat:
                delta: dict[str, Any] = {"content": out.text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
            else:
                choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            first = False
            yield chunk([choice], self._usage(out) if opts.include_usage and opts.continuous_usage_stats else None)
        if opts.include_usage and last is not None and last.error is None:
            yield chunk([], self._usage(last))
        yield b"data: [DONE]\n\n"


_M = TypeVar("_M", bound=BaseModel)


def _validated(model: type[_M], body: dict[str, Any]) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"invalid field {_clip(param)}: {err['msg']}", param) from None


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work`` unless the client hangs up first: then cancel it (which aborts its request in the
    engine) instead of computing an answer nobody reads. The body has been read, so the next ASGI
    message is the disconnect."""

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request"; nobody receives it
    return task.result()


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint that parses its JSON itself: ``model``'s schema with its
    definitions inlined (so that it stands alone), plus the unsupported fields, which must be null."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    schema = inline(schema)
    for name in UNSUPPORTED:
        schema["properties"].setdefault(name, {"description": "not supported: null or its neutral default only"})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app; starts the engine thread on startup and stops it on shutdown."""
    server = Server(engine, model_name)

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

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "servelab",
                                             "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return ApiError(503, f"the engine has stopped ({engine.fatal or 'shutting down'})", None,
                            "engine_dead").response()
        return Response(json.dumps({"status": "ok"}), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")  # vLLM's shape: what a client needs to build prompts of exact length for this model
    async def tokenize(request: Request) -> dict[str, Any]:
        req = _validated(TokenizeRequest, await server._body(request))
        server._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give `prompt` (text) or `messages` (chat), one of them", "prompt")
        ids = await asyncio.to_thread(server._chat_prompt if req.messages is not None else
                                      lambda r: server._encode(r.prompt), req)  # fmt: skip
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/reset_prefix_cache")  # vLLM's path (a dev-mode endpoint there): benchmarks reset both alike
    async def reset_prefix_cache() -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/v1/iterations")
    async def iterations(since: int = 0, limit: int = 1000) -> dict[str, Any]:
        recs = engine.iterations_since(since, max(1, min(limit, 10000)))
        nxt = recs[-1].i + 1 if recs else engine.num_iterations
        return {"iterations": [r.to_dict() for r in recs], "next": nxt}

    return app


# -- command line ---------------------------------------------------------------------------------------
# Flag groups in --help order; every EngineConfig field is a flag (``--field-name``) whose group and help are
# its field metadata (config.flag). Choices come from the modules that check them; defaults from EngineConfig.
FLAG_GROUPS = {
    "model": "which model is served, and how it is computed",
    "engine": "KV cache and engine bookkeeping",
    "batching": "how requests are batched into engine steps",
    "scheduling": "which waiting request runs next, and admission",
    "speculation": "speculative decoding",
    "server": "HTTP front end",
}
_HIDDEN = ("model", "step_sleep_ms")  # --model is added by hand; step_sleep_ms is a test-only env knob


def _choices() -> dict[str, tuple[str, ...]]:
    from reference_server.batching import BATCHING
    from reference_server.config import KERNELS, KV_CACHE_DTYPES, QUANTIZATIONS, SPEC_METHODS
    from reference_server.policies import POLICIES

    return {"kernels": KERNELS, "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES, "batching": BATCHING,
            "policy": POLICIES, "spec": SPEC_METHODS}


def build_parser(prog: str = "python -m reference_server") -> argparse.ArgumentParser:
    """The server's flags, grouped, each with its meaning, choices and default."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {name: p.add_argument_group(name, desc) for name, desc in FLAG_GROUPS.items()}
    model, server = groups["model"], groups["server"]
    model.add_argument("--model", type=Path, default=None, help="Llama-architecture GGUF file (default: the "
                       "bundled SmolLM2-135M-Instruct Q4_1)")  # fmt: skip
    model.add_argument("--served-model-name", default=None, help="model id in the API (default: the file's stem)")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    server.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="server log level (default: %(default)s)")  # fmt: skip
    defaults = EngineConfig(model=Path("."))
    choices = _choices()
    for f in fields(EngineConfig):
        if f.name in _HIDDEN:
            continue
        group, text = f.metadata["group"], f.metadata["help"]
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        shown = "" if default is None or "default:" in text else " (default: %(default)s)"
        if isinstance(default, bool):
            groups[group].add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text + shown)
        else:
            kind = {"threads": int, "max_model_len": int, "num_kv_blocks": int, "draft_model": str}.get(f.name, type(default))
            groups[group].add_argument(flag, type=kind, default=default, choices=choices.get(f.name),
                                       help=text + shown)  # fmt: skip
    return p


def serve(argv: list[str] | None = None, prog: str = "python -m reference_server") -> None:
    """Parse ``argv``, load the model, then serve until interrupted (``python -m reference_server``)."""
    from reference_server.model_files import default_model_path

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or default_model_path()
    if not model.is_file():
        raise SystemExit(f"error: model file {model} does not exist")
    t0 = time.perf_counter()
    try:
        config = EngineConfig(model=model, **{f.name: getattr(args, f.name) for f in fields(EngineConfig)
                                               if f.name not in _HIDDEN})
        engine = Engine.on_own_thread(config)
    except ValueError as e:  # bad flag values (batching, policy, speculation) are reported, not raised
        raise SystemExit(f"error: {e}") from None
    threads = f", {engine.runner.threads} threads" if engine.runner.device.type == "cpu" else ""
    threads += (f", kernels {engine.runner.kernels}, weights {engine.runner.quantization_note}: linears "
                f"{linear_bytes(engine.runner.model) / 2**20:.0f} MiB")
    print(f"loaded {model.name} on {engine.runner.device} ({engine.runner.dtype}{threads}) in {time.perf_counter() - t0:.1f} s; "
          f"KV pool {engine.runner.num_blocks} x {config.block_size} tokens, {engine.runner.kv_capacity()}; "
          f"serving on http://{args.host}:{args.port}",
          flush=True)
    uvicorn.run(create_app(engine, args.served_model_name or model.stem), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)
