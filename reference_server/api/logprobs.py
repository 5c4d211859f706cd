"""A request's logprobs in the answer's shape, from the engine's :class:`TokenLogprobs`: the completions API's
legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` (vLLM's ``CompletionLogProbs``) or chat's
``{content: [{token, logprob, bytes, top_logprobs}]}`` (OpenAI's), whole or one stream chunk at a time."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from reference_server.engine.engine import RequestOutput
from reference_server.model.logprobs import TokenLogprobs

JSON_FLOOR = -9999.0  # vLLM's stand-in for a -inf logprob, which JSON cannot carry


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte in a BPE token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


class TokenPieces:
    """Each token's bytes (what it adds to the text: a byte-level BPE token may hold part of a UTF-8
    character) and its text (those bytes decoded, U+FFFD for a partial character). Special tokens, such as
    ``<|im_end|>``, are their own name."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoder = _byte_decoder()
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        piece = self.cache.get(token_id)
        if piece is None:
            name = self.tokenizer.id_to_token(token_id) or ""
            raw = b"".join(bytes([self.decoder[c]]) if c in self.decoder else c.encode() for c in name)
            piece = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return piece


def _json(logprob: float) -> float:
    return max(logprob, JSON_FLOOR)


class RequestLogprobs:
    """One request's logprobs as its outputs arrive: :meth:`add` each output, :meth:`take` what was added
    since the last take, in the answer's shape (None when the request did not ask)."""

    def __init__(self, pieces: TokenPieces, chat: bool, asked: bool) -> None:
        self.pieces, self.chat, self.asked = pieces, chat, asked
        self.pending: list[tuple[int, TokenLogprobs]] = []
        self.offset = 0  # completions: the text offset of the next token (in the generated text)

    def add(self, out: RequestOutput) -> None:
        if out.logprobs is not None:
            self.pending += zip(out.token_ids, out.logprobs, strict=True)

    def take(self) -> dict[str, Any] | None:
        if not self.asked:
            return None
        pending, self.pending = self.pending, []
        return self._chat(pending) if self.chat else self._completion(pending)

    def _chat(self, pending: list[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = self.pieces(token_id)
            return {"token": text, "logprob": _json(logprob), "bytes": list(raw)}

        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in pending]}

    def _completion(self, pending: list[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        """As OpenAI's legacy API: each position's top alternatives and the chosen token (so up to k + 1)."""
        tokens, offsets, tops = [], [], []
        for t, lp in pending:
            text = self.pieces(t)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            top = {self.pieces(i)[0]: _json(v) for i, v in lp.top}
            tops.append(top | {text: _json(lp.logprob)})
        return {"tokens": tokens, "token_logprobs": [_json(lp.logprob) for _, lp in pending], "top_logprobs": tops,
                "text_offset": offsets}
