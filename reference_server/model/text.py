"""Text around the engine: chat template, incremental detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from reference_server.model_files import read_gguf_metadata, tokenizer_from_gguf

_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TextCodec:
    """Tokenizer + chat template + the token ids that end a turn (EOS and ``<|im_end|>``)."""

    def __init__(self, model: Path) -> None:
        self.tokenizer: Tokenizer = tokenizer_from_gguf(model)
        meta = read_gguf_metadata(model)
        source = meta.get("tokenizer.chat_template") or _CHATML
        self.template = jinja2.Environment(loader=jinja2.BaseLoader()).from_string(source)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.stop_ids = {int(eos)} if eos is not None else set()
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = self.tokenizer.token_to_id(name)
            if tid is not None:
                self.stop_ids.add(tid)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token="", eos_token="")


@dataclass
class Detokenizer:
    """Turns one request's output tokens into text deltas: never emits a partial UTF-8 character, and holds
    back text that might be the start of a stop string until it is clear either way."""

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    text: str = ""  # all text decoded so far (stop string cut off once found)
    emitted: int = 0  # chars of ``text`` already handed out
    stopped: bool = False

    def __post_init__(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=True)
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_id: int) -> str:
        """Feed one token; return the new text safe to emit (may be empty)."""
        piece = self._stream.step(self.tokenizer, token_id)
        if piece:
            start = max(0, len(self.text) - self._hold)
            self.text += piece
            for s in self.stop:
                at = self.text.find(s, start)
                if at >= 0:
                    self.text, self.stopped = self.text[:at], True
                    break
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """The held-back tail, at the end of the request."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        out, self.emitted = self.text[self.emitted : end], end
        return out
