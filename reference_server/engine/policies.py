"""Scheduling policies beyond FIFO: shortest-job-first and priority, both aged against starvation.

A policy orders the waiting queue (``waiting_key``, smaller first) and names the running request to
preempt when the KV pool runs dry (``victim``). Aging: every ``aging_s`` seconds since a request arrived
count as one step better, for admission and for the choice of a victim alike. Time since arrival (not
since the last admission) keeps running through a preemption, so a request cannot be chosen as the victim
again and again: each time it comes back it ranks higher against everyone who arrived after it.
"""

from __future__ import annotations

import time

from reference_server.engine.scheduler import FifoPolicy, Policy
from reference_server.engine.sequence import Sequence

POLICIES = ("fifo", "sjf", "priority")


def _waited(seq: Sequence, now: float) -> float:
    return max(0.0, now - seq.arrival)


class SjfPolicy:
    """Shortest job first by the work left: remaining prompt tokens plus requested output tokens.

    ``aging_s`` seconds of waiting make a job look ``aging_tokens`` tokens shorter."""

    def __init__(self, aging_s: float = 1.0, aging_tokens: int = 64) -> None:
        self.aging_s, self.aging_tokens = aging_s, aging_tokens

    def job_size(self, seq: Sequence) -> float:
        return (seq.num_tokens - seq.num_computed_tokens) + (seq.params.max_tokens - seq.num_output_tokens)

    def aged_size(self, seq: Sequence, now: float) -> float:
        return self.job_size(seq) - self.aging_tokens * _waited(seq, now) / self.aging_s

    def waiting_key(self, seq: Sequence) -> tuple[float, ...]:
        return (self.aged_size(seq, time.monotonic()), seq.order)

    def victim(self, running: list[Sequence]) -> Sequence:
        now = time.monotonic()
        return max(running, key=lambda s: (self.aged_size(s, now), s.order))

    def should_preempt(self, incoming: Sequence, running: list[Sequence]) -> Sequence | None:
        return None  # SJF orders the queue; it does not evict running work


class PriorityPolicy:
    """Higher ``priority`` first (ties FIFO); each ``aging_s`` waited adds one priority level.

    The victim is the running request of the lowest aged priority (latest arrival among equals), so a
    full pool preempts low-priority work in favour of high-priority arrivals, but not a low-priority
    request that has been in the system long enough to outrank them."""

    def __init__(self, aging_s: float = 10.0) -> None:
        self.aging_s = aging_s

    def effective(self, seq: Sequence, now: float) -> float:
        return seq.priority + _waited(seq, now) / self.aging_s

    def waiting_key(self, seq: Sequence) -> tuple[float, ...]:
        return (-self.effective(seq, time.monotonic()), seq.order)

    def victim(self, running: list[Sequence]) -> Sequence:
        now = time.monotonic()
        return min(running, key=lambda s: (self.effective(s, now), -s.order))

    def should_preempt(self, incoming: Sequence, running: list[Sequence]) -> Sequence | None:
        """A running request of lower aged priority to make room for ``incoming``, if any."""
        now = time.monotonic()
        lower = [s for s in running if self.effective(s, now) < self.effective(incoming, now)]
        return self.victim(lower) if lower else None


def make_policy(name: str, aging_s: float | None = None) -> Policy:
    if name == "fifo":
        return FifoPolicy()
    if name == "sjf":
        return SjfPolicy() if aging_s is None else SjfPolicy(aging_s=aging_s)
    if name == "priority":
        return PriorityPolicy() if aging_s is None else PriorityPolicy(aging_s=aging_s)
    raise ValueError(f"unknown scheduling policy {name!r}: choose one of {', '.join(POLICIES)}")
