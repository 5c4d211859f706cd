"""Recorded traffic: ShareGPT conversations, a JSONL of OpenAI request bodies, a text column of a JSONL.

ShareGPT (``.json``, ``format = "sharegpt"``): an array of ``{"conversations": [{"from": "human", "value":
...}, {"from": "gpt", "value": ...}, ...]}`` (``conversation``/``messages`` and ``role``/``content`` are read
too). Each conversation is one session: its user turns in order, each asking for as many tokens as the
recorded reply has (counted with the workload's tokenizer, as vLLM's ShareGPT loader does), each sent with the
history so far, the server's own replies in it. A ``system`` turn opens the history.

Request bodies (``.jsonl`` whose lines have ``messages`` or ``prompt``, ``format = "openai"``): one request per
line, sent as recorded: ``messages`` on the chat API, ``prompt`` on completions, ``max_tokens`` (or
``max_completion_tokens``), and every other field but those the backend sets (``model``, ``stream``...) passed
through (``tools``, ``tool_choice``, ``temperature``, ``stop``...). An optional ``timestamp`` (seconds, on
every line or on none) is its send time.

A text column (``format = "text"``, ``field = NAME``; on the command line ``--dataset-field NAME``): one
request per line, the prompt the line's ``NAME``, ``max_tokens`` from the line when it has one.

Output lengths the data lacks are the workload's (``output``, default :data:`DEFAULT_OUTPUT`). Sessions
carry their recorded times only under trace arrivals (the default when the data has times): under any other
process (``--rate``, ``--concurrency``) the same requests follow its schedule.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from workloads.base import Session, Workload
from workloads.contracts import GenRequest
from workloads.spec import DATASET_FORMATS, WorkloadSpec
from workloads.text import builder_for
from workloads.validation import WorkloadError

DEFAULT_OUTPUT = 128  # tokens, for a request whose data says none (vLLM's default output length)
SET_BY_BACKEND = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                  "timestamp")  # fmt: skip
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}  # fmt: skip
Turn = tuple[str, int]  # user content, max_tokens


class Recorded(Session):
    """One recorded session: its user turns (each with its output length) sent in order, the history carried
    (the server's replies in it), on the chat API as messages or on completions as one transcript."""

    def __init__(self, index: int, turns: list[Turn], api: str, system: str | None = None, at: float | None = None,
                 extra: dict[str, Any] | None = None, messages: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
        self.index, self.turns, self.api, self.system, self.at = index, turns, api, system, at
        self.extra, self.messages = extra or {}, messages
        self.turn = 0
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []

    @property
    def cls(self) -> str:  # type: ignore[override]
        return "dataset"

    def first(self) -> GenRequest:
        return self._request()

    def next(self, response_text: str) -> tuple[float, GenRequest] | None:
        if self.turn + 1 >= len(self.turns):
            return None
        self.history.append({"role": "assistant", "content": response_text})
        self.turn += 1
        return 0.0, self._request()

    def _request(self) -> GenRequest:
        content, max_tokens = self.turns[self.turn]
        self.history.append({"role": "user", "content": content})
        rid = f"r{self.index}" if len(self.turns) == 1 else f"r{self.index}.{self.turn}"
        prompt: str | list[dict[str, Any]]
        if self.messages is not None:  # a recorded body's messages, as they are
            prompt = self.messages
        elif self.api == "chat":
            prompt = [dict(m) for m in self.history]
        elif len(self.history) == 1:
            prompt = content
        else:
            prompt = "".join(f"{m['content']}\n" if m["role"] == "system" else
                             f"User: {m['content']}\n" if m["role"] == "user" else f"Assistant: {m['content']}\n"
                             for m in self.history) + "Assistant:"  # fmt: skip
        return GenRequest(request_id=rid, prompt=prompt, max_tokens=max_tokens, workload_class="dataset",
                          api="chat" if self.messages is not None else self.api, extra_body=dict(self.extra))  # type: ignore[arg-type]


class DatasetWorkload(Workload):
    finite = True

    def __init__(self, spec: WorkloadSpec) -> None:
        if spec.trace is None or spec.trace.format not in DATASET_FORMATS:
            raise ValueError("DatasetWorkload needs a spec with a dataset trace")
        self.spec, self.name, self.arrival = spec, spec.name, spec.arrival
        self.builder = builder_for(spec.tokenizer)
        self.output = spec.trace.output
        read = {"sharegpt": self._sharegpt, "openai": self._bodies, "text": self._text}[spec.trace.format]
        self.rows: list[tuple[float | None, list[Turn], str | None, dict[str, Any], list[dict[str, Any]] | None]] = []
        read(spec.trace.path, spec.trace.limit)
        if not self.rows:
            raise WorkloadError(str(spec.trace.path), "", "the dataset has no usable request")
        timed = [r[0] is not None for r in self.rows]
        if any(timed) and not all(timed):
            raise WorkloadError(str(spec.trace.path), "timestamp", "on every line or on none")
        if not any(timed) and self.arrival.process == "trace":  # nothing to replay: the run's arrivals decide
            self.arrival = replace(self.arrival, process=None)

    def _out(self, value: object, where: str) -> int:
        if value is None:
            return self.output or DEFAULT_OUTPUT
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkloadError(str(self.spec.trace.path), where, f"expected an integer >= 1, got {value!r}")  # type: ignore[union-attr]
        return value

    def _sharegpt(self, path: Path, limit: int | None) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise WorkloadError(str(path), "", f"expected a ShareGPT JSON array: {exc}") from exc
        if not isinstance(data, list):
            raise WorkloadError(str(path), "", "expected a JSON array of conversations")
        for i, entry in enumerate(data):
            conv = entry.get("conversations", entry.get("conversation", entry.get("messages"))) if isinstance(entry, dict) else None
            if not isinstance(conv, list):
                raise WorkloadError(str(path), f"[{i}]", "expected an object with a `conversations` array")
            msgs = [(_ROLES.get(str(m.get("from", m.get("role", ""))).lower()), m.get("value", m.get("content")))
                    for m in conv if isinstance(m, dict)]  # fmt: skip
            system = next((c for r, c in msgs if r == "system" and isinstance(c, str)), None)
            turns: list[Turn] = []
            for (role, text), (nrole, reply) in zip(msgs, msgs[1:], strict=False):
                if role == "user" and nrole == "assistant" and isinstance(text, str) and text.strip() and isinstance(reply, str):
                    turns.append((text, max(1, self.builder.count(reply))))
            if turns:  # a conversation without a user turn answered is skipped (as vLLM's loader does)
                self.rows.append((None, turns, system, {}, None))
            if limit is not None and len(self.rows) >= limit:
                return

    def _lines(self, path: Path, limit: int | None) -> Iterator[tuple[str, dict[str, Any]]]:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(self.rows) >= limit:
                    return
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise WorkloadError(str(path), f"line {lineno}", f"expected a JSON object: {exc.msg}") from exc
                if not isinstance(obj, dict):
                    raise WorkloadError(str(path), f"line {lineno}", "expected a JSON object")
                yield f"line {lineno}", obj

    def _time(self, obj: dict[str, Any], where: str) -> float | None:
        ts = obj.get("timestamp")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0):
            raise WorkloadError(str(self.spec.trace.path), f"{where}.timestamp", f"expected seconds >= 0, got {ts!r}")  # type: ignore[union-attr]
        return None if ts is None else float(ts)

    def _bodies(self, path: Path, limit: int | None) -> None:
        for where, obj in self._lines(path, limit):
            out = self._out(obj.get("max_tokens", obj.get("max_completion_tokens")), f"{where}.max_tokens")
            extra = {k: v for k, v in obj.items() if k not in SET_BY_BACKEND}
            messages = obj.get("messages")
            if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
                last = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
                self.rows.append((self._time(obj, where), [(str(last), out)], None, extra, messages))
            elif isinstance(obj.get("prompt"), str):
                self.rows.append((self._time(obj, where), [(obj["prompt"], out)], None, extra, None))
            else:
                raise WorkloadError(str(path), where, "expected `messages` (an array of messages) or `prompt` (text)")

    def _text(self, path: Path, limit: int | None) -> None:
        name = self.spec.trace.field  # type: ignore[union-attr]
        for where, obj in self._lines(path, limit):
            text = obj.get(name)  # type: ignore[arg-type]
            if not isinstance(text, str) or not text.strip():
                raise WorkloadError(str(path), f"{where}.{name}", "expected a non-empty string")
            self.rows.append((self._time(obj, where), [(text, self._out(obj.get("max_tokens"), f"{where}.max_tokens"))],
                              None, {}, None))  # fmt: skip

    def sessions(self, seed: int) -> Iterator[Session]:
        """The recorded sessions in their order (by time when timed), each with its time since the first;
        ``seed`` changes nothing: the data is the data."""
        rows = sorted(self.rows, key=lambda r: r[0] or 0.0)  # stable: untimed rows keep the file's order
        t0 = rows[0][0] or 0.0
        for i, (at, turns, system, extra, messages) in enumerate(rows):
            yield Recorded(i, turns, self.spec.api, system, None if at is None else at - t0, extra, messages)

    def describe(self) -> dict[str, object]:
        t = self.spec.trace
        assert t is not None
        return {"name": self.name, "dataset": str(t.path), "format": t.format, "field": t.field, "limit": t.limit,
                "output": t.output, "sessions": len(self.rows), "api": self.spec.api}  # fmt: skip
