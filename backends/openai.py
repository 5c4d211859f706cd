"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` with streaming.

Asks for ``stream_options.include_usage`` (exact totals in a last usage-only chunk) and, optionally,
``continuous_usage_stats`` (vLLM: cumulative usage in every chunk, which gives exact tokens per event).
``ignore_eos`` is sent so output lengths are what the workload asked for; servers that do not know it
ignore it. A chat delta's ``reasoning_content`` (llama.cpp ``--reasoning-format deepseek``, SGLang, DeepSeek,
vLLM before 0.10) or ``reasoning`` (vLLM since) is the model's reasoning, kept apart from its answer. Anything in ``GenRequest.extra_body`` and the backend's ``extra_body`` is passed verbatim.

The pooling APIs are one JSON answer each: ``/v1/embeddings`` (OpenAI's ``input`` list, ``data`` of one
``embedding`` per input, ``usage.prompt_tokens``) and ``/v1/rerank`` (Jina's and Cohere's ``query`` and
``documents``, ``results`` of a ``relevance_score`` each, ``usage.total_tokens``), as vLLM, llama-server
(``--embeddings``, ``--reranking``), SGLang, TGI's router and the reference server serve them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from backends.base import Backend, BackendOptions, Delta, HttpCall, ParseState, loads_json
from workloads.contracts import POOLING_APIS, Api, GenRequest

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's (the project runs on 3.10); annotations stay unevaluated
    from typing import Unpack

PATHS: dict[Api, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
                         "embeddings": "/v1/embeddings", "rerank": "/v1/rerank"}  # every Api  # fmt: skip
_DONE = Delta(done=True)


class _ChatDelta(msgspec.Struct, gc=False):
    content: str | None = None


class _Choice(msgspec.Struct, gc=False):
    text: str | None = None
    delta: _ChatDelta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class _Usage(msgspec.Struct, gc=False):
    completion_tokens: None = None  # a chunk that carries a count is not plain: it fails to decode


class _PlainChunk(msgspec.Struct, gc=False):
    """The fields of a stream chunk that decide whether it is a plain content event (others skipped)."""

    choices: list[_Choice]
    usage: _Usage | None = None


_CHUNK = msgspec.json.Decoder(_PlainChunk)


class OpenAIBackend(Backend):
    name = "openai"

    def __init__(self, base_url: str, *, continuous_usage: bool = False, **options: Unpack[BackendOptions]) -> None:
        super().__init__(base_url, **options)
        self.continuous_usage = continuous_usage

    def build(self, req: GenRequest) -> HttpCall:
        api = self.api or req.api
        if api in POOLING_APIS:
            return self._pooling(req, api)
        body: dict[str, Any] = {"model": req.model or self.model or "default", "max_tokens": req.max_tokens}
        if api == "chat":
            prompt = req.prompt
            body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        else:
            body["prompt"] = req.prompt if isinstance(req.prompt, str) else _flatten_chat(req.prompt)
        body["stream"] = True
        options: dict[str, bool] = {"include_usage": True}
        if self.continuous_usage:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
        body["temperature"] = req.temperature
        if req.ignore_eos:
            body["ignore_eos"] = True
        if req.seed is not None:
            body["seed"] = req.seed
        body.update(self.body_extras(req.extra_body))
        # chat: the server wraps the messages in its chat template, tokens no workload counted
        return HttpCall(PATHS[api], body, self.auth_headers(), counted=api != "chat")

    def _pooling(self, req: GenRequest, api: Api) -> HttpCall:
        """An embeddings request (the request's inputs, else its prompt) or a rerank request (its prompt the
        query, its inputs the documents, else the prompt itself)."""
        text = req.prompt if isinstance(req.prompt, str) else _flatten_chat(req.prompt)
        texts = list(req.inputs) or [text]
        body: dict[str, Any] = {"model": req.model or self.model or "default"}
        if api == "embeddings":
            body.update(input=texts, encoding_format="float")
        else:
            body.update(query=text, documents=texts)
        body.update(self.body_extras(req.extra_body))
        return HttpCall(PATHS[api], body, self.auth_headers(), stream=False, counted=api == "embeddings")

    def parse_body(self, data: str, call: HttpCall) -> Delta:
        obj = loads_json(data)
        embeddings = "input" in call.body
        key, sent = ("data", len(call.body["input"])) if embeddings else ("results", len(call.body["documents"]))
        top_n = call.body.get("top_n")
        expected = min(sent, top_n) if isinstance(top_n, int) and top_n > 0 and not embeddings else sent
        items = obj.get(key) if isinstance(obj, dict) else None
        if not isinstance(items, list) or len(items) != expected:
            got = f"{len(items)}" if isinstance(items, list) else "none"
            raise ValueError(f"expected {expected} {'embeddings' if embeddings else 'rerank results'} in {key!r}, "
                             f"got {got}: {data[:120]!r}")  # fmt: skip
        field = "embedding" if embeddings else "relevance_score"
        if not all(isinstance(it, dict) and _answers(it.get(field)) for it in items):
            raise ValueError(f"an item of {key!r} has no {field}: {data[:120]!r}")
        usage = obj.get("usage") or {}
        prompt = usage.get("prompt_tokens", usage.get("total_tokens")) if isinstance(usage, dict) else None
        return Delta(prompt_tokens=prompt if isinstance(prompt, int) else None, completion_tokens=0,
                     tokens_source="usage", done=True, extra={"inputs": sent})  # fmt: skip

    def plain_texts(self, payloads: list[bytes]) -> list[str]:
        # Only where parse() is this class's: a subclass that reads more (e.g. llama.cpp timings) must
        # see every event. Each payload is decoded on its own against the schema of a plain chunk; the
        # first that does not fit (bad JSON, usage counts, token ids, finish reason...) ends the run and
        # is left to parse(), which reports or reads it.
        if type(self).parse is not OpenAIBackend.parse:
            return []
        out: list[str] = []
        decode = _CHUNK.decode
        for raw in payloads:
            try:
                choice = decode(raw).choices[0]
            except (msgspec.DecodeError, UnicodeDecodeError, IndexError):
                break
            if choice.finish_reason is not None or choice.token_ids is not None:
                break
            delta = choice.delta
            if delta is None:
                out.append(choice.text or "")
            elif text := delta.content:
                out.append(text)
            else:
                break  # an empty delta or reasoning: parse() decides
        return out

    def parse(self, data: str, state: ParseState) -> list[Delta]:
        if data == "[DONE]":
            return [_DONE]
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"stream event is not JSON: {exc}: {data[:120]!r}") from exc
        if type(obj) is not dict:
            raise ValueError(f"stream event is not a JSON object: {data[:120]!r}")
        choices = obj.get("choices")
        usage = obj.get("usage")
        if not choices:
            if "error" in obj:
                err = obj["error"]
                return [Delta(error=str(err.get("message", err) if isinstance(err, dict) else err))]
            return [_final_usage(usage)] if usage else []  # the final usage-only chunk
        choice = choices[0]
        delta = choice.get("delta")
        thought = (delta.get("reasoning_content") or delta.get("reasoning") or "") if delta else ""
        text = (delta.get("content") or _tool_call_text(delta.get("tool_calls"))) if delta else choice.get("text") or ""
        out = Delta(text=text or thought, reasoning=not text and bool(thought), finish_reason=choice.get("finish_reason"))
        ids = choice.get("token_ids")
        if ids is not None:
            out.tokens, out.tokens_source = len(ids), "token_ids"
        if usage and not self.continuous_usage:
            # Usage on a content chunk without continuous usage requested is the final total (llama.cpp
            # puts it on the finish_reason chunk), never a per-chunk count.
            return [out, _final_usage(usage)]
        if ids is None and usage and usage.get("completion_tokens") is not None:  # continuous usage stats
            total = usage["completion_tokens"]
            out.tokens, out.tokens_source = total - state.completion_tokens, "chunk_usage"
            state.completion_tokens = total
            out.prompt_tokens = usage.get("prompt_tokens")
            if spec := _spec_counts(usage):
                out.extra["spec_decode"] = spec
        return [out]


