"""Trace replay: the Mooncake JSONL format and the Azure LLM inference CSV format.

Mooncake (one JSON object per line)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50, ...]}

``timestamp`` is in milliseconds; every hash id stands for one 512-token block of the prompt, and equal
ids mean identical blocks, so requests whose ``hash_ids`` start alike share that prefix. Each block's text
is generated once per hash id (exactly 512 tokens, ending in a newline so it cannot merge with the next
block); the last block holds the remainder of ``input_length``.

Azure (CSV with a header)::

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44

Sessions carry ``at`` = seconds since the first row; the engine sends each at ``at / speedup``. Prompts
are built when ``sessions()`` is called, before the run clock starts, so building them never delays a
send (bound big traces with ``limit``).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from workloads.base import Session, SingleShot, Workload
from workloads.contracts import GenRequest
from workloads.spec import WorkloadSpec
from workloads.text import PromptBuilder, builder_for
from workloads.validation import WorkloadError

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    at: float  # seconds since the trace's first request
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def _int_field(obj: dict[str, object], key: str, source: str, where: str, minimum: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(source, f"{where}.{key}", f"expected an integer >= {minimum}, got {value!r}")
    return value


def read_mooncake(path: Path, limit: int | None = None) -> list[TraceRow]:
    source = str(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(source, where, f"expected a JSON object: {exc.msg}") from exc
            if not isinstance(obj, dict):
                raise WorkloadError(source, where, f"expected a JSON object, got {obj!r}")
            ts = obj.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
                raise WorkloadError(source, f"{where}.timestamp", f"expected a number of ms >= 0, got {ts!r}")
            n_in = _int_field(obj, "input_length", source, where, 1)
            n_out = _int_field(obj, "output_length", source, where, 1)
            ids = obj.get("hash_ids", [])
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise WorkloadError(
                    source, f"{where}.hash_ids", f"expected an array of integers, got {ids!r}"
                )
            blocks = -(-n_in // BLOCK_TOKENS)
            if ids and len(ids) != blocks:
                raise WorkloadError(
                    source, f"{where}.hash_ids",
                    f"expected {blocks} ids (one per {BLOCK_TOKENS}-token block of input_length {n_in}), got {len(ids)}",
                )  # fmt: skip
            rows.append((float(ts), n_in, n_out, tuple(ids)))
            if limit is not None and len(rows) >= limit:
                break
    return _relative([(ts / 1000.0, a, b, h) for ts, a, b, h in rows], source)


def _parse_time(value: str) -> float:
    """Seconds (float) from a number or an ISO-like timestamp with up to 7 fractional digits."""
    try:
        return float(value)
    except ValueError:
        pass
    value = value.strip()
    if "." in value:  # Python parses at most 6 fractional digits
        head, frac = value.rsplit(".", 1)
        digits = "".join(ch for ch in frac if ch.isdigit())
        rest = frac[len(digits) :]
        value = f"{head}.{(digits + '000000')[:6]}{rest}"
    return datetime.fromisoformat(value).timestamp()


def read_azure(path: Path, limit: int | None = None) -> list[TraceRow]:
    source = str(path)
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise WorkloadError(
                source,
                "header",
                f"expected columns TIMESTAMP, ContextTokens, GeneratedTokens; missing {sorted(missing)}",
            )
        for lineno, rec in enumerate(reader, 2):
            where = f"line {lineno}"
            try:
                ts = _parse_time(rec["TIMESTAMP"])
            except ValueError as exc:
                raise WorkloadError(
                    source, f"{where}.TIMESTAMP", f"expected a date-time or seconds, got {rec['TIMESTAMP']!r}"
                ) from exc
            vals = []
            for key in ("ContextTokens", "GeneratedTokens"):
                try:
                    v = int(rec[key])
                except (TypeError, ValueError):
                    v = 0
                if v < 1:
                    raise WorkloadError(
                        source, f"{where}.{key}", f"expected an integer >= 1, got {rec[key]!r}"
                    )
                vals.append(v)
            rows.append((ts, vals[0], vals[1], ()))
            if limit is not None and len(rows) >= limit:
                break
    return _relative(rows, source)


def _relative(rows: list[tuple[float, int, int, tuple[int, ...]]], source: str) -> list[TraceRow]:
    if not rows:
        raise WorkloadError(source, "", "the trace has no requests")
    rows.sort(key=lambda r: r[0])  # stable: equal times keep file order
    t0 = rows[0][0]
    return [TraceRow(ts - t0, a, b, h) for ts, a, b, h in rows]


class _Blocks:
    """Text of each Mooncake hash-id block, generated once per id."""

    def __init__(self, builder: PromptBuilder, seed: int) -> None:
        self.builder, self.seed = builder, seed
        self.full: dict[int, str] = {}

    def block(self, hid: int) -> str:
        if hid not in self.full:
            rng = random.Random(f"{self.seed}:block:{hid}")
            self.full[hid] = self.builder.fill(BLOCK_TOKENS - 1, rng, after="\n")
        return self.full[hid]

    def prompt(self, row: TraceRow) -> str:
        *whole, last = row.hash_ids
        text = "".join(self.block(h) for h in whole)
        rest = row.input_length - BLOCK_TOKENS * len(whole)
        if rest == BLOCK_TOKENS:
            return text + self.block(last)
        return self.builder.fill(rest, random.Random(f"{self.seed}:tail:{last}:{rest}"), before=text)


class TraceWorkload(Workload):
    finite = True

    def __init__(self, spec: WorkloadSpec) -> None:
        if spec.trace is None:
            raise ValueError("TraceWorkload needs a spec with a trace")
        self.spec = spec
        self.name = spec.name
        self.arrival = spec.arrival
        read = read_azure if spec.trace.format == "azure" else read_mooncake
        self.rows = read(spec.trace.path, spec.trace.limit)
        self.builder = builder_for(spec.tokenizer)

    def sessions(self, seed: int) -> Iterator[Session]:
        builder = self.builder
        blocks = _Blocks(builder, seed)
        out: list[Session] = []
        for i, row in enumerate(self.rows):
            if row.hash_ids:
                prompt = blocks.prompt(row)
            else:
                prompt = builder.fill(row.input_length, random.Random(f"{seed}:{i}"))
            req = GenRequest(request_id=f"r{i}", prompt=prompt, max_tokens=row.output_length, workload_class="trace",
                             prompt_tokens=builder.count(prompt))  # fmt: skip
            out.append(SingleShot(req, at=row.at))
        return iter(out)

    def describe(self) -> dict[str, object]:
        trace = self.spec.trace
        assert trace is not None
        return {"name": self.name, "trace": str(trace.path), "format": trace.format, "limit": trace.limit,
                "requests": len(self.rows), "duration_s": self.rows[-1].at, "tokenizer": self.spec.tokenizer}  # fmt: skip
