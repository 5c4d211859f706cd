"""What crosses a layer boundary: the request and record types, the enums, the one JSONL reader.

Workloads are the pipeline's first stage (workload -> arrivals -> dispatcher -> backend -> records ->
metrics -> report), so every later layer may import this module; it imports nothing of the project
(``tests/test_architecture.py`` checks both, and that importing it loads no heavy package). The bundled
model's facts (path, GGUF metadata, tokenizer) live in :mod:`reference_server.model_files`, because the
reference server imports nothing of the harness.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

Api = Literal["completions", "chat", "embeddings", "rerank"]
GENERATION_APIS: tuple[Api, ...] = ("completions", "chat")  # a streamed answer of tokens
# No tokens generated: one JSON answer per request (no stream) for its texts, counted as inputs.
POOLING_APIS: tuple[Api, ...] = ("embeddings", "rerank")
APIS: tuple[Api, ...] = (*GENERATION_APIS, *POOLING_APIS)

# Arrival processes: closed loop, the generated open-loop ones (seeded gaps at a rate), replayed traces.
OPEN_LOOP_PROCESSES = ("constant", "poisson", "gamma")
ARRIVAL_PROCESSES = ("closed", *OPEN_LOOP_PROCESSES, "trace")


ERROR_KINDS = (
    "connect", "timeout", "http_4xx", "http_429", "http_5xx", "stream_error", "protocol",
    "truncated", "disconnect", "stall", "cancelled",
)  # fmt: skip


@dataclass
class GenRequest:
    """One request as the workload generator produced it (protocol-neutral)."""

    request_id: str
    prompt: str | list[dict[str, str]]  # plain text for completions, chat messages for chat
    max_tokens: int
    workload_class: str = "default"
    api: Api = "completions"
    prompt_tokens: int | None = None  # exact length the workload aimed for, when known
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # passed through verbatim
    model: str | None = None  # the served model (or LoRA adapter) asked for; None: the backend's
    # a pooling request's texts: an embeddings request's inputs, a rerank request's documents (its query is
    # ``prompt``); empty: the prompt is the one input (or document)
    inputs: tuple[str, ...] = ()


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request: one line of ``requests.jsonl`` (fields in docs/architecture.md)."""

    id: str
    cls: str = "default"
    warmup: bool = False
    intended: float = 0.0
    sent: float = 0.0
    headers: float | None = None
    end: float = 0.0
    status: int | None = None
    error: dict[str, str] | None = None
    # [[t, tokens], ...]; tokens is None until finish() resolves counts the protocol did not state
    events: list[list[float | None]] = field(default_factory=list)
    first_output: int | None = None  # index of the first answer event (before it: reasoning); None: no answer
    prompt_tokens: int | None = None
    prompt_tokens_source: str = "unknown"
    prompt_tokens_intended: int | None = None  # what the workload's tokenizer made it (None: not known)
    cached_tokens: int | None = None  # of the prompt, served from the server's prefix cache (when it says)
    output_tokens: int | None = None
    output_tokens_source: str = "unknown"
    # how per-event token counts were known: "stated" by the protocol, "one_per_event" (assumed and
    # confirmed by the total) or "spread" (the usage total spread evenly over the events)
    event_tokens: str = "stated"
    finish_reason: str | None = None
    session: str | None = None  # session id for multi-turn workloads
    turn: int = 0
    retries: int = 0  # resent once on a fresh connection: the pooled one was closed before any response byte
    extra: dict[str, Any] = field(default_factory=dict)

    def set_error(self, kind: str, message: str) -> None:
        assert kind in ERROR_KINDS, kind
        self.error = {"kind": kind, "message": message[:500]}

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]


class JsonlError(ValueError):
    """A line of a JSONL file, other than a torn last one, is not JSON."""


def iter_jsonl(path: Path, missing_ok: bool = False) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file that a writer appends one whole line at a time.

    The one torn-line rule: a last line without its newline is a write cut short by a killed process
    and is dropped; any other line that is not JSON raises :class:`JsonlError`. Blank lines are skipped.
    A missing file is empty when ``missing_ok``, else ``FileNotFoundError``.
    """
    if missing_ok and not path.is_file():
        return
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                return
            if not line.strip():
                continue
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise JsonlError(f"{path}:{n} is not valid JSON ({exc})") from None


def read_jsonl(path: Path, missing_ok: bool = False) -> list[dict[str, Any]]:
    """:func:`iter_jsonl` as a list."""
    return list(iter_jsonl(path, missing_ok))
