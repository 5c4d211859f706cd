"""Request bodies of the OpenAI endpoints, ``/v1/rerank`` and ``/tokenize`` (pydantic, as strict as vLLM), their
limits, the fields this server does not implement, and the OpenAPI schema of a body the endpoint parses itself."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from reference_server.api.errors import ApiError, clip

MAX_BODY_BYTES = 4 << 20  # a 32k-token prompt is ~0.2 MB as text or as token ids
MAX_STOP_STRINGS = 32  # stop strings are scanned on the engine thread for every token
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_POOLING_INPUTS = 2048  # texts of an embeddings request (OpenAI's limit), documents of a rerank
MAX_LOGPROBS = 20  # top alternatives per output token a request may ask for (vLLM's default max_logprobs)


def _integral(v: object) -> object:
    return int(v) if type(v) is float and v.is_integer() else v


# Seeds (as vLLM: 64-bit) and priorities. JSON Schema checkers compare integers as doubles, where near 2**63
# 512 neighbours round alike (2**63 - 1 and 2**63 are one double): a bound that is a double, compared as a
# double here too, gives client and server one answer. +-(2**63 - 1024) keeps every value within int64.
INT64_BOUND = 2**63 - 1024


def _int64(v: int) -> int:
    if abs(v) > 2**64 or abs(float(v)) > INT64_BOUND:  # the first test: float() of a huge int overflows
        raise ValueError(f"must be within +-{INT64_BOUND}")
    return v


# An integer as JSON Schema has it: 3.0 is one (a JSON number with no fraction), "3" and True are not.
Int = Annotated[int, BeforeValidator(_integral)]
Int64 = Annotated[Int, AfterValidator(_int64)]


def int64(default: int | None) -> Any:
    """A 64-bit integer field (see INT64_BOUND)."""
    return Field(default=default, json_schema_extra={"minimum": -INT64_BOUND, "maximum": INT64_BOUND})


# Fields of the OpenAI/vLLM APIs that this server does not implement, each with the values that ask for
# nothing: accepted only as null or one of those (clients such as vLLM's bench serve send ``"logprobs": null,
# "repetition_penalty": 1.0``), otherwise a 400 -- never silently ignored. The OpenAPI schema says the same.
# A field that the endpoint's request model defines is supported there (``top_logprobs``: chat's).
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "top_logprobs": (0,), "prompt_logprobs": (), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "length_penalty": (1,), "min_p": (0,), "min_tokens": (0,), "logit_bias": ({},), "allowed_token_ids": (),
    "bad_words": ([],), "response_format": ({"type": "text"},), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "structured_outputs": (), "prediction": (),
    "use_beam_search": (False,), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "chat_template": (), "chat_template_kwargs": ({},), "return_tokens_as_token_ids": (False,),
}


# The same for the fields of the embeddings and rerank APIs (OpenAI's, vLLM's) that this server does not
# implement: ``dimensions`` (no Matryoshka truncation), ``truncate_prompt_tokens``, ``normalize: false``.
POOLING_UNSUPPORTED: dict[str, tuple[object, ...]] = {"dimensions": (), "truncate_prompt_tokens": (),
                                                      "normalize": (True,)}


def asks_nothing(value: object, neutral: tuple[object, ...]) -> bool:
    """``value`` is null or one of ``neutral``, compared as JSON values are (True is not 1; 1.0 is 1)."""
    return value is None or any(
        type(value) is type(x) and value == x or (type(value) is float and type(x) is int and value == x) for x in neutral)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(BaseModel):
    """The fields that completions and chat requests share; :meth:`asked_logprobs` reads their own."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=-1)
    seed: Int64 | None = int64(None)
    n: Int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    priority: Int64 = int64(0)  # --policy priority: higher first

    def asked_logprobs(self) -> int | None:
        """How many top logprobs per output token the request asks for (0: the chosen token's only), or None."""
        raise NotImplementedError


