"""Text of an exact token length, through the target's tokenizer.

Re-tokenizing a concatenation can merge tokens across the seams, so lengths are never added up blindly:
the corpus is cut into pre-tokenizer units (a BPE tokenizer never merges across those), text is built
from whole units, and the *final string* (with whatever comes before and after it) is encoded again
and checked. A miss (rare: a seam that re-splits differently) is retried from another corpus position.
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "corpus.txt"
CHATML_USER = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
CHATML_SYSTEM = ("<|im_start|>system\n", "<|im_end|>\n")

_ATTEMPTS = 64
SEAM_UNITS = 8  # whole corpus units on each side of a seam, encoded with it to check it


@lru_cache(maxsize=8)
def load_tokenizer(spec: str = "bundled", offline: bool = False) -> Tokenizer:
    """``bundled`` (the reference server's GGUF), a ``.gguf`` file, a ``tokenizer.json`` file, a folder holding
    one (a model's snapshot), or a Hugging Face model id (``org/name``: its ``tokenizer.json`` through the
    Hugging Face cache, downloaded when not there; ``HF_HUB_OFFLINE=1`` or ``offline`` keep to the cache)."""
    from reference_server.model_files import default_model_path, tokenizer_from_gguf

    if spec == "bundled":
        return tokenizer_from_gguf(default_model_path())
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    elif not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        path = _hub_tokenizer(spec, offline)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {spec!r} not found: use 'bundled', a .gguf file, a tokenizer.json file, a folder holding "
            "one, or a Hugging Face model id (org/name)"
        )
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ValueError(f"{spec}: not a tokenizer.json file ({exc})") from exc


def _hub_tokenizer(repo: str, offline: bool) -> Path:
    """``tokenizer.json`` of Hugging Face model ``repo`` from the cache (or the hub, unless ``offline``)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, "tokenizer.json", local_files_only=offline))
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(f"tokenizer {repo!r}: not in the Hugging Face cache and the hub cannot be reached "
                                f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}); give a tokenizer.json "
                                "file or a model folder") from exc  # fmt: skip
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise FileNotFoundError(f"tokenizer {repo!r}: {exc}") from exc


