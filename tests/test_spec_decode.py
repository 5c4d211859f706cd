"""Speculative decoding: the rejection rule preserves the target distribution; greedy is exact match."""

import numpy as np
import pytest
import torch

from reference_server.spec_decode import (
    AdaptiveK,
    Draft,
    NgramProposer,
    SpecConfig,
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
    assert k.k == 3
    k.update(drafted=3, accepted=3)
    k.update(drafted=4, accepted=4)
    assert k.k == 4
    cfg = SpecConfig(method="ngram", max_batch=2)
    assert cfg.active(1) and cfg.active(2) and not cfg.active(3)
    assert not SpecConfig().active(1)
    with pytest.raises(ValueError, match="draft model"):
        SpecConfig(method="draft")
