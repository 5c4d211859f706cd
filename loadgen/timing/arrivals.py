"""Open-loop arrival processes: seeded generators of intended send times (seconds from the start).

``gamma`` with shape ``burstiness`` keeps the mean rate and changes only the spread of the gaps
(shape 1 is Poisson, < 1 burstier, > 1 more regular), as in vLLM ``bench serve --burstiness``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator


def arrival_times(process: str, rate: float, seed: int, burstiness: float = 1.0) -> Iterator[float]:
    """Infinite, increasing send times for ``rate`` requests/s; the first request goes at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    if process == "constant":
        gap = 1.0 / rate
        return (i * gap for i in itertools.count())
    if process == "poisson":
        return _cumulative(lambda rng: rng.expovariate(rate), seed)
    if process == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        scale = 1.0 / (rate * burstiness)
        return _cumulative(lambda rng: rng.gammavariate(burstiness, scale), seed)
    raise ValueError(f"unknown open-loop arrival process {process!r}; choose constant, poisson or gamma")


def _cumulative(draw: Callable[[random.Random], float], seed: int) -> Iterator[float]:
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        t += draw(rng)
