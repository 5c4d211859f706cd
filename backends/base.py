"""The backend contract: one generation request in, a stream of timed events out.

A backend knows a server's wire protocol (path, body, how to read its stream and its counters) and
nothing about metrics. The load engine (``loadgen``) owns the HTTP client and the clock; a backend
builds the HTTP call and turns each SSE ``data:`` payload into :class:`Delta` values.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypedDict

from workloads.contracts import APIS, Api, GenRequest

TokenSource = Literal["usage", "chunk_usage", "token_ids", "tokens_field", "tokenizer", "events", "unknown"]


@dataclass
class HttpCall:
    """What a backend wants sent: always a POST with a JSON body on the base URL. A call that is not a stream
    (``stream`` false: an embeddings or rerank request) gets one JSON answer, read by :meth:`Backend.parse_body`."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = True
    # the server's prompt count can be compared with the request's intended one (not a chat request's: the
    # server adds its template; nor a rerank's: it counts the query once per document)
    counted: bool = True


@dataclass
class Delta:
    """What one stream event carried, as far as the protocol tells.

    ``tokens`` is the number of new output tokens in this event when the protocol states it (per-chunk
    usage, token ids, per-token events); ``None`` means the event carried text of unknown token count.
    """

    text: str = ""
    reasoning: bool = False  # the text is the model's reasoning (a thinking model's), not its answer
    tokens: int | None = None
    tokens_source: TokenSource = "unknown"
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # from usage, when present
    completion_tokens: int | None = None  # cumulative total from usage, when present
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served, when it says
    error: str | None = None  # an in-stream error event
    done: bool = False  # end marker ([DONE] or the protocol's final event)
    extra: dict[str, Any] = field(default_factory=dict)  # protocol-specific (e.g. llama.cpp timings)


class ParseState:
    """Per-request mutable state a backend may need while parsing (e.g. cumulative text/usage)."""

    def __init__(self) -> None:
        self.text_so_far = ""
        self.completion_tokens = 0
        self.extra: dict[str, Any] = {}


class BackendOptions(TypedDict, total=False):
    """What :class:`Backend` takes after the base URL, for a subclass that adds keyword-only options of its own
    and passes these on as ``**options: Unpack[BackendOptions]``."""

    model: str | None
    api_key: str | None
    api: Api | None
    extra_body: dict[str, Any] | None


class Backend(ABC):
    """A server dialect. Subclasses register under ``name`` (see ``backends.registry``).

    Takes the options ``bench`` gives every backend: the model, the API key (never serialised: see
    :meth:`describe`), the API that overrides ``GenRequest.api`` when set (see :meth:`check_api`) and the
    pass-through body fields (see :meth:`body_extras`).
    """

    name: ClassVar[str]

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        api: Api | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.check_api(api)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key  # never serialised: see describe()
        self.api = api
        self.extra_body = dict(extra_body or {})

    @classmethod
    def check_api(cls, api: str | None) -> None:
        """Raise ``ValueError`` for an ``api`` this dialect does not speak: by default one that is not an
        :data:`~workloads.contracts.Api`; a dialect that speaks fewer says so here."""
        if api is not None and api not in APIS:
            raise ValueError(f"api must be one of {sorted(APIS)}, got {api!r}")

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def body_extras(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The backend's and then the request's (``extra``) pass-through body fields."""
        return {**self.extra_body, **extra}

    @abstractmethod
    def build(self, req: GenRequest) -> HttpCall:
        """The HTTP call for ``req``."""

    @abstractmethod
    def parse(self, data: str, state: ParseState) -> list[Delta]:
        """Turn one SSE ``data:`` payload into deltas (empty list for keep-alives)."""

    def parse_body(self, data: str, call: HttpCall) -> Delta:
        """The whole JSON answer to a call that is not a stream (``call.stream`` false), as one final delta
        (``extra["inputs"]``: the texts it answered); raises ``ValueError`` for an answer that is not one."""
        raise ValueError(f"{self.name} sends no request without a stream")

    def plain_texts(self, payloads: list[bytes]) -> list[str]:
        """Fast path for the hot loop: the texts of the longest leading run of ``payloads`` (raw
        ``data:`` bytes) that are plain content events, i.e. events whose :meth:`parse` would give
        exactly one ``Delta(text=...)`` with every other field at its default. The load engine sends the
        rest through :meth:`parse`. Default: no fast path."""
        return []

    def describe(self) -> dict[str, Any]:
        """What goes into results: never the API key."""
        return {"backend": self.name, "base_url": self.base_url, "model": self.model}


def loads_json(data: str) -> Any:
    """``json.loads`` with the error message the records want."""
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"stream event is not JSON: {exc.msg} at {exc.pos}: {data[:120]!r}") from exc
