"""Synthetic workloads from a :class:`~workloads.spec.WorkloadSpec`: class mix, exact prompt lengths,
shared prefixes, multi-turn conversations.

A workload whose classes list send times (``at``) is that schedule, in time order (ties in class order).

Reproducibility: the class of session ``i`` comes from one stream RNG seeded by ``seed``; everything
inside the session (lengths, text, think times) from its own RNG seeded by ``(seed, i)``, so a
conversation's user turns do not depend on how the engine interleaves sessions. Shared prefixes are
seeded by ``seed`` and the class name.

Prompt lengths are exact for the final string the server tokenizes (``GenRequest.prompt_tokens`` is set
to it) with ``api = "completions"``: the length drawn is the whole prompt, shared prefix and template
tokens included (a draw too small to hold them gives prefix + template + 1 token). With
``api = "chat"`` the server adds its own chat template, so the drawn length is that of the message
contents and ``prompt_tokens`` is left to the server's usage.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

from workloads.base import Session, SingleShot, Workload
from workloads.contracts import GenRequest
from workloads.dist import Dist
from workloads.spec import BUILTIN_DIR, EXPERIMENTS_DIR, ClassSpec, WorkloadSpec
from workloads.text import CHATML_SYSTEM, CHATML_USER, DATA, PromptBuilder, builder_for

CODE_DIR = DATA / "code"
CREATIVE = DATA / "creative_prompts.txt"


@lru_cache(maxsize=1)
def _code_snippets() -> tuple[tuple[str, str], ...]:
    """(file name, code) for every shipped code sample."""
    return tuple((p.name, p.read_text(encoding="utf-8")) for p in sorted(CODE_DIR.glob("*.py")))


@lru_cache(maxsize=1)
def _creative_prompts() -> tuple[str, ...]:
    return tuple(line.strip() for line in CREATIVE.read_text(encoding="utf-8").splitlines() if line.strip())


_IDENT = re.compile(r"\b[a-z_][a-z0-9_]{3,}\b")
_RESERVED = {"self", "return", "import", "from", "class", "while", "with", "else", "elif", "pass", "lambda",
             "yield", "none", "true", "false", "print", "range", "float", "list", "dict", "tuple", "len", "def",
             "isinstance", "raise", "assert", "break", "continue", "global", "nonlocal", "except", "finally",
             "str", "int", "bool", "sorted", "sum", "min", "max", "enumerate", "zip", "append", "items",
             "keys", "values", "join", "split", "strip", "format", "open", "super", "init"}  # fmt: skip


def code_edit_request(rng: random.Random) -> tuple[str, str, str]:
    """A rename request on a shipped code file: (user text, the code, how the answer starts)."""
    name, code = rng.choice(_code_snippets())
    counts: dict[str, int] = {}
    for ident in _IDENT.findall(code):
        if ident.lower() not in _RESERVED:
            counts[ident] = counts.get(ident, 0) + 1
    candidates = sorted(k for k, v in counts.items() if v >= 3)
    old = rng.choice(candidates)
    new = rng.choice(["renamed", "updated", "current", "result", "value"]) + "_" + old
    text = (
        f"Rewrite the following Python code ({name}) with the identifier `{old}` renamed to `{new}`. "
        f"Change nothing else and output only the complete code.\n\n```python\n{code}```\n"
    )
    return text, code, f"\nThe same code with `{old}` renamed to `{new}`:\n\n```python\n"


class _Classes:
    """Per-class prompt machinery shared by all sessions of one ``sessions(seed)`` call."""

    def __init__(self, spec: WorkloadSpec, builder: PromptBuilder, seed: int) -> None:
        self.spec, self.builder = spec, builder
        self.prefixes: dict[str, list[str]] = {}
        for cls in spec.classes:
            if cls.shared_prefix is not None:
                sp = cls.shared_prefix
                self.prefixes[cls.name] = [
                    self._prefix_text(cls, sp.tokens, random.Random(f"{seed}:prefix:{cls.name}:{k}"))
                    for k in range(sp.count)
                ]

    def _prefix_text(self, cls: ClassSpec, tokens: int, rng: random.Random) -> str:
        """A system prompt whose tokens are exactly the first ``tokens`` of every prompt that uses it."""
        if self.spec.api == "chat":
            return self.builder.fill(tokens, rng)
        if cls.template == "chatml":
            n = tokens - self.builder.count(CHATML_SYSTEM[0]) - self.builder.count(CHATML_SYSTEM[1])
            return self.builder.fill(max(1, n), rng, CHATML_SYSTEM[0], CHATML_SYSTEM[1])
        # ends in a newline so that the next text (a new pre-token) cannot merge into it
        return self.builder.fill(max(1, tokens - 1), rng, after="\n")

    def prefix(self, cls: ClassSpec, rng: random.Random) -> str | None:
        sp = cls.shared_prefix
        if sp is None or rng.random() >= sp.fraction:
            return None
        return rng.choice(self.prefixes[cls.name])

    def user_text(self, cls: ClassSpec, rng: random.Random) -> tuple[str | None, int, str]:
        """Fixed user text (code-edit, creative) or None for corpus text; the default max_tokens; and the
        start of the answer that a completions prompt ends with (code-edit: the opening code fence, so the
        answer is the code itself, nearly a copy of the prompt's)."""
        if cls.content == "code-edit":
            text, code, answer = code_edit_request(rng)
            return text, self.builder.count(code) + 8, "```python\n" if cls.template == "chatml" else answer
        if cls.content == "creative":
            return rng.choice(_creative_prompts()), 256, ""
        return None, 128, ""


class Conversation(Session):
    """One session of a class: a single request, or a multi-turn chat that carries its history."""

    def __init__(self, classes: _Classes, cls: ClassSpec, index: int, seed: int) -> None:
        self.c, self.spec_cls, self.index = classes, cls, index
        self.rng = random.Random(f"{seed}:{index}")
        self.turns = cls.turns.count.sample_int(self.rng) if cls.turns is not None else 1
        self.turn = 0
        self.system = classes.prefix(cls, self.rng)
        self.history: list[dict[str, str]] = []  # user/assistant messages so far

    @property
    def cls(self) -> str:  # type: ignore[override]
        return self.spec_cls.name

    def first(self) -> GenRequest:
        return self._request()

    def next(self, response_text: str) -> tuple[float, GenRequest] | None:
        if self.spec_cls.turns is None or self.turn + 1 >= self.turns:
            return None
        self.history.append({"role": "assistant", "content": response_text})
        self.turn += 1
        return max(0.0, self.spec_cls.turns.think_time.sample(self.rng)), self._request()

    def _request(self) -> GenRequest:
        cls, b, rng = self.spec_cls, self.c.builder, self.rng
        fixed, default_out, answer_start = self.c.user_text(cls, rng)
        target = cls.prompt.sample_int(rng) if fixed is None else 0
        max_tokens = cls.output.sample_int(rng) if cls.output is not None else default_out
        sampling_seed = rng.randrange(2**31) if cls.temperature > 0 else None
        rid = f"r{self.index}" if cls.turns is None else f"r{self.index}.{self.turn}"
        if self.c.spec.api == "chat":
            content = fixed if fixed is not None else b.fill(target, rng)
            self.history.append({"role": "user", "content": content})
            system = [{"role": "system", "content": self.system}] if self.system is not None else []
            prompt: str | list[dict[str, str]] = system + [dict(m) for m in self.history]
            prompt_tokens = None
        else:
            head = self._transcript()
            open_, close = self._wrap()
            if fixed is not None:
                content = fixed
            else:
                if self.turn == 0:  # the drawn length is the whole prompt
                    target -= b.count(head + open_) + b.count(close)
                text = b.fill(max(1, target), rng, head + open_, close)
                content = text[len(head + open_) : len(text) - len(close)]
            self.history.append({"role": "user", "content": content})
            prompt = self._transcript() + answer_start
            if fixed is None and self.turn == 0:  # the filled text is the whole prompt: its length is known
                prompt_tokens = b.fill_tokens(max(1, target), head + open_, close)
            else:
                prompt_tokens = b.count(prompt)
        inputs: tuple[str, ...] = ()
        if cls.inputs is not None:  # a pooling request's texts: the server counts them, not the prompt (a query)
            sizes = [cls.prompt.sample_int(rng) for _ in range(cls.inputs)]
            inputs = tuple(b.fill(n, rng) for n in sizes)
            prompt_tokens = sum(b.fill_tokens(n) for n in sizes)
        return GenRequest(
            request_id=rid, prompt=prompt, max_tokens=max_tokens, workload_class=cls.name, api=self.c.spec.api,
            prompt_tokens=prompt_tokens, ignore_eos=cls.ignore_eos, temperature=cls.temperature,
            seed=sampling_seed, extra_body=dict(cls.extra_body), inputs=inputs, model=cls.model,
        )  # fmt: skip

    def _wrap(self) -> tuple[str, str]:
        """What goes around a user message in a completions prompt."""
        if self.spec_cls.template == "chatml":
            return CHATML_USER
        return ("User:", "\nAssistant:") if self.spec_cls.turns is not None else ("", "")

    def _transcript(self) -> str:
        """The completions prompt for the history so far (ends ready for the assistant's turn)."""
        open_, close = self._wrap()
        end = "<|im_end|>\n" if self.spec_cls.template == "chatml" else "\n"
        out = self.system or ""
        for m in self.history:
            out += open_ + m["content"] + close if m["role"] == "user" else m["content"] + end
        return out


class SyntheticWorkload(Workload):
    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.arrival = spec.arrival
        self.builder = builder_for(spec.tokenizer)  # now: a missing tokenizer fails before any run starts

    def sessions(self, seed: int) -> Iterator[Session]:
        """Builds the shared prefixes now, then yields sessions lazily."""
        classes = _Classes(self.spec, self.builder, seed)
        return self._stream(classes, seed)

    def _stream(self, classes: _Classes, seed: int) -> Iterator[Session]:
        specs = list(self.spec.classes)
        if specs[0].at is not None:  # a schedule: every class lists its send times, sent in time order
            sends = sorted(((at, cls) for cls in specs for at in cls.at or ()), key=lambda s: s[0])  # stable
            for index, (at, cls) in enumerate(sends):
                yield SingleShot(Conversation(classes, cls, index, seed).first(), at=at)
            return
        rng = random.Random(f"{seed}:stream")
        weights = [c.weight for c in specs]
        index = 0
        while True:
            cls = rng.choices(specs, weights=weights)[0]
            sess = Conversation(classes, cls, index, seed)
            if cls.turns is None:
                yield SingleShot(sess.first())
            else:
                yield sess
            index += 1

    def shares_prefix(self) -> bool:
        """Shared prefixes and multi-turn sessions (each turn re-sends the conversation) share on purpose."""
        return any(c.shared_prefix is not None or c.turns is not None for c in self.spec.classes)

    def describe(self) -> dict[str, object]:
        src = Path(self.spec.source)
        # a shipped file is named, not located, so fingerprints match across checkouts
        shipped = src.parent in (BUILTIN_DIR, EXPERIMENTS_DIR)
        source = f"{src.parent.name}:{src.stem}" if shipped else self.spec.source
        return {"name": self.name, "source": source, "spec": spec_dict(self.spec),
                "corpus_sha256": _sha256(DATA / "corpus.txt")}  # fmt: skip


LATER_KEYS = ("at", "inputs", "model")  # ClassSpec's keys that a fingerprint holds only where they are set


def spec_dict(spec: WorkloadSpec) -> dict[str, Any]:
    """The spec as plain JSON-able data (distributions in their file form)."""

    def plain(value: Any) -> Any:
        if isinstance(value, Dist):
            return value.describe()
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    out = {k: getattr(spec, k) for k in spec.__dataclass_fields__ if k != "source"}
    out["arrival"] = asdict(spec.arrival)
    # the keys added since fingerprints were first kept, only where set: a workload without them describes (and
    # fingerprints) as before they existed
    out["classes"] = [{k: getattr(c, k) for k in c.__dataclass_fields__ if k not in LATER_KEYS or getattr(c, k) is not None}
                      for c in spec.classes]  # fmt: skip
    for c in out["classes"]:
        for key in ("shared_prefix", "turns"):
            if c[key] is not None:
                c[key] = {k: getattr(c[key], k) for k in c[key].__dataclass_fields__}
    if spec.trace is not None:
        out["trace"] = asdict(spec.trace)
    return plain(out)  # type: ignore[no-any-return]


@lru_cache(maxsize=16)
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
