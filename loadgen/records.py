"""Per-request records and their crash-safe JSONL writer.

One :class:`RequestRecord` per request (fields in docs/architecture.md). :class:`RecordWriter`
appends each record as one line with a single unbuffered ``write()`` as the request ends, so a killed run leaves
a valid ``requests.jsonl`` holding every finished request.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

ERROR_KINDS = (
    "connect", "timeout", "http_4xx", "http_429", "http_5xx", "stream_error", "protocol",
    "truncated", "disconnect", "stall", "cancelled",
)  # fmt: skip


@dataclass(slots=True)
class RequestRecord:
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
    prompt_tokens: int | None = None
    prompt_tokens_source: str = "unknown"
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


class RecordWriter:
    """Appends records to a JSONL file; every line is flushed when written."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[bytes] = path.open("wb", buffering=0)  # one write() per record, no user-space buffer

    def write(self, rec: RequestRecord) -> None:
        self._f.write(orjson.dumps(rec.to_dict(), option=orjson.OPT_APPEND_NEWLINE))

    def close(self) -> None:
        self._f.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a ``requests.jsonl``; a torn last line (killed mid-write) is skipped."""
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return  # torn write at the very end
            yield orjson.loads(line)
