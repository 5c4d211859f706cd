"""Token sampling: greedy, temperature, top-k, top-p, with an optional per-request seed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from reference_server.engine.sequence import SamplingParams, Sequence


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from, for one row of logits [V]: one-hot argmax when greedy,
    else softmax(logits / temperature) restricted to the top-k and then the top-p nucleus."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(0, logits.argmax().view(1), 1.0)
    row = logits.float() / params.temperature
    if 0 < params.top_k < row.shape[0]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, idx = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the first token: a top_p that float32
        # rounds to 0 (5e-324 is a valid top_p) would otherwise drop them all
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        drop[0] = False  # no host sync
        sorted_probs.masked_fill_(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs / sorted_probs.sum())
    return probs


def sample(logits: torch.Tensor, seqs: list[Sequence],
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` [B, V] for the matching sequence, on the logits' device and
    without waiting for it: int64 [B] (the caller reads it back once per step). ``argmax``: a faster
    row-wise argmax than ``torch.argmax``, e.g. the native one. A seeded request's generator must be on
    the same device."""
    out = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            probs = target_probs(logits[i], seq.params)
            out[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    return out
