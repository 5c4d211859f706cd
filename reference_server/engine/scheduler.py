"""One scheduling rule (vLLM v1): every request's ``num_computed_tokens`` chases its ``num_tokens``.

Each step hands out at most ``max_num_batched_tokens`` new tokens over at most ``max_num_seqs``
requests, running requests first, then waiting ones in policy order. A decode is a gap of 1, a prompt
is a gap of its length (cut into chunks by the budget), a prefix hit shrinks the gap before the first
step. When the KV pool runs dry the policy's victim is preempted (blocks freed, recomputed later).

Policies are pluggable: ``Policy.waiting_key`` orders admission, ``Policy.victim`` picks whom to preempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from reference_server.engine.batching import BatchGate
from reference_server.engine.block_manager import BlockManager
from reference_server.engine.sequence import SeqStatus, Sequence


class Policy(Protocol):
    def waiting_key(self, seq: Sequence) -> tuple[float, ...]: ...

    def victim(self, running: list[Sequence]) -> Sequence: ...

    def should_preempt(self, incoming: Sequence, running: list[Sequence]) -> Sequence | None:
        """A running request to evict so that ``incoming`` (which does not fit) can start; None: wait."""
        ...


class FifoPolicy:
    """First come, first served; preempt the latest arrival."""

    def waiting_key(self, seq: Sequence) -> tuple[float, ...]:
        return (seq.order,)

    def victim(self, running: list[Sequence]) -> Sequence:
        return max(running, key=lambda s: s.order)

    def should_preempt(self, incoming: Sequence, running: list[Sequence]) -> Sequence | None:
        return None


@dataclass
class ScheduledBatch:
    """What one step computes: ``(seq, num_new_tokens)`` pairs, in row order."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    padding: list[Sequence] = field(default_factory=list)  # finished members of a padded batch (no output)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: Policy | None = None,
        gate: BatchGate | None = None,
    ) -> None:
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy: Policy = policy or FifoPolicy()
        self.gate = gate or BatchGate()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Static/dynamic batching: finished members stay in the batch as padding rows (computed, output
        # discarded, KV slot held) until its last member finishes, as in a padded [batch, time] tensor.
        self.padding: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (finished or aborted) and free its blocks at once, unless it finished inside a
        padded batch that is still running: then it stays on as a padding row until the batch ends."""
        was_running = seq.status is SeqStatus.RUNNING
        if was_running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if was_running and reason in ("stop", "length") and not self.gate.continuous and self.running:
            self.padding.append(seq)
        else:
            self.bm.release(seq)
        self._end_padded_batch()

    def _end_padded_batch(self) -> None:
        """The batch's last real member is gone: its padding rows leave and free their slots."""
        if not self.running:
            for seq in self.padding:
                self.bm.release(seq)
            self.padding.clear()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        self._end_padded_batch()
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The gap to close this step; draft tokens count like any other (cut short by the budget)."""
        gap = seq.num_tokens - seq.num_computed_tokens
        n = min(gap + len(seq.spec_token_ids), budget)
        del seq.spec_token_ids[max(0, n - gap) :]
        return n

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(padding=list(self.padding))
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget)
            while not self.bm.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.policy.victim([s for s in self.running if s.seq_id not in scheduled] or [seq])
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.bm.grow(seq, seq.num_computed_tokens + n)
            batch.items.append((seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        if batch.preempted:  # pool is full: admit nobody this step
            return batch
        self.waiting.sort(key=self.policy.waiting_key)
        candidates = self.gate.admissible(self.waiting, self.running)
        while candidates and budget > 0:
            seq = candidates[0]
            # a pooling request needs every token's hidden state: no prefix hits
            hits = [] if seq.pooling else self.bm.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill and budget < self.max_num_batched_tokens:
                break  # without chunking a prompt runs whole; a too-long one only runs alone
            if not self.enable_chunked_prefill:
                n = remaining
            hold = max(seq.num_tokens - remaining + n, self.gate.reserve_tokens(seq))
            if len(self.running) >= self.max_num_seqs or not self.bm.can_admit(seq, hits, hold):
                victim = self.policy.should_preempt(seq, self.running)
                if victim is None:
                    break
                self._preempt(victim)  # a lower-priority request makes room (recomputed later)
                batch.preempted.append(victim)
                batch.items = [(s, k) for s, k in batch.items if s is not victim]
                budget = self.max_num_batched_tokens - batch.num_tokens
                continue
            candidates.pop(0)
            self.waiting.remove(seq)
            self.gate.admitted(seq)
            self.bm.admit(seq, hits)
            self.bm.grow(seq, max(seq.num_computed_tokens + n, hold))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def advance(self, batch: ScheduledBatch) -> None:
        """Record the step's KV as computed and publish full blocks to the prefix cache (also for a
        request that this step's output is about to finish: its last blocks are valid too)."""
        for seq, n in batch.items:
            if seq.status is SeqStatus.FINISHED:  # failed or aborted during this step: blocks released
                continue
            seq.num_computed_tokens += n
            self.bm.commit(seq)
