"""Are two passes' sampled outcomes drawn from the same distribution? (``bench verify --draws``)

Per prompt, each pass has a few draws of a categorical outcome (an answer's first token), or of a tuple of them
(its first tokens, position by position). The statistic is the mean over prompts (and positions) of the total
variation distance (TVD) between the two passes' outcome frequencies (at that position: the marginals, which
equal distributions share); its null distribution comes from a **stratified permutation test**: within each
prompt the draws of both passes are pooled and the pass labels dealt again at random to whole draws (as many to
each pass as it had; a draw's positions move together, so their dependence is kept), ``n_perm`` times with a
fixed RNG seed, so the test is exact for any number of draws and cannot flake. p = (1 + #{null >= observed}) /
(1 + n_perm). The null's 95th percentile is the test's resolution: the smallest mean TVD these draws could tell
apart from sampling noise (with few draws per prompt, even identical distributions give a sizeable mean TVD).
Pure functions, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

N_PERM = 2000
PERM_SEED = 20261128  # the permutation RNG's fixed seed: the same draws give the same p-value


def tvd(a: Mapping[Hashable, int], b: Mapping[Hashable, int]) -> float:
    """The total variation distance between two count tables' frequencies: half the L1 distance (0: the same
    frequencies, 1: no outcome in common); nan when either is empty."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return float("nan")
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in a.keys() | b.keys())


def mean_tvd(pairs: Sequence[tuple[Sequence[Hashable], Sequence[Hashable]]]) -> float:
    """The mean over prompts of the TVD between the two passes' draws (prompts with draws in both)."""
    vals = [tvd(Counter(a), Counter(b)) for a, b in pairs if a and b]
    return float(np.mean(vals)) if vals else float("nan")


@dataclass(frozen=True)
class PermutationTest:
    statistic: float  # the observed mean TVD (over prompts and positions)
    p: float  # (1 + #{permuted statistic >= observed}) / (1 + n_perm)
    null_q95: float  # the permutation null's 95th percentile of the statistic: the test's resolution
    prompts: int  # prompts with draws in both passes
    n_perm: int
    seed: int


def permutation_test(pairs: Sequence[tuple[Sequence[Hashable], Sequence[Hashable]]], n_perm: int = N_PERM,
                     seed: int = PERM_SEED) -> PermutationTest:  # fmt: skip
    """The stratified permutation test of the mean TVD (see the module; :func:`mean_tvd` for one position): per
    prompt its two samples ``(a, b)`` of outcomes (tuples: per position); prompts where either is empty are left out. Raises ValueError when no prompt is left or ``n_perm`` < 1."""
    if n_perm < 1:
        raise ValueError(f"n_perm must be >= 1, got {n_perm}")
    kept = [(list(map(_positions, a)), list(map(_positions, b))) for a, b in pairs if len(a) and len(b)]
    if not kept:
        raise ValueError("no prompt has draws in both samples")
    rng = np.random.default_rng(seed)
    null = np.zeros(n_perm)
    observed = 0.0
    for a, b in kept:
        na, nb = len(a), len(b)
        width = max(map(len, (*a, *b)))
        order = rng.permuted(np.broadcast_to(np.arange(na + nb), (n_perm, na + nb)), axis=1)
        for j in range(width):  # each position's marginal, under the same relabelling of whole draws
            column = [v[j] if j < len(v) else None for v in (*a, *b)]  # None: the draw ended before position j
            codes = {v: i for i, v in enumerate(dict.fromkeys(column))}
            pooled = np.array([codes[v] for v in column], dtype=np.int64)
            observed += _tvd_rows(pooled[None, :], na, nb, len(codes))[0] / width
            null += _tvd_rows(pooled[order], na, nb, len(codes)) / width
    k = len(kept)
    observed, null = observed / k, null / k
    exceed = int(np.sum(null >= observed - 1e-12))  # a tolerance: float sums of the same counts in another order
    return PermutationTest(float(observed), (1 + exceed) / (1 + n_perm), float(np.quantile(null, 0.95)), k, n_perm,
                           seed)  # fmt: skip


def _positions(v: Hashable) -> tuple[Hashable, ...]:
    """A draw's outcome as positions: a tuple as it is, any other value as one position."""
    return v if isinstance(v, tuple) else (v,)


def _tvd_rows(rows: np.ndarray, na: int, nb: int, m: int) -> np.ndarray:
    """Per row of outcome codes (its first ``na`` one sample, the other ``nb`` the other; codes < ``m``): the TVD."""
    n = rows.shape[0]
    offset = np.arange(n)[:, None] * m
    ca = np.bincount((rows[:, :na] + offset).ravel(), minlength=n * m).reshape(n, m)
    cb = np.bincount((rows[:, na:] + offset).ravel(), minlength=n * m).reshape(n, m)
    return 0.5 * np.abs(ca / na - cb / nb).sum(axis=1)
