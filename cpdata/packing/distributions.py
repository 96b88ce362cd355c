"""Realistic document-length distributions, for tests and packing benchmarks.

Token counts of real corpora are close to lognormal (parameterised here by
median and sigma; mean = median * exp(sigma^2 / 2)), clipped to ``[1, cap]``.
Multi-turn chat is a sum of turns, which puts more short conversations in the
left tail than a single lognormal of the same mean.

| name           | model                                           | mean  | cap  |
|----------------|-------------------------------------------------|-------|------|
| ``alpaca``     | lognormal, median 70, sigma 0.70                | ~90   | 4K   |
| ``sft``        | lognormal, median 450, sigma 0.90               | ~670  | 32K  |
| ``ultrachat``  | 1 + Poisson(2.2) turns of user lognormal(60, 0.9) + assistant lognormal(300, 0.6), + 20 | ~1450 | 32K |
| ``web``        | lognormal, median 380, sigma 1.10               | ~690  | 128K |
| ``long_context`` | lognormal, median 2000, sigma 1.50            | ~6100 | 128K |
| ``chat_narrow``| lognormal, median 1250, sigma 0.55 (hard case)  | ~1450 | 32K  |

``chat_narrow`` has almost no documents shorter than 300 tokens, so at a 4K
capacity the gaps cannot be filled: even first-fit-decreasing over the whole
set stays ~0.4 percentage points above ``ceil(tokens / capacity)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["BENCHMARK_CASES", "DISTRIBUTIONS", "HARD_CASES", "sample_lengths"]


def _lognormal(median: float, sigma: float, cap: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), 1, cap)

    return sample


def _multi_turn(rng: np.random.Generator, n: int) -> np.ndarray:
    turns = 1 + rng.poisson(2.2, size=n)
    total = np.full(n, 20.0)
    for t in range(int(turns.max(initial=0))):
        live = turns > t
        k = int(live.sum())
        total[live] += rng.lognormal(np.log(60), 0.9, size=k) + rng.lognormal(np.log(300), 0.6, size=k)
    return np.clip(np.rint(total), 1, 32768)


DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "alpaca": _lognormal(70, 0.70, 4096),
    "sft": _lognormal(450, 0.90, 32768),
    "ultrachat": _multi_turn,
    "web": _lognormal(380, 1.10, 131072),
    "long_context": _lognormal(2000, 1.50, 131072),
    "chat_narrow": _lognormal(1250, 0.55, 32768),
}
"""name -> ``sample(rng, n)``."""

BENCHMARK_CASES: tuple[tuple[str, int, str, int], ...] = (
    ("alpaca", 4096, "error", 100_000),
    ("sft", 4096, "split", 40_000),
    ("sft", 16384, "split", 100_000),
    ("ultrachat", 4096, "split", 40_000),
    ("ultrachat", 16384, "split", 100_000),
    ("web", 4096, "split", 40_000),
    ("web", 16384, "split", 100_000),
    ("long_context", 16384, "split", 20_000),
    ("long_context", 131072, "error", 60_000),
    ("alpaca", 131072, "error", 400_000),
    ("sft", 131072, "split", 400_000),
    ("web", 131072, "split", 400_000),
)
"""(distribution, capacity, overflow, documents): enough documents for about
2000+ packs, so that one extra pack costs under 0.05 percentage points; the
short documents at 128K (1024 of them are less than one pack) make ~280
(``alpaca``) and ~2,100 packs, where the bound is reachable exactly."""

HARD_CASES: tuple[tuple[str, int, str, int], ...] = (("chat_narrow", 4096, "split", 20_000),)
"""Cases where the lower bound is out of reach for any packer (see module docstring)."""


def sample_lengths(name: str, n: int, seed: int = 0) -> np.ndarray:
    """int64 ``[n]`` document lengths drawn from distribution ``name``."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {name!r}; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[name](np.random.default_rng(seed), n).astype(np.int64)
