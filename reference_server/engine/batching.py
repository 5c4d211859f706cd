"""Batching strategies as an admission gate in front of the one scheduling rule.

* ``continuous`` (default): iteration-level; anyone may join whenever budget and KV allow.
* ``dynamic``: a batch forms when ``batch_size`` requests wait or the oldest has waited ``max_delay_s``;
  it runs to completion and nobody joins until every member has finished.
* ``static``: like dynamic but waits for a full batch of ``batch_size`` (with a ``STATIC_TAIL_S``
  timeout, so the last partial batch of a run is still served).

Static and dynamic batches also reserve a full context slot (``slot_tokens`` = the max model length)
per member at admission, as a padded batch with a contiguous per-slot cache does; continuous batching
allocates paged blocks as tokens arrive. Same pool, so the KV pool limits a padded batch much sooner.
Finished members of a static/dynamic batch stay in it as padding rows (``Scheduler.padding``): each step
still computes one row for them, output discarded, until the last member finishes, as a padded
``[batch, time]`` tensor does. (Prompts are not padded to the batch's longest: prefill cost is not modelled.)
The model code is the same in all three; only who may be admitted, and how much KV it takes, differ.
"""

from __future__ import annotations

import time

from reference_server.engine.sequence import Sequence

BATCHING = ("continuous", "dynamic", "static")
STATIC_TAIL_S = 2.0  # static: a partial batch starts only after this long (the end of a run)


class BatchGate:
    def __init__(self, mode: str = "continuous", batch_size: int = 16, max_delay_s: float = 0.05,
                 slot_tokens: int = 0) -> None:
        if mode not in BATCHING:
            raise ValueError(f"unknown batching strategy {mode!r}: choose one of {', '.join(BATCHING)}")
        if batch_size < 1 or max_delay_s < 0:
            raise ValueError("batch size must be >= 1 and the batch delay >= 0")
        self.mode, self.batch_size, self.slot_tokens = mode, batch_size, slot_tokens
        self.max_delay_s = STATIC_TAIL_S if mode == "static" else max_delay_s
        self.members: set[str] = set()  # the open batch's requests not yet admitted

    @property
    def continuous(self) -> bool:
        return self.mode == "continuous"

    def admissible(self, waiting: list[Sequence], running: list[Sequence]) -> list[Sequence]:
        """The waiting requests (in the given order) that may be admitted now."""
        if self.continuous:
            return list(waiting)
        self.members &= {s.seq_id for s in waiting}  # aborted members leave the batch
        if not self.members and not running and waiting:
            oldest = min(s.arrival for s in waiting)
            if len(waiting) >= self.batch_size or time.monotonic() - oldest >= self.max_delay_s:
                self.members = {s.seq_id for s in waiting[: self.batch_size]}
        return [s for s in waiting if s.seq_id in self.members]

    def admitted(self, seq: Sequence) -> None:
        self.members.discard(seq.seq_id)

    def reserve_tokens(self, seq: Sequence) -> int:
        """KV tokens to hold at admission: a whole slot for padded batches (at least the request's span)."""
        if self.continuous:
            return 0
        return max(self.slot_tokens, seq.num_tokens + max(0, seq.params.max_tokens - seq.num_output_tokens))
