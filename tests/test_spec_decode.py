"""Speculative decoding: the rejection rule preserves the target distribution; greedy is exact match."""

from pathlib import Path

import numpy as np
import pytest
import torch

from reference_server.config import EngineConfig
from reference_server.engine.iteration import IterationRecord
from reference_server.speculation.spec_decode import (
    AdaptiveK,
    Draft,
    Governor,
    NgramProposer,
    SpecDecoder,
    verify_greedy,
    verify_sampled,
)

V = 6
# chi-square critical value, 5 degrees of freedom, alpha = 0.001
CHI2_CRIT_DF5 = 20.515


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _dist(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)


P0, P1, P2 = _dist(1), _dist(2), _dist(3)
Q0, Q1 = _dist(11), _dist(12)
N = 12_000


def _run(draft_fn, n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    g = torch.Generator().manual_seed(seed)
    first, second, accepted = np.zeros(V), np.zeros(V), 0
    target = torch.stack([P0, P1, P2])
    for _ in range(n):
        draft = draft_fn(g)
        out = verify_sampled(draft, target[: len(draft) + 1], g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        accepted += len(out) - 1
    return first, second, accepted / (n * 2)


def test_sampled_draft_follows_target_distribution():
    q = torch.stack([Q0, Q1])

    def draft_fn(g):
        return Draft([int(torch.multinomial(Q0, 1, generator=g)), int(torch.multinomial(Q1, 1, generator=g))], q)

    first, second, rate = _run(draft_fn)
    assert chi2(first, P0.numpy()) < CHI2_CRIT_DF5
    assert chi2(second, P1.numpy()) < CHI2_CRIT_DF5  # target rows do not depend on the first token
    # expected acceptance of the first draft token is sum(min(p, q)); the rate is a loose check on it
    assert 0.2 < rate < float(torch.minimum(P0, Q0).sum())
    # negative control: emitting the draft unverified follows q, and the test notices
    control = np.bincount([int(torch.multinomial(Q0, 1)) for _ in range(N)], minlength=V)
    assert chi2(control, P0.numpy()) > CHI2_CRIT_DF5


def test_deterministic_draft_follows_target_distribution():
    # n-gram drafts are point masses: q = one_hot(x); always propose token 2 then token 0
    first, second, _ = _run(lambda g: Draft([2, 0]), seed=1)
    assert chi2(first, P0.numpy()) < CHI2_CRIT_DF5
    assert chi2(second, P1.numpy()) < CHI2_CRIT_DF5
    # P(keep token 2) = p0[2]
    assert abs(first[2] / N - float(P0[2])) < 0.02


def test_all_accepted_gives_bonus_token():
    sure = torch.zeros(3, V)
    sure[0, 4] = sure[1, 1] = sure[2, 5] = 1.0
    assert verify_sampled(Draft([4, 1]), sure) == [4, 1, 5]
    with pytest.raises(ValueError, match="target rows"):
        verify_sampled(Draft([4, 1]), sure[:2])


def test_greedy_is_exact_match():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept + bonus
    assert verify_greedy([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # first mismatch replaced, rest dropped
    assert verify_greedy([], [3]) == [3]  # no draft: an ordinary decode step


def test_ngram_lookup():
    prop = NgramProposer(n_max=3, n_min=1)
    # context ends in [7, 8]; earlier [7, 8] was followed by 9, 10, 11
    assert prop.propose([1, 7, 8, 9, 10, 11, 2, 7, 8], k=3).tokens == [9, 10, 11]
    # the longest suffix wins over a later shorter match: [3, 4] -> 5 beats the later lone [4] -> 6
    assert prop.propose([3, 4, 5, 4, 6, 3, 4], k=1).tokens == [5]
    assert prop.propose([1, 2, 3], k=4).tokens == []  # nothing repeats
    assert prop.propose([4, 1, 2, 4], k=4).tokens == [1, 2, 4]  # cut at the end of the context


def test_adaptive_k_and_switch_off():
    k = AdaptiveK(k_max=4)
    k.update(drafted=4, accepted=1)
    assert k.k == 4  # a partly kept draft keeps its length
    k.update(drafted=4, accepted=0)
    assert k.k == 3
    k.update(drafted=3, accepted=3)
    k.update(drafted=4, accepted=4)
    assert k.k == 4
    dec = SpecDecoder(EngineConfig(model=Path("m"), spec="ngram", spec_max_batch=2), NgramProposer())
    assert dec.active(1) and dec.active(2) and not dec.active(3)
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(model=Path("m"), spec="draft")
    with pytest.raises(ValueError, match="spec_ngram_min"):
        EngineConfig(model=Path("m"), spec_ngram_min=3, spec_ngram_max=2)


def _record(seconds: float, tokens: int, prefill: int = 0) -> IterationRecord:
    return IterationRecord(i=0, t_unix=100.0, t_end_unix=100.0 + seconds, seq_ids=[], prefill_tokens=prefill,
                           decode_tokens=1, kv_blocks_used=0, kv_blocks_total=1, num_running=1, num_waiting=0,
                           preempted=[], padding_tokens=0, output_tokens=tokens)


def _govern(g: Governor, n: int, steps: int, step: dict[int, tuple[float, int]]) -> list[int]:
    """``steps`` engine steps with ``n`` decoding requests; a step under draft cap c takes ``step[c]`` =
    (seconds, output tokens). Returns the governor's caps."""
    caps = []
    for _ in range(steps):
        cap = g.choose(n)
        g.observe(_record(*step[cap]))
        caps.append(cap)
    return caps


def test_governor_caps_drafts_where_it_measures_fastest():
    g = Governor(k_max=4)
    assert g.caps == [0, 1, 2, 4] and Governor(6).caps == [0, 1, 2, 4, 6] and Governor(1).caps == [0, 1]
    w, e = Governor.WARMUP, Governor.EXPLORE
    # one request: a step costs about the same whatever its draft; longer drafts emit more
    one = _govern(g, 1, 96, {0: (0.010, 1), 1: (0.011, 2), 2: (0.011, 2), 4: (0.012, 4)})
    assert one[: 4 * w] == [4] * w + [2] * w + [1] * w + [0] * w  # each arm measured, longest drafts first
    assert one[4 * w :].count(4) >= 96 - 4 * w - 96 // e - 1 and 2 in one[4 * w :]  # the neighbour re-tried
    # four requests: rows cost; the middle cap pays best (neighbours tried, drafting off never chosen)
    four = _govern(g, 4, 96, {0: (0.020, 4), 1: (0.022, 6), 2: (0.030, 7), 4: (0.080, 8)})
    assert four[4 * w :].count(1) >= 96 - 4 * w - 96 // e - 1 and {0, 2} <= set(four[4 * w :])
    # eight requests: any draft costs more than it gives: off, drafting re-tried now and then
    eight = _govern(g, 8, 96, {0: (0.030, 8), 1: (0.060, 10), 2: (0.070, 11), 4: (0.150, 12)})
    assert eight[4 * w :].count(0) >= 96 - 4 * w - 96 // e - 1 and 1 in eight[4 * w :]
    # the text turns unpredictable: drafts stop paying at one request, and the governor follows
    later = _govern(g, 1, 160, {0: (0.010, 1), 1: (0.011, 1), 2: (0.011, 1), 4: (0.012, 1)})
    assert later[-32:].count(0) >= 32 - 32 // e - 1
    # a step with prefill rows, or without output, says nothing about decode speed
    before = dict(g.rate)
    g.choose(1)
    g.observe(_record(10.0, 1, prefill=100))
    assert g.rate == before
    assert [Governor.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
