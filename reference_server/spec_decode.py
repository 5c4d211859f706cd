"""Lossless speculative decoding: proposers guess k tokens, one target pass scores k+1 positions.

Verification is the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): draft token ``x``
drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``; at the first rejection a token is
drawn from ``norm(max(0, p - q))`` and the rest of the draft is dropped; when every draft token is kept a
bonus token comes from ``p`` at the last position. The emitted tokens then follow ``p`` exactly. A
deterministic proposer (n-gram lookup) is the special case ``q = one_hot(x)``. Under greedy decoding the
rule reduces to "keep while the draft equals the target's argmax", so outputs are bit-identical to
non-speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

SpecMethod = Literal["off", "ngram", "draft", "self"]


@dataclass
class SpecConfig:
    """Speculation settings (one per server)."""

    method: SpecMethod = "off"
    num_draft: int = 4  # the most tokens proposed per step (k)
    adaptive: bool = True  # grow k after full acceptance, shrink it after a rejection
    max_batch: int = 4  # speculate only while at most this many requests decode in a step
    ngram_max: int = 4  # n-gram lookup tries the longest suffix first ...
    ngram_min: int = 1  # ... down to this length
    draft_model: str | None = None  # GGUF path for method "draft" (same vocabulary as the target)
    self_draft_layers: int = 8  # method "self": first N target layers + the target's norm and head

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram", "draft", "self"):
            raise ValueError(f"unknown speculation method {self.method!r}: off, ngram, draft or self")
        if self.num_draft < 1 or self.max_batch < 1:
            raise ValueError("num_draft and spec max_batch must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculation method 'draft' needs a draft model GGUF path")
        if self.self_draft_layers < 1:
            raise ValueError("self_draft_layers must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def active(self, num_decoding: int) -> bool:
        """Speculation pays while decode is memory-bound; a big batch already fills the compute."""
        return self.enabled and num_decoding <= self.max_batch


@dataclass
class Draft:
    """What a proposer guessed for one request: tokens and, for sampled drafts, their distributions."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), vocab) q rows; None = deterministic proposal

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> Draft:
        """Up to ``k`` draft tokens continuing ``token_ids`` (may be fewer, or none)."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens, copy what followed.

    No draft model; pays off when the output repeats its input (code edits, summaries, quoting).
    """

    def __init__(self, n_max: int = 4, n_min: int = 1) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, token_ids: list[int], k: int) -> Draft:
        arr = np.asarray(token_ids, dtype=np.int64)
        total = len(arr)
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)  # excludes the suffix itself
            hits = np.flatnonzero((windows == arr[total - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return Draft(arr[start : start + k].tolist())
        return Draft([])


def verify_greedy(draft: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens to emit: the draft while it equals the target's argmax, then the target's own token.

    ``target_argmax`` has ``len(draft) + 1`` entries (the last position gives the bonus token).
    """
    out: list[int] = []
    for guess, best in zip(draft, target_argmax, strict=False):
        out.append(best)
        if guess != best:
            return out
    out.append(target_argmax[len(draft)])
    return out


def verify_sampled(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """The rejection rule on probabilities (rows already temperature/top-k/top-p processed).

    ``target_probs`` is ``(len(draft) + 1, vocab)``: row i scores the token after draft position i-1.
    """
    k = len(draft)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} draft tokens, got {target_probs.shape[0]}")
    p_all = target_probs.float()
    out: list[int] = []
    for i, x in enumerate(draft.tokens):
        p = p_all[i]
        q_x = 1.0 if draft.probs is None else float(draft.probs[i, x])
        u = float(torch.rand((), generator=generator))
        if u * q_x < float(p[x]):  # accept with probability min(1, p(x) / q(x))
            out.append(x)
            continue
        if draft.probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft.probs[i].float()).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is undefined, p is exact
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p_all[k], 1, generator=generator)))
    return out


class AdaptiveK:
    """Per-request draft length: one longer after a fully accepted draft, one shorter after a rejection."""

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max, self.adaptive = k_max, adaptive
        self.k = k_max

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        self.k = min(self.k_max, self.k + 1) if accepted == drafted else max(1, self.k - 1)