def unsupported(model: type[GenerationRequest]) -> dict[str, tuple[object, ...]]:
    """The UNSUPPORTED fields of ``model``'s endpoint: those it does not define."""
    return {name: neutral for name, neutral in UNSUPPORTED.items() if name not in model.model_fields}


def _false_is_null(v: object) -> object:
    return None if v is False else v


_TOP = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}


class CompletionRequest(GenerationRequest):
    # One prompt, never empty (the front end says so in words; the schema tells a client generated from it):
    # text, token ids, or vLLM's list of texts holding one.
    prompt: str | list[Int] | list[str] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1}]})
    # false: this server's neutral value before it gave logprobs
    logprobs: Annotated[Int | None, BeforeValidator(_false_is_null)] = Field(
        default=None, ge=0, le=MAX_LOGPROBS, json_schema_extra={"anyOf": [_TOP, {"type": "null"}, {"const": False}]},
        description="each output token's raw logprob (before temperature, top-k, top-p) and this many top ones "
                    "(OpenAI's legacy shape); null or false: none")

    def asked_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart]


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=None, description="each output token's raw logprob (before temperature, "
                                                           "top-k, top-p)")
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                     description="and this many top ones per token; above 0 needs logprobs true")

    def asked_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:  # as vLLM and OpenAI
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


class PoolingRequest(BaseModel):
    """The fields that embeddings and rerank requests share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    priority: Int64 = int64(0)  # --policy priority: higher first


class EmbeddingRequest(PoolingRequest):
    """OpenAI's ``POST /v1/embeddings``. ``input``: one text, texts, one token-id list, or token-id lists; never
    empty (the front end says so in words, the schema of :func:`embedding_schema` tells a client)."""

    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused


Document = Annotated[str, Field(min_length=1)]


class RerankRequest(PoolingRequest):
    """The Jina/Cohere ``POST /v1/rerank`` that vLLM and llama-server serve; ``top_n`` 0 or null: every document."""

    query: str = Field(min_length=1)
    documents: list[Document] = Field(min_length=1, max_length=MAX_POOLING_INPUTS)
    top_n: Int | None = Field(default=None, ge=0)
    return_documents: bool | None = None  # null: true


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completions ``prompt`` or chat ``messages`` (templated as a chat request is)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's; the prompt is encoded as the completions API encodes it


_M = TypeVar("_M", bound=BaseModel)


def validated(model: type[_M], body: dict[str, Any]) -> _M:
    """``body`` as ``model``, or a 400 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"invalid field {clip(param)}: {err['msg']}", param) from None


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def body_schema(model: type[BaseModel], unsupported: dict[str, tuple[object, ...]] | None = None) -> dict[str, Any]:
    """The OpenAPI request body of an endpoint that parses its JSON itself: ``model``'s schema with its
    definitions inlined (so that it stands alone), plus the endpoint's ``unsupported`` fields, each null or a
    value that asks for nothing."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            keys = _BOUNDS if "type" in node else {}  # a validated Int | None leaks pydantic's own names
            return {keys.get(k, k): inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    schema = inline(schema)
    for name, neutral in (unsupported or {}).items():
        schema["properties"].setdefault(name, {"description": "not supported: null or a value that asks for nothing",
                                               "enum": [None, *neutral]})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _served_schema(model: type[BaseModel], unsupported: dict[str, tuple[object, ...]],
                   priorities: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`body_schema` with, without ``priorities`` (no ``--policy priority``), a priority of 0; and its
    properties, to add to."""
    extra = body_schema(model, unsupported)
    props = extra["requestBody"]["content"]["application/json"]["schema"]["properties"]
    if not priorities:
        props["priority"] = {"const": 0, "description": "0 only: this server runs without --policy priority"}
    return extra, props


