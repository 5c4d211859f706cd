"""A null-server response: the :class:`Behaviour` a request asks for (pacing, faults; the server's default
updated by the request body's ``"nullserver"`` object) and the SSE :class:`Stream` that answers it."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields, replace
from typing import Any

FAULTS = ("500", "429", "html", "hang", "disconnect", "garbage", "bad_json", "error_event", "error_payload",
          "stall", "no_done", "cut", "drop_request", "linger")  # fmt: skip
KEEPALIVE = ("on", "close", "drop", "drop_idle")
WHOLE_KEPT = 1024  # whole response bodies kept (Stream.whole), by shape
_WHOLE: dict[tuple[Any, ...], bytes] = {}


@dataclass(frozen=True)
class Behaviour:
    events: int | None = None
    tokens_per_event: int = 1
    ttft: float = 0.0
    itl: float = 0.0
    fault: str | None = None
    fault_after: int = 0
    usage_on_finish: bool = False
    spec_decode: tuple[int, int] | None = None
    reasoning: int = 0  # chat: the first N events are reasoning (``delta.reasoning_content``), as a thinking model's
    keepalive: str = "on"
    die_after: int | None = None
    # wrong on purpose under load: a request that arrives while more than N generation requests (itself
    # included) are in flight gets its middle event's text changed (``bench verify`` must catch it)
    diverge_above: int | None = None
    # sampled on purpose: the answer's first event is one text drawn from ``sample`` (text: weight), with a
    # ``random.Random`` seeded by the request's ``seed`` and ``sample_salt`` when the body has a seed (another salt:
    # other draws from the same distribution, as speculative sampling gives), else unseeded; a request that arrives
    # while more than ``shift_above`` generation requests are in flight draws from ``shifted`` instead (a
    # load-dependent sampling bug that only a distribution comparison sees)
    sample: dict[str, float] | None = None
    sample_salt: int = 0
    shift_above: int | None = None
    shifted: dict[str, float] | None = None

    def update(self, overrides: dict[str, Any]) -> Behaviour:
        names = {f.name for f in fields(self)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown nullserver option(s) {sorted(unknown)}; known: {sorted(names)}")
        new = replace(self, **overrides)
        if new.fault is not None and new.fault not in FAULTS:
            raise ValueError(f"unknown fault {new.fault!r}; known: {', '.join(FAULTS)}")
        for dist in (new.sample, new.shifted):
            if dist is not None and (not dist or any(not isinstance(w, (int, float)) or w < 0 for w in dist.values())):
                raise ValueError(f"a sample distribution maps texts to weights >= 0, got {dist!r}")
        if new.keepalive not in KEEPALIVE:
            raise ValueError(f"unknown keepalive {new.keepalive!r}; known: {', '.join(KEEPALIVE)}")
        return new


def first_draw(b: Behaviour, body: dict[str, Any], inflight: int) -> str | None:
    """The sampled first text of a response (:attr:`Behaviour.sample`), ``inflight`` counting the request itself;
    None when the behaviour samples nothing."""
    if b.sample is None:
        return None
    dist = b.shifted if b.shifted is not None and b.shift_above is not None and inflight > b.shift_above else b.sample
    seed = body.get("seed")
    rng = random.Random(f"{seed}:{b.sample_salt}") if seed is not None else random.Random()
    return rng.choices(list(dist), weights=list(dist.values()))[0]


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _words(text: str) -> int:
    """The prompt's "tokens" in the null server's usage: its words, counted by their separators (spaces and
    newlines) rather than split out, which cost 4.3 ms of the server's time for a 128,000-token prompt."""
    text = text.strip()
    return text.count(" ") + text.count("\n") + 1 if text else 0


class Stream:
    """The SSE events of one response; ``wrong``: its middle event says ``" tak"`` for ``" tok"``
    (:attr:`Behaviour.diverge_above`); ``first``: its first event's text (:func:`first_draw`)."""

    def __init__(self, body: dict[str, Any], b: Behaviour, wrong: bool = False, first: str | None = None) -> None:
        self.first = first
        self.chat = "messages" in body
        self.b = b
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        self.n = b.events if b.events is not None else max(1, -(-max_tokens // b.tokens_per_event))
        self.wrong_at = self.n // 2 if wrong else None
        prompt = body.get("prompt") if not self.chat else " ".join(m.get("content", "") for m in body["messages"])
        self.prompt_tokens = _words(str(prompt))
        opts = body.get("stream_options") or {}
        self.usage = bool(opts.get("include_usage"))
        self.continuous = bool(opts.get("continuous_usage_stats"))

    def event(self, i: int) -> bytes:
        k = self.b.tokens_per_event
        text = (" tak" if i == self.wrong_at else " tok") * k
        if i == 0 and self.first is not None:
            text = json.dumps(self.first)[1:-1] + " tok" * (k - 1)
        finish = '"length"' if i == self.n - 1 else "null"
        if self.chat:
            field = "reasoning_content" if i < self.b.reasoning else "content"
            choice = f'{{"index":0,"delta":{{"{field}":"{text}"}},"finish_reason":{finish}}}'
            head = '{"id":"chatcmpl-null","object":"chat.completion.chunk","created":0,"model":"null","choices":['
        else:
            choice = f'{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{finish}}}'
            head = '{"id":"cmpl-null","object":"text_completion","created":0,"model":"null","choices":['
        last = i == self.n - 1
        if self.continuous or (last and self.usage and self.b.usage_on_finish):
            usage = f',"usage":{self._usage((i + 1) * k, final=last)}'
        else:
            usage = ""
        return f"data: {head}{choice}]{usage}}}\n\n".encode()

    def whole(self) -> bytes:
        """The whole body at once (every event, the tail and the chunked terminator), kept for the next
        response of the same shape: building 200 events was 59 of the 167 us of CPU a null-server process
        spent per response, CPU taken from the client it measures when they share the machine."""
        b = self.b
        spec = tuple(b.spec_decode) if b.spec_decode is not None else None  # a list where it came from JSON
        key = (self.chat, self.n, self.prompt_tokens, self.usage, self.continuous, b.tokens_per_event, b.reasoning,
               b.usage_on_finish, spec, self.wrong_at, self.first)  # fmt: skip
        body = _WHOLE.get(key)
        if body is None:
            if len(_WHOLE) >= WHOLE_KEPT:
                _WHOLE.clear()
            body = _WHOLE[key] = http_chunk(b"".join(map(self.event, range(self.n))) + self.tail()) + b"0\r\n\r\n"
        return body

    def _usage(self, out: int, final: bool = True) -> str:
        p = self.prompt_tokens
        spec = ""
        if final and self.b.spec_decode is not None:
            drafted, accepted = self.b.spec_decode
            spec = f',"spec_decode":{{"draft_tokens":{drafted},"accepted_tokens":{accepted}}}'
        return f'{{"prompt_tokens":{p},"completion_tokens":{out},"total_tokens":{p + out}{spec}}}'

    def tail(self, done: bool = True) -> bytes:
        out = b""
        if self.usage and not self.b.usage_on_finish:
            out += f'data: {{"id":"null","choices":[],"usage":{self._usage(self.n * self.b.tokens_per_event)}}}\n\n'.encode()
        return out + (b"data: [DONE]\n\n" if done else b"")