class PromptBuilder:
    """Cuts exact-length text from the corpus for one tokenizer.

    The corpus is tokenized once; a body is whole pre-tokenizer units taken in corpus order from a random
    word (wrapping around the corpus as often as a long prompt needs; a unit that would overshoot is skipped),
    so its length is a sum of known counts. Only the seams are encoded again, with :data:`SEAM_UNITS` units
    on each side: where the body meets the text before and after it, wraps around, or skips a unit. Between
    seams the text is the corpus's own, which the pre-tokenizer splits as it did the corpus (its regexes look
    no further than the next character). Cost: ~0.1 ms per 1k prompt tokens instead of ~1.5 ms for encoding
    the whole prompt (docs/performance.md). A tokenizer where a piece does not encode as it does inside the
    whole text (one that prepends a space to every input, say) fails a self-check at start and is verified
    by encoding whole prompts."""

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
        self.cum = list(itertools.accumulate(counts, initial=0))  # tokens of units [a, b): cum[b] - cum[a]
        # Units that begin a word after a space (" the", " The"; or "the" after one, where the pre-tokenizer
        # drops spaces): places to start a prompt, where the text before it (a template, another block of a
        # trace's prompt) cannot merge into its first token.
        self.anchors = [k for k, at in enumerate(starts) if corpus[at + 1 : at + 2].isalpha() and corpus[at] == " "
                        or corpus[at : at + 1].isalpha() and corpus[at - 1 : at] == " "]  # fmt: skip
        # Recent encodings: heads (shared prefixes, templates) recur, and a filled prompt is counted again.
        self._ids = lru_cache(maxsize=256)(self._encode)
        self.seams_only = True
        self.seams_only = self._seams_hold()

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

    def _runs(self, n: int, rng: random.Random) -> list[tuple[int, int]]:
        """Unit ranges ``[a, b)`` of the corpus, in order, holding ``n`` tokens in all, from a random word on.
        Any word, not only a sentence's first: two prompts that start at the same place share their whole
        overlap, which a server's prefix cache answers, and the corpus has 13x more words than sentences
        (46,945 / 3,556 starts: from sentence starts a 3-point `make sweep` met ~96 cached prompt tokens a
        point)."""
        units, cum = len(self.counts), self.cum
        j, rest, runs = rng.choice(self.anchors), n, []
        for _ in range(n + 2 * units):  # each round takes a unit or skips one; a whole cycle always fits one
            if rest == 0:
                return runs
            b = bisect.bisect_right(cum, cum[j] + rest, lo=j) - 1  # the most whole units from j that fit
            if b > j:
                runs.append((j, b))
                rest -= cum[b] - cum[j]
            j = 0 if b >= units - 1 else b + 1  # past the unit that overshoots, or round to the start
        raise ValueError(f"cannot cut {n} tokens from the corpus")

    def _text(self, a: int, b: int) -> str:
        return self.corpus[self.starts[a] : self.starts[b]]

    def _seams(self, runs: list[tuple[int, int]], before: str, after: str) -> list[tuple[str, int]]:
        """The pieces to encode again, each with the tokens it must have: the text across every seam, with
        :data:`SEAM_UNITS` whole units of corpus on each side (a shorter run joins its neighbours' piece)."""
        w, cum, pieces = SEAM_UNITS, self.cum, []
        text, want = before, 0
        for a, b in runs:
            if b - a > 2 * w:
                pieces.append((text + self._text(a, a + w), want + cum[a + w] - cum[a]))
                text, want = self._text(b - w, b), cum[b] - cum[b - w]
            else:
                text, want = text + self._text(a, b), want + cum[b] - cum[a]
        pieces.append((text + after, want))
        return pieces

    def _exact(self, n: int, runs: list[tuple[int, int]], before: str, after: str, text: str) -> bool:
        """Does ``text`` (``before`` + the runs + ``after``) encode as ``before``'s tokens, ``n`` more, then
        ``after``'s?"""
        if not self.seams_only:
            ids, whole_head = self._ids(text), self._ids(before) if before else ()
            return len(ids) == len(whole_head) + n + (self.count(after) if after else 0) and ids[: len(whole_head)] == whole_head
        head, tail = self._plain(before), self._plain(after)
        pieces = self._seams(runs, before, after)
        for i, (piece, want) in enumerate(pieces):
            ids = self._plain(piece)
            extra = (len(head) if i == 0 else 0) + (len(tail) if i == len(pieces) - 1 else 0)
            if len(ids) != want + extra or (i == 0 and ids[: len(head)] != head):
                return False
        return True

    def _plain(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else ()

    def fill(self, n: int, rng: random.Random, before: str = "", after: str = "") -> str:
        """``before + body + after`` whose encoding is ``before``'s tokens, exactly ``n`` more, then ``after``'s.

        Raises ``ValueError`` when no corpus position works (it has never happened on the shipped corpus).
        """
        if n < 1:
            raise ValueError(f"a prompt body needs at least 1 token, got {n}")
        for _ in range(_ATTEMPTS):
            runs = self._runs(n, rng)
            text = before + "".join(self._text(a, b) for a, b in runs) + after
            if self._exact(n, runs, before, after, text):
                return text
        raise ValueError(f"could not build a prompt of exactly {n} tokens after {self.count(before)} fixed tokens")

    def fill_tokens(self, n: int, before: str = "", after: str = "") -> int:
        """The tokens of ``fill(n, rng, before, after)``'s text, known without encoding it: ``before``'s (with
        the tokenizer's special tokens), ``n``, then ``after``'s."""
        return self.count(before) + n + len(self._plain(after))

    def _seams_hold(self) -> bool:
        """Do seam checks agree with encoding whole prompts for this tokenizer? A few prompts with templates
        around them, long enough to wrap the corpus and to have checked-only-at-the-seams middles."""
        rng = random.Random(0)
        for n, (before, after) in [(3000, CHATML_USER), (700, ("", "\n")), (len(self.cum) + 50, CHATML_SYSTEM)]:
            text = self.fill(n, rng, before, after)
            if len(self._plain(text)) != len(self._plain(before)) + n + len(self._plain(after)):
                return False
        return True


@lru_cache(maxsize=8)
def builder_for(tokenizer_spec: str = "bundled") -> PromptBuilder:
    return PromptBuilder(load_tokenizer(tokenizer_spec), CORPUS.read_text(encoding="utf-8"))
