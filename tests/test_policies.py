"""Scheduling policies and the batching gate on plain sequences (no model)."""

import time

import pytest

from reference_server.engine.batching import BatchGate
from reference_server.engine.policies import PriorityPolicy, SjfPolicy, make_policy
from reference_server.engine.sequence import SamplingParams, Sequence


def seq(n_prompt: int, max_tokens: int, priority: int = 0, waited: float = 0.0) -> Sequence:
    s = Sequence(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), priority=priority)
    s.arrival -= waited
    return s


def test_sjf_orders_by_work_left_and_ages():
    p = SjfPolicy(aging_s=1.0, aging_tokens=64)
    long, short = seq(10, 200), seq(10, 20)
    assert sorted([long, short], key=p.waiting_key) == [short, long]
    old_long = seq(10, 200, waited=3.0)  # 3 s of waiting = 192 tokens shorter: 210 - 192 < 30
    assert sorted([short, old_long], key=p.waiting_key) == [old_long, short]
    assert p.victim([short, long]) is long


def test_priority_orders_ages_and_preempts_only_lower():
    p = PriorityPolicy(aging_s=10.0)
    low, high = seq(4, 8, priority=0), seq(4, 8, priority=5)
    assert sorted([low, high], key=p.waiting_key) == [high, low]
    starving = seq(4, 8, priority=0, waited=60.0)  # 60 s / 10 s = 6 levels > 5
    assert sorted([high, starving], key=p.waiting_key) == [starving, high]
    assert p.should_preempt(high, [low]) is low
    assert p.should_preempt(low, [high]) is None
    with pytest.raises(ValueError, match="policy"):
        make_policy("lottery")


def test_static_gate_waits_for_a_full_batch_and_closes_it():
    gate = BatchGate("static", batch_size=2, slot_tokens=64)
    a, b, c = seq(4, 8), seq(4, 8), seq(4, 8)
    assert gate.admissible([a], []) == []  # one waiting: not a batch yet
    assert gate.admissible([a, b, c], []) == [a, b]
    gate.admitted(a)
    gate.admitted(b)
    assert gate.admissible([c], [a, b]) == []  # a running batch admits nobody
    assert gate.reserve_tokens(c) == 64


def test_dynamic_gate_starts_a_partial_batch_after_the_delay():
    gate = BatchGate("dynamic", batch_size=8, max_delay_s=0.05)
    a = seq(4, 8)
    a.arrival = time.monotonic()
    assert gate.admissible([a], []) == []
    a.arrival -= 0.1
    assert gate.admissible([a], []) == [a]
    assert BatchGate("continuous").admissible([a], [a]) == [a]