def _token_id(vocab: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": vocab - 1}


def generation_schema(model: type[GenerationRequest], vocab: int, max_model_len: int, priorities: bool) -> dict[str, Any]:
    """:func:`body_schema` of a completions or chat request with what this server's model and flags allow:
    token ids below ``vocab``, a token-id prompt shorter than ``max_model_len``, stop strings as
    ``Server._params`` checks them, and without ``priorities`` (no ``--policy priority``) a priority of 0.
    What a schema cannot say, prompt tokens + max_tokens within the context, stays a 400
    ``context_length_exceeded``."""
    extra, props = _served_schema(model, unsupported(model), priorities)
    token_id = _token_id(vocab)
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    props["stop"] = {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]}
    props["stop_token_ids"] = {"anyOf": [{"type": "array", "items": token_id, "maxItems": MAX_STOP_TOKEN_IDS},
                                         {"type": "null"}]}
    if "prompt" in props:
        props["prompt"]["anyOf"][1].update(items=token_id, maxItems=max_model_len - 1)
    if "top_logprobs" in model.model_fields:  # chat: top_logprobs above 0 needs logprobs true
        extra["requestBody"]["content"]["application/json"]["schema"]["anyOf"] = [
            {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            {"properties": {"top_logprobs": {"enum": [0, None]}}}]
    return extra


def embedding_schema(vocab: int, max_model_len: int, priorities: bool) -> dict[str, Any]:
    """:func:`body_schema` of an embeddings request (see :func:`generation_schema`): ``input`` never empty, at
    most MAX_POOLING_INPUTS texts or token-id lists, token ids below ``vocab``, a token-id input of at most
    ``max_model_len`` (an embedding needs no room for output). A text longer than the context stays a 400
    ``context_length_exceeded``."""
    extra, props = _served_schema(EmbeddingRequest, POOLING_UNSUPPORTED, priorities)
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": _token_id(vocab), "minItems": 1, "maxItems": max_model_len}
    props["input"] = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_POOLING_INPUTS},
                                ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": MAX_POOLING_INPUTS}]}
    return extra


def rerank_schema(priorities: bool) -> dict[str, Any]:
    """:func:`body_schema` of a rerank request (see :func:`embedding_schema`)."""
    return _served_schema(RerankRequest, POOLING_UNSUPPORTED, priorities)[0]


def _error(what: str) -> dict[str, Any]:
    props = {"message": {"type": "string"}, "type": {"type": "string"},
             "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}
    body = {"type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": props}}}
    return {"description": what, "content": {"application/json": {"schema": body}}}


# The error responses each endpoint can give (ApiError's body), documented so that a client generated from
# /openapi.json knows them.
BAD_REQUEST = {400: _error("an invalid request: the message names the field"),
               413: _error("the request body is over MAX_BODY_BYTES")}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion: JSON, or with `stream: true` server-sent events (`data: {...}` chunks, "
                         "then `data: [DONE]`)",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {}}}},
    **BAD_REQUEST,
    404: _error("the model named is not the one this server serves"),
    429: _error("too many requests waiting (--max-waiting)"),
    503: _error("the engine has stopped"),
}
POOLING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the embeddings, or the documents ranked", "content": {"application/json": {"schema": {"type": "object"}}}},
    **{status: GENERATION_RESPONSES[status] for status in (400, 413, 404, 429, 503)},
}
TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {**BAD_REQUEST, 404: GENERATION_RESPONSES[404]}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: GENERATION_RESPONSES[503]}


def tokenize_schema() -> dict[str, Any]:
    """``/tokenize``'s body: :class:`TokenizeRequest`, with exactly one of ``prompt`` and ``messages`` given."""
    extra = body_schema(TokenizeRequest)
    schema = extra["requestBody"]["content"]["application/json"]["schema"]
    schema["anyOf"] = [{"required": [one], "properties": {one: {"not": {"type": "null"}}, other: {"type": "null"}}}
                       for one, other in (("prompt", "messages"), ("messages", "prompt"))]
    return extra
