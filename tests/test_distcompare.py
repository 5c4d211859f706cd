"""The distribution comparison of sampled answers (:mod:`loadgen.metrics.distcompare`): the TVD and its
stratified permutation test, on draws made with fixed seeds (the verdicts cannot flake)."""

from __future__ import annotations

import random

import pytest

from loadgen.metrics.distcompare import mean_tvd, permutation_test, tvd


def draws(weights: dict[str, float], k: int, rng: random.Random) -> list[str]:
    return rng.choices(list(weights), weights=list(weights.values()), k=k)


def samples(p: list[dict[str, float]], q: list[dict[str, float]], k: int, seed: int) -> list[tuple[list[str], list[str]]]:
    """Per prompt, ``k`` draws from its ``p`` and ``k`` from its ``q``."""
    rng = random.Random(seed)
    return [(draws(a, k, rng), draws(b, k, rng)) for a, b in zip(p, q, strict=True)]


# eight prompts, each its own first-token distribution
PROMPTS = [{" the": 0.5, " a": 0.3, " it": 0.2}, {" Paris": 0.9, " the": 0.1}, {"1": 0.4, "2": 0.4, "3": 0.2},
           {" yes": 0.6, " no": 0.4}, {" I": 0.7, " We": 0.2, " You": 0.1}, {",": 0.5, ".": 0.5},
           {" cat": 0.25, " dog": 0.25, " bird": 0.25, " fish": 0.25}, {" is": 0.8, " was": 0.2}]  # fmt: skip
# the same prompts, the most likely outcome of each moved to another (what a wrong sampler could do)
SHIFTED = [dict(zip(p, sorted(p.values()), strict=True)) for p in PROMPTS]


def test_tvd_and_its_mean_are_what_they_say():
    assert tvd({"a": 2}, {"a": 5}) == 0.0
    assert tvd({"a": 2}, {"b": 3}) == 1.0
    assert tvd({"a": 1, "b": 1}, {"a": 3, "b": 1}) == pytest.approx(0.25)  # |.5-.75|/2 + |.5-.25|/2
    assert mean_tvd([(["a", "a"], ["b", "b"]), (["a", "b"], ["a", "b"]), (["a"], [])]) == pytest.approx(0.5)


def test_identical_draws_give_p_one_and_disjoint_ones_the_smallest_p():
    same = permutation_test([(["a", "b", "a", "c"], ["a", "b", "a", "c"])] * 4, n_perm=500)
    assert same.statistic == 0.0 and same.p == 1.0 and same.prompts == 4
    apart = permutation_test([(["a"] * 8, ["b"] * 8)] * 4, n_perm=500)
    assert apart.statistic == 1.0 and apart.p == pytest.approx(1 / 501) and apart.null_q95 < 0.5


def test_draws_from_the_same_distributions_pass_and_from_shifted_ones_fail():
    """16 draws per prompt and pass, 8 prompts: the same distributions in both passes give a p far above 0.05
    (seeds fixed: no flake), the shifted ones a p at the test's floor; and the observed mean TVD of the same
    distributions lies under the null's 95th percentile (the resolution), the shifted one far above it."""
    same = permutation_test(samples(PROMPTS, PROMPTS, 16, seed=1))
    assert same.p >= 0.05 and same.statistic < same.null_q95, same
    shifted = permutation_test(samples(PROMPTS, SHIFTED, 16, seed=1))
    assert shifted.p < 0.01 and shifted.statistic > shifted.null_q95, shifted
    assert permutation_test(samples(PROMPTS, SHIFTED, 16, seed=1)) == shifted  # deterministic
    ps = [permutation_test(samples(PROMPTS, PROMPTS, 16, seed=s), n_perm=300).p for s in range(20)]
    assert sum(p < 0.05 for p in ps) <= 3  # a valid test: about 5 % of same-distribution samples reject


def test_a_broken_statistic_would_be_caught():
    """The permutation keeps each prompt's pooled draws (stratified): pooling across prompts would call two
    passes with the same per-prompt distributions different whenever the prompts differ. Here every prompt's
    draws are the same in both passes but prompts differ wildly: p must be 1."""
    pairs = [(["x"] * 6, ["x"] * 6), (["y"] * 6, ["y"] * 6), (["z", "w"] * 3, ["w", "z"] * 3)]
    assert permutation_test(pairs, n_perm=300).p == 1.0
    with pytest.raises(ValueError):
        permutation_test([([], ["a"])])


def test_a_shift_at_a_later_position_is_caught():
    """Outcomes as the first tokens, position by position (a speculative decoder's first token comes from the
    prefill; its drafted tokens follow): first tokens from the same distributions in both passes and a shifted
    second one is caught, though the first position alone passes; the same two-token distributions pass."""
    rng = random.Random(3)

    def pairs(second_b: list[dict[str, float]]) -> list[tuple[list[tuple[str, str]], list[tuple[str, str]]]]:
        return [(list(zip(draws(p, 24, rng), draws(p, 24, rng), strict=True)),
                 list(zip(draws(p, 24, rng), draws(q, 24, rng), strict=True)))
                for p, q in zip(PROMPTS, second_b, strict=True)]  # fmt: skip

    same, shifted = permutation_test(pairs(PROMPTS)), pairs(SHIFTED)
    assert same.p >= 0.05, same
    assert permutation_test(shifted).p < 0.01, permutation_test(shifted)
    assert permutation_test([([d[0] for d in a], [d[0] for d in b]) for a, b in shifted]).p >= 0.05  # blind to it
