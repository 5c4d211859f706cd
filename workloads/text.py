"""Text of an exact token length, through the target's tokenizer.

Re-tokenizing a concatenation can merge tokens across the seams, so lengths are never added up blindly:
the corpus is cut into pre-tokenizer units (a BPE tokenizer never merges across those), text is built
from whole units, and the *final string* (with whatever comes before and after it) is encoded again
and checked. A miss (rare: a seam that re-splits differently) is retried from another corpus position.
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "corpus.txt"
CHATML_USER = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
CHATML_SYSTEM = ("<|im_start|>system\n", "<|im_end|>\n")

_ATTEMPTS = 64


@lru_cache(maxsize=8)
def load_tokenizer(spec: str = "bundled") -> Tokenizer:
    """``bundled`` (the reference server's GGUF), a ``.gguf`` file, or a ``tokenizer.json`` file."""
    from reference_server.model_files import default_model_path, tokenizer_from_gguf

    if spec == "bundled":
        return tokenizer_from_gguf(default_model_path())
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {spec!r} not found: use 'bundled', a .gguf file or a tokenizer.json file"
        )
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ValueError(f"{spec}: not a tokenizer.json file ({exc})") from exc


class PromptBuilder:
    """Cuts exact-length text from the corpus for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, corpus: str) -> None:
        self.tokenizer = tokenizer
        self.corpus = corpus
        enc = tokenizer.encode(corpus, add_special_tokens=False)
        starts: list[int] = []
        counts: list[int] = []
        last = None
        for word, (start, _) in zip(enc.word_ids, enc.offsets, strict=True):
            if word != last:
                starts.append(start)
                counts.append(0)
                last = word
            counts[-1] += 1
        self.starts = starts + [len(corpus)]  # unit k spans starts[k]:starts[k+1]
        self.counts = counts
        # Units that begin a word after a space (" the", " The"): places to start a prompt, where the text
        # before it (a template, another block of a trace's prompt) cannot merge into its first token.
        self.anchors = [k for k in range(len(counts)) if corpus[starts[k] : starts[k] + 2][:1] == " "
                        and corpus[starts[k] + 1 : starts[k] + 2].isalpha()]  # fmt: skip

        # Recent encodings: heads (shared prefixes, templates) recur, and a filled prompt is counted again.
        self._ids = lru_cache(maxsize=256)(self._encode)

    def __getstate__(self) -> dict[str, object]:
        """Picklable (a load worker process gets its workload pickled): the encoding cache is rebuilt."""
        return {k: v for k, v in self.__dict__.items() if k != "_ids"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._ids = lru_cache(maxsize=256)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text).ids)

    def count(self, text: str) -> int:
        """Tokens the server sees for ``text`` (special tokens included, as the tokenizer is configured)."""
        return len(self._ids(text))

    def _cut(self, n: int, rng: random.Random) -> str:
        """``n`` tokens of corpus from a random word on. Any word, not only a sentence's first: two prompts
        that start at the same place share their whole overlap, which a server's prefix cache answers, and
        the corpus has 13x more words than sentences (46,945 / 3,556 starts: from sentence starts a 3-point
        `make sweep` met ~96 cached prompt tokens a point)."""
        k = rng.choice(self.anchors)
        parts: list[str] = []
        acc = 0
        units = len(self.counts)
        for step in range(units):
            if acc == n:
                break
            j = (k + step) % units
            c = self.counts[j]
            if acc + c <= n:
                parts.append(self.corpus[self.starts[j] : self.starts[j + 1]])
                acc += c
        if acc != n:
            raise ValueError(f"cannot cut {n} tokens from the corpus")
        return "".join(parts)

    def fill(self, n: int, rng: random.Random, before: str = "", after: str = "") -> str:
        """``before + body + after`` whose encoding is ``before``'s tokens, exactly ``n`` more, then ``after``'s.

        Raises ``ValueError`` when no corpus position works (it has never happened on the shipped corpus).
        """
        if n < 1:
            raise ValueError(f"a prompt body needs at least 1 token, got {n}")
        head = self._ids(before) if before else ()
        n_after = self.count(after) if after else 0
        for _ in range(_ATTEMPTS):
            text = before + self._cut(n, rng) + after
            ids = self._ids(text)
            if len(ids) == len(head) + n + n_after and ids[: len(head)] == head:
                return text
        raise ValueError(f"could not build a prompt of exactly {n} tokens after {len(head)} fixed tokens")


@lru_cache(maxsize=8)
def builder_for(tokenizer_spec: str = "bundled") -> PromptBuilder:
    return PromptBuilder(load_tokenizer(tokenizer_spec), CORPUS.read_text(encoding="utf-8"))
