"""One response's SSE stream read into its :class:`RequestRecord`: events, their times and token counts.

Every stream event is timestamped on the run clock when its chunk arrives; the backend turns each SSE
``data:`` payload into deltas and this module decides the token counts and their source:
final ``usage`` > per-event counts the protocol states (``chunk_usage``, ``token_ids``) > one token per
content event (``events``). Hot path: plain ``data:`` frames go to ``Backend.plain_texts`` as raw bytes
(no ``SSEEvent``/``Delta`` objects); the first event that is not plain, and all after it in that read,
go through ``Backend.parse``. When only the total is known and it differs from the event count, the
total is spread evenly over the events (``RequestRecord.event_tokens == "spread"``).
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.base import Backend, Delta, HttpCall, ParseState
from loadgen.client.sse import SSEError, SSEEvent, SSEParser, decode_data
from loadgen.timing.clock import RunClock
from workloads.contracts import GenRequest, RequestRecord

THINK = ("<think>", "</think>")  # a model's reasoning inline in its content (a server with no reasoning parser)


class StreamReader:
    """Turns chunks into events on the record; ``feed`` returns True when reading should stop: at an
    error or at the end marker (``[DONE]`` or the protocol's final event), whatever follows it.

    Every event parsed from one chunk (one socket read) gets that read's timestamp; the metrics merge
    them (:func:`loadgen.metrics.definitions.reads`), as no time passed between them on the client."""

    __slots__ = ("backend", "rec", "clock", "parser", "state", "texts", "usage_out", "usage_prompt",
                 "chunk_prompt", "stated_source", "done", "think", "first_seen", "head")

    def __init__(self, backend: Backend, rec: RequestRecord, clock: RunClock) -> None:
        self.backend, self.rec, self.clock = backend, rec, clock
        self.parser = SSEParser()
        self.state = ParseState()
        self.texts: list[str] = []
        self.usage_out: int | None = None
        self.usage_prompt: int | None = None
        self.chunk_prompt: int | None = None
        self.stated_source: str | None = None
        self.done = False
        self.think: bool | None = None  # inside an inline <think> that opened the answer; None: not yet known
        self.first_seen: int | None = None  # the first event of the content (reasoning deltas aside)
        self.head = ""  # the content's text while its <think> is undecided or open (see _content)

    def feed(self, chunk: bytes, t: float) -> bool:
        try:
            frames = self.parser.frames(chunk)
            if not self.done:  # the hot path: plain content events, no Delta objects
                n = 0
                for f in frames:
                    if type(f) is not bytes:
                        break
                    n += 1
                if n:
                    texts = self.backend.plain_texts(frames[:n] if n < len(frames) else frames)  # type: ignore[arg-type]
                    k = 0
                    while k < len(texts) and self.think is not False:  # the content's start: an inline <think>?
                        if texts[k]:
                            self._content(t, texts[k], None, False)
                        k += 1
                    if k < len(texts):
                        events, keep = self.rec.events, self.texts.append
                        n0 = len(events)
                        for text in texts[k:] if k else texts:
                            if text:
                                events.append([t, None])
                                keep(text)
                        if self.rec.first_output is None and len(events) > n0:
                            self.rec.first_output = n0
                    frames = frames[len(texts):]
            return self._events(frames, t)
        except (SSEError, ValueError) as exc:
            self.rec.set_error("protocol", str(exc))
            return True

    def close(self, t: float) -> None:
        try:
            if self._events(self.parser.close(), t):
                return
        except (SSEError, ValueError) as exc:
            self.rec.set_error("truncated" if isinstance(exc, SSEError) else "protocol", str(exc))
            return
        if not self.done:
            self.rec.set_error("truncated", "stream ended without its end marker ([DONE])")

    def _events(self, frames: Sequence[bytes | SSEEvent], t: float) -> bool:
        """The general path: each event through ``backend.parse`` (raw frames decoded one by one, so
        the events before a bad one are kept)."""
        rec, parse, state = self.rec, self.backend.parse, self.state
        for ev in frames:
            if type(ev) is bytes:
                data, name = decode_data(ev), None
            else:
                data, name = ev.data, ev.event  # type: ignore[union-attr]
            if name == "error":
                rec.set_error("stream_error", data or "error event")
                return True
            for d in parse(data, state):
                if self._apply(d, t):
                    return True
            if self.done:
                return True  # stop at the end marker: a proxy holding the finished stream open is no stall
        return False

    def whole(self, body: bytes, call: HttpCall, t: float) -> None:
        """The JSON answer to a call that is not a stream (embeddings, rerank): no content events, its counts."""
        try:
            self._apply(self.backend.parse_body(body.decode("utf-8", "replace"), call), t)
        except ValueError as exc:
            self.rec.set_error("protocol", str(exc))

    def _apply(self, d: Delta, t: float) -> bool:
        """One delta into the record; True at an error (reading stops)."""
        rec = self.rec
        if d.error is not None:
            rec.set_error("stream_error", d.error)
            return True
        if d.text or d.tokens:
            self._content(t, d.text, d.tokens, d.reasoning)
            if d.tokens is not None:
                self.stated_source = d.tokens_source
        if d.finish_reason is not None:
            rec.finish_reason = d.finish_reason
        if d.tokens_source == "usage" and d.completion_tokens is not None:
            self.usage_out = d.completion_tokens
            self.usage_prompt = d.prompt_tokens
        elif d.prompt_tokens is not None:
            self.chunk_prompt = d.prompt_tokens
        if d.cached_tokens is not None:
            rec.cached_tokens = d.cached_tokens
        if d.extra:
            rec.extra.update(d.extra)
        if d.done:
            self.done = True
        return False

    def _content(self, t: float, text: str, tokens: int | None, reasoning: bool) -> None:
        """One content event: the model's reasoning (the protocol says so, or an inline ``<think>`` opened the
        content and has not closed) or its answer, whose first event the record marks (``first_output``) and
        whose text a conversation's next turn carries. Until the content's start is known to open with a
        ``<think>`` or not, and while that block is open, its text is kept in ``head``: a tokenizer without a
        ``<think>`` token streams either tag in pieces (``<``, ``think``, ``>``)."""
        rec = self.rec
        i = len(rec.events)
        rec.events.append([t, tokens])
        if reasoning:
            return
        if self.think is not False:
            self.head += text
            if self.think is None:
                self.first_seen = i if self.first_seen is None else self.first_seen
                start = self.head.lstrip()
                if THINK[0].startswith(start):  # whitespace, or the start of a <think>: not known yet
                    return
                self.think = start.startswith(THINK[0])
                if not self.think:
                    rec.first_output = self.first_seen if rec.first_output is None else rec.first_output
                    self.texts.append(self.head)
                    self.head = ""
                    return
            _, closed, text = self.head.partition(THINK[1])
            if not closed:
                self.head = self.head[-len(THINK[1]) + 1 :]  # a closing tag's first pieces, if any
                return
            self.think, self.head = False, ""
            if not text.strip():
                return  # the closing tag's own event: the answer starts with the next
        if rec.first_output is None:
            rec.first_output = i
        self.texts.append(text)

    def finish(self, req: GenRequest) -> str:
        """Decide token counts and their sources; returns the response text."""
        rec = self.rec
        if self.think is None and self.head:  # the content ended as what could start a <think>: the answer
            self.texts.append(self.head)
            if self.head.strip() and rec.first_output is None:
                rec.first_output = self.first_seen
        events = rec.events
        unknown = [e for e in events if e[1] is None]
        if self.usage_out is not None:
            rec.output_tokens, rec.output_tokens_source = self.usage_out, "usage"
        elif events and not unknown:
            rec.output_tokens = sum(int(e[1] or 0) for e in events)
            rec.output_tokens_source = self.stated_source or "unknown"
        else:
            rec.output_tokens = sum(int(e[1] or 1) for e in events)
            rec.output_tokens_source = "events"
        if unknown:
            stated = sum(int(e[1]) for e in events if e[1] is not None)
            rest = (rec.output_tokens or 0) - stated
            n = len(unknown)
            if rest == n or rest <= 0:
                rec.event_tokens = "one_per_event"
                for e in unknown:
                    e[1] = 1
            else:  # spread the remaining total evenly, in whole tokens
                rec.event_tokens = "spread"
                for i, e in enumerate(unknown):
                    e[1] = (i + 1) * rest // n - i * rest // n
        rec.prompt_tokens_intended = req.prompt_tokens
        if self.usage_prompt is not None:
            rec.prompt_tokens, rec.prompt_tokens_source = self.usage_prompt, "usage"
        elif self.chunk_prompt is not None:
            rec.prompt_tokens, rec.prompt_tokens_source = self.chunk_prompt, "chunk_usage"
        elif req.prompt_tokens is not None:
            rec.prompt_tokens, rec.prompt_tokens_source = req.prompt_tokens, "tokenizer"
        return "".join(self.texts)
