"""Realistic document-length distributions, for tests and packing benchmarks.

Lognormal token counts (median, sigma), clipped to ``[1, cap]``; ``ultrachat`` is a sum of turns, with
more short conversations than one lognormal of its mean:

| name           | model                                            | mean  | cap  |
|----------------|--------------------------------------------------|-------|------|
| ``alpaca``     | lognormal(70, 0.70)                              | ~90   | 4K   |
| ``sft``        | lognormal(450, 0.90)                             | ~670  | 32K  |
| ``ultrachat``  | 1 + Poisson(2.2) turns of lognormal(60, 0.9) + lognormal(300, 0.6), + 20 | ~1450 | 32K |
| ``web``        | lognormal(380, 1.10)                             | ~690  | 128K |
| ``long_context`` | lognormal(2000, 1.50)                          | ~6100 | 128K |
| ``chat_narrow``| lognormal(1250, 0.55): hardly any under 300 tokens (hard case) | ~1450 | 32K  |

At 4K, ``chat_narrow``'s gaps cannot be filled: even ffd over the whole set stays ~0.4 pp above the bound."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cpdata.errors import check_choice

__all__ = ["BENCHMARK_CASES", "DISTRIBUTIONS", "HARD_CASES", "sample_lengths"]


def _lognormal(median: float, sigma: float, cap: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    return lambda rng, n: np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=n)), 1, cap)


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
    *((name, capacity, "split", n) for name in ("sft", "ultrachat", "web")
      for capacity, n in ((4096, 40_000), (16384, 100_000))),  # fmt: skip
    ("long_context", 16384, "split", 20_000),
    ("long_context", 131072, "error", 60_000),
    ("alpaca", 131072, "error", 400_000),
    ("sft", 131072, "split", 400_000),
    ("web", 131072, "split", 400_000),
)
"""(distribution, capacity, overflow, documents): 2000+ packs each (one extra pack < 0.05 pp), but
~280 for ``alpaca`` at 128K, where the bound is reachable exactly."""

HARD_CASES: tuple[tuple[str, int, str, int], ...] = (("chat_narrow", 4096, "split", 20_000),)
"""Cases where the lower bound is out of reach for any packer."""


def sample_lengths(name: str, n: int, seed: int = 0) -> np.ndarray:
    """int64 ``[n]`` document lengths drawn from distribution ``name``."""
    check_choice("length distribution", name, sorted(DISTRIBUTIONS))
    return DISTRIBUTIONS[name](np.random.default_rng(seed), n).astype(np.int64)
