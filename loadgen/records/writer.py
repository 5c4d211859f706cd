"""The crash-safe writers of results: the JSONL writer of per-request records, and :func:`write_json`.

One :class:`workloads.contracts.RequestRecord` per request (fields in docs/architecture.md), read back with
:func:`workloads.contracts.read_jsonl`. :class:`RecordWriter`
appends each record as one line with a single unbuffered ``write()`` as the request ends, so a killed run leaves
a valid ``requests.jsonl`` holding every finished request.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

import orjson

from workloads.contracts import RequestRecord


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


def write_json(path: Path, obj: Any, *, sort_keys: bool = False) -> None:
    """Write a results JSON document whole or not at all: to a temporary file beside it, then renamed over
    it, so a reader (or a run killed mid-write) never sees half a document. Indented; values JSON does not
    know are written as their ``str``; a newline at the end."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str, sort_keys=sort_keys) + "\n", encoding="utf-8")
    tmp.replace(path)


def lines_from(path: Path, offset: int) -> bytes:
    """The complete lines of a record file after its first ``offset`` bytes."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return b""
    return data[: data.rfind(b"\n") + 1]
