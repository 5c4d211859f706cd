"""A request inside the engine: its tokens, how many have KV computed, and its block table."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by a tinier one
overflows to inf and the softmax to NaN."""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # below SAMPLING_EPS -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # per output token: its raw logprob and this many top ones; None: none

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


_counter = itertools.count()


class Sequence:
    """One request. ``num_computed_tokens`` chases ``num_tokens``: that gap is all the scheduler looks at.

    ``params`` None makes a pooling request (an embedding input): its prompt is prefilled like any other,
    in chunks under the token budget, but nothing is sampled; each chunk's final-norm hidden states are
    summed into ``pooled`` and, once the prompt is computed, ``embedding`` holds their L2-normalised sum."""

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams | None,
        seq_id: str | None = None,
        priority: int = 0,
    ) -> None:
        self.seq_id = seq_id if seq_id is not None else f"seq-{next(_counter)}"
        self.order = next(_counter)  # arrival order (FIFO key)
        self.arrival = time.monotonic()
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at (last) admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix keys of this sequence's full, computed blocks
        self.status = SeqStatus.WAITING
        self.pooling = params is None
        self.params = params or SamplingParams(max_tokens=0)
        self.pooled: torch.Tensor | None = None  # pooling: float32 sum of the computed tokens' hidden states
        self.embedding: torch.Tensor | None = None  # pooling: set once every prompt token is computed
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.priority = priority  # higher first under the priority policy
        self.spec_token_ids: list[int] = []  # draft tokens to verify this step (speculative decoding)
        self.spec_drafted = 0  # draft tokens verified for this request so far
        self.spec_accepted = 0  # of which accepted
        self.generator: torch.Generator | None = None
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
