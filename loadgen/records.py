"""The crash-safe JSONL writer of per-request records.

One :class:`workloads.contracts.RequestRecord` per request (fields in docs/architecture.md), read back with
:func:`workloads.contracts.read_jsonl`. :class:`RecordWriter`
appends each record as one line with a single unbuffered ``write()`` as the request ends, so a killed run leaves
a valid ``requests.jsonl`` holding every finished request.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

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
