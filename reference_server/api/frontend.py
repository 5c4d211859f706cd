"""The front end over the engine thread: reads and checks a request, queues it, and answers it whole or as
an SSE stream; engine outputs reach each request's queue in one hop per step (embeddings and rerank: api/pooling.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from reference_server.api.errors import ApiError, clip
from reference_server.api.logprobs import RequestLogprobs, TokenPieces
from reference_server.api.metrics import Metrics
from reference_server.api.schemas import (
    MAX_BODY_BYTES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    StreamOptions,
    TokenizeRequest,
    asks_nothing,
    unsupported,
    validated,
)
from reference_server.engine.engine import Engine, EngineDead, RequestOutput
from reference_server.engine.sequence import SamplingParams

log = logging.getLogger(__name__)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class Stream:
    """One request's side of the engine: its output queue and, when ``timed`` (generation), timing for TTFT/ITL."""

    def __init__(self, timed: bool) -> None:
        self.timed = timed
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.start = time.perf_counter()
        self.last: float | None = None


class Server:
    """One app's handle on the engine: the requests' output queues, the checks, the answers."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = Metrics(engine)
        engine.on_iteration.append(self.metrics.on_iteration)
        engine.on_finish.append(self.metrics.on_finish)
        self.metrics.open.set_function(lambda: len(self.streams))
        self.streams: dict[str, Stream] = {}
        self._noted: set[str] = set()  # unknown request fields already logged
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pieces = TokenPieces(engine.codec.tokenizer)

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
            if st.timed:
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
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, ""):
            raise ApiError(404, f"model {clip(model)} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model", "model_not_found")

    def _params(self, req: GenerationRequest, max_tokens: int) -> SamplingParams:
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
        self.check_priority(req.priority)
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k), seed=req.seed,
            max_tokens=max_tokens, ignore_eos=req.ignore_eos, stop=stop, stop_token_ids=stop_ids,
            logprobs=req.asked_logprobs(),
        )

    def check_priority(self, priority: int) -> None:
        if priority and self.engine.config.policy != "priority":
            raise ApiError(400, f"priority {priority} needs a server started with --policy priority "
                                f"(this one runs --policy {self.engine.config.policy})", "priority")

    def admit(self) -> None:
        """A 429 while --max-waiting requests wait. An embeddings or rerank request is admitted as one request;
        its texts then queue together."""
        if self.engine.num_waiting() >= self.engine.config.max_waiting:
            raise ApiError(429, f"too many requests waiting (--max-waiting {self.engine.config.max_waiting}); "
                                "retry later", None, "queue_full")

    def enqueue(self, prompts: list[list[int]], params: SamplingParams | None,
                 priority: int) -> list[tuple[str, Stream]]:
        """Add one engine request per prompt (``params`` None: pooling requests); a 503 if the engine is dead."""
        queued: list[tuple[str, Stream]] = []
        try:
            for prompt_ids in prompts:
                seq_id = uuid.uuid4().hex
                queued.append((seq_id, Stream(timed=params is not None)))
                self.streams[seq_id] = queued[-1][1]
                self.engine.add_request(prompt_ids, params, seq_id, priority)
        except EngineDead as e:
            for seq_id, _ in queued:
                self.streams.pop(seq_id, None)
            raise ApiError(503, str(e), None, "engine_dead") from None
        return queued

    def _submit(self, prompt_ids: list[int], params: SamplingParams, explicit_max: bool,
                priority: int = 0) -> tuple[str, Stream]:
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
        self.admit()
        return self.enqueue([prompt_ids], params, priority)[0]

    async def outputs(self, seq_id: str, stream: Stream) -> AsyncIterator[RequestOutput]:
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

    def error(self, out: RequestOutput) -> ApiError:
        """The error a failed request answers with: 503 once the engine is gone, else a 500 naming the cause."""
        if not self.engine.alive:
            return ApiError(503, out.error or "the engine stopped", None, "engine_dead")
        return ApiError(500, out.error or "internal error", None, "internal_error")

    async def read_body(self, request: Request) -> dict[str, Any]:
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
    def check_supported(body: dict[str, Any], unsupported: dict[str, tuple[object, ...]]) -> None:
        for name, neutral in unsupported.items():
            if name in body and not asks_nothing(body[name], neutral):
                raise ApiError(400, f"{name!r} is not supported by this server (got {clip(body[name])}); "
                                    "leave it out or send null", name, "unsupported_parameter")

    def note_extra(self, req: BaseModel) -> None:
        """Fields outside the API (and outside the unsupported ones) are accepted, as by vLLM, and logged once."""
        for name in (req.model_extra or {}).keys() - self._noted:
            if len(self._noted) < 1000:
                self._noted.add(name)
                log.warning("request field %s is not part of the API and is ignored", clip(name))

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        try:
            return self.engine.codec.encode(text)
        except (UnicodeError, TypeError) as e:  # lone surrogates (valid JSON, not valid Unicode text)
            raise ApiError(400, f"the {param} is not valid Unicode text: {e}", param) from None

    def chat_prompt(self, req: ChatRequest | TokenizeRequest) -> list[int]:
        assert req.messages is not None
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(p.text for p in m.content)} for m in req.messages]
        try:
            text = self.engine.codec.apply_chat_template(messages)
        except jinja2.TemplateError as e:
            raise ApiError(400, f"the chat template rejects these messages: {e}", "messages") from None
        return self.encode(text)

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            return self.encode(p)
        if len(p) >= self.engine.max_model_len:  # before looking at each id
            raise ApiError(400, f"the prompt has {len(p)} tokens but this model's context holds "
                                f"{self.engine.max_model_len}; shorten the prompt", "prompt", "context_length_exceeded")
        return self.token_ids(p, "prompt", "prompt ")  # type: ignore[arg-type]

    def token_ids(self, ids: list[int], param: str, what: str = "") -> list[int]:
        """Token ids a request gave for a prompt (or an input), each checked to be in the vocabulary."""
        vocab = self.engine.runner.spec.vocab
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{what}token ids must be in [0, {vocab})", param)
        return [int(t) for t in ids]

    def check_alive(self) -> None:
        if not self.engine.alive:
            raise ApiError(503, f"the engine has stopped ({self.engine.fatal or 'shutting down'})", None, "engine_dead")

    async def handle(self, request: Request, chat: bool) -> Response:
        self.check_alive()
        body = await self.read_body(request)
        model = ChatRequest if chat else CompletionRequest
        self.check_supported(body, unsupported(model))
        req = validated(model, body)
        self.check_model(req.model)
        self.note_extra(req)
        if isinstance(req, ChatRequest):
            prompt_ids = await asyncio.to_thread(self.chat_prompt, req)
            asked = req.max_completion_tokens or req.max_tokens
            max_tokens = asked or 0
        else:
            assert isinstance(req, CompletionRequest)
            prompt_ids = await asyncio.to_thread(self._completion_prompt, req)
            asked = req.max_tokens
            max_tokens = asked or 16  # the OpenAI default for completions
        params = self._params(req, max_tokens)
        seq_id, stream = self._submit(prompt_ids, params, asked is not None, req.priority)
        rid = ("chatcmpl-" if chat else "cmpl-") + seq_id
        logprobs = RequestLogprobs(self.pieces, chat, params.logprobs is not None)
        if req.stream:
            opts = req.stream_options or StreamOptions()
            return StreamingResponse(self._sse(rid, seq_id, stream, chat, opts, logprobs),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await until_disconnect(request, self._complete(rid, seq_id, stream, chat, logprobs))

    async def _complete(self, rid: str, seq_id: str, stream: Stream, chat: bool, logprobs: RequestLogprobs) -> Response:
        text, last = [], None
        async for out in self.outputs(seq_id, stream):
            text.append(out.text)
            logprobs.add(out)
            last = out
        assert last is not None
        if last.error is not None:
            return self.error(last).response()
        return Response(json.dumps(self._final(rid, chat, "".join(text), last, logprobs.take())),
                        media_type="application/json")

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                                 "total_tokens": out.prompt_tokens + out.completion_tokens,
                                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
        if self.engine.spec is not None:
            usage["spec_decode"] = {"draft_tokens": out.spec_drafted, "accepted_tokens": out.spec_accepted}
        return usage

    def _final(self, rid: str, chat: bool, text: str, out: RequestOutput,
               logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": logprobs}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": self._usage(out)}

    async def _sse(self, rid: str, seq_id: str, stream: Stream, chat: bool, opts: StreamOptions,
                   logprobs: RequestLogprobs) -> AsyncIterator[bytes]:
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
        async for out in self.outputs(seq_id, stream):
            last = out
            if out.error is not None:  # as vLLM: an error event, then [DONE]
                yield b"data: " + json.dumps(self.error(out).body).encode() + b"\n\n"
                break
            logprobs.add(out)  # a chunk not sent hands its tokens' logprobs to the next one
            if not out.text and not out.finished:
                continue
            if chat:
                delta: dict[str, Any] = {"content": out.text}
                if first:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": out.text}
            choice |= {"logprobs": logprobs.take(), "finish_reason": out.finish_reason}
            first = False
            yield chunk([choice], self._usage(out) if opts.include_usage and opts.continuous_usage_stats else None)
        if opts.include_usage and last is not None and last.error is None:
            yield chunk([], self._usage(last))
        yield b"data: [DONE]\n\n"


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
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