def _final_usage(usage: dict[str, Any]) -> Delta:
    """The request's final usage totals (and speculative-decoding counts and reasoning tokens when the server
    reports them: ``completion_tokens_details.reasoning_tokens``, OpenAI's and vLLM's field)."""
    spec = _spec_counts(usage)
    details = usage.get("completion_tokens_details")
    thought = details.get("reasoning_tokens") if isinstance(details, dict) else None
    extra: dict[str, Any] = {"spec_decode": spec} if spec else {}
    if isinstance(thought, int) and not isinstance(thought, bool):
        extra["reasoning_tokens"] = thought
    return Delta(
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=cached_tokens(usage),
        tokens_source="usage",
        extra=extra,
    )


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``: the prompt tokens a prefix cache served (vLLM with
    ``--enable-prompt-tokens-details``, llama-server, SGLang with ``--enable-cache-report``, the reference
    server); None where the server does not say."""
    details = usage.get("prompt_tokens_details")
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _spec_counts(usage: dict[str, Any]) -> dict[str, int] | None:
    """``usage.spec_decode`` (the reference server): ``{"drafted": n, "accepted": m}``."""
    sd = usage.get("spec_decode")
    if not isinstance(sd, dict):
        return None
    drafted, accepted = sd.get("draft_tokens"), sd.get("accepted_tokens")
    if not isinstance(drafted, int) or not isinstance(accepted, int):
        return None
    return {"drafted": drafted, "accepted": accepted}


def _tool_call_text(calls: object) -> str:
    """A streamed ``tool_calls`` delta as output: the function's name and arguments so far are what the model
    generated (vLLM, SGLang and llama.cpp stream them in pieces, with no ``content``)."""
    if not isinstance(calls, list):
        return ""
    fns = [c.get("function") for c in calls if isinstance(c, dict)]
    return "".join(f"{f.get('name') or ''}{f.get('arguments') or ''}" for f in fns if isinstance(f, dict))


def _answers(value: object) -> bool:
    """An embedding (a non-empty list of numbers, or base64 text) or a relevance score (a number)."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, int | float) for v in value[:4])
    return isinstance(value, str) and bool(value) or isinstance(value, int | float) and not isinstance(value, bool)


def _flatten_chat(messages: list[dict[str, str]]) -> str:
    return "\n".join(m.get("content", "") for m in messages)
