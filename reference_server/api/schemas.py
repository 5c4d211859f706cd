"""Request bodies of the OpenAI endpoints and ``/tokenize`` (pydantic, as strict as vLLM), their limits, the
fields this server does not implement, and the OpenAPI schema of a body the endpoint parses itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reference_server.api.errors import ApiError, clip

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(BaseModel):
    """The fields that completions and chat requests share."""

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


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str]


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
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completions ``prompt`` or chat ``messages`` (templated as a chat request is)."""

    model_config = ConfigDict(extra="allow")
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


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
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
