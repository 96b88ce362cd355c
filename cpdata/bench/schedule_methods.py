"""Placing one global batch of documents on DP ranks and micro-batches, as trainers do today.

From the published descriptions; each takes a global batch's lengths (stream order) and returns, per DP rank,
its micro-batches as lists of lengths: ``nemo_rl_ffd`` (first-fit-decreasing packs dealt round-robin,
NeMo-RL), ``verl_kk`` / ``verl_kk_cap`` (Karmarkar-Karp into equal-count rank groups on ``24576 * L + L**2``,
then per rank into the largest ``ceil(tokens / capacity)`` over ranks, verl ``balance_batch``; ``_cap`` grows
that count until no micro-batch exceeds the capacity), ``megatron_dp_balanced`` (packs filled in stream order,
cpdata's ``next_fit``, dealt round-robin) and ``cpdata_0.1`` (document ``i`` to rank ``i % dp_size``, each rank
packs its own with ``bfd``).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable

import numpy as np

__all__ = ["BASELINES", "karmarkar_karp"]

Placement = list[list[list[int]]]
"""``placement[rank][micro_batch]`` = lengths of the documents in that pack."""


def karmarkar_karp(weights: list[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing into ``k`` groups of item indices (``equal_size``: counts within one, as verl)."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    chunks = [order[i : i + k] for i in range(0, len(order), k)] if equal_size else [[i] for i in order]
    for n, chunk in enumerate(chunks):
        parts = [(weights[i], [i]) for i in chunk] + [(0.0, [])] * (k - len(chunk))
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), n, parts))
    counter = len(chunks)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [p[1] for p in heap[0][2]] if heap else [[] for _ in range(k)]


def _ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        for j, r in enumerate(room):
            if r >= n:
                bins[j].append(n)
                room[j] -= n
                break
        else:
            bins.append([n])
            room.append(capacity - n)
    return bins


def _deal(packs: list[list[int]], dp_size: int) -> Placement:
    return [packs[r::dp_size] for r in range(dp_size)]


def _verl(lengths: list[int], *, capacity: int, dp_size: int, cap: bool, **_: object) -> Placement:
    work = [24576.0 * n + float(n) * n for n in lengths]
    groups = karmarkar_karp(work, dp_size, equal_size=True)

    def split(items: list[int], k: int) -> list[list[int]]:
        return [[items[j] for j in part] for part in karmarkar_karp([work[i] for i in items], k)]

    k = max(max(1, -(-sum(lengths[i] for i in g) // capacity)) for g in groups)
    while True:
        parts = [split(g, k) for g in groups]
        if not cap or all(sum(lengths[i] for i in p) <= capacity for ps in parts for p in ps):
            break
        k += 1
    out = []
    for ps in parts:
        ps = sorted(ps, key=lambda p: -sum(work[i] for i in p))
        out.append([[lengths[i] for i in p] for p in ps if p] or [[]])
    return out


def _packs(lengths, capacity: int, algorithm: str) -> list[list[int]]:
    """The packs cpdata's ``algorithm`` makes of ``lengths`` (``balanced`` at cp 1: no document padding)."""
    from cpdata.packing import plan_lengths

    res = plan_lengths(np.asarray(lengths, dtype=np.int64), capacity=capacity, layout="balanced", cp_size=1,
                       algorithm=algorithm)  # fmt: skip
    return [res.pack(p)[2].tolist() for p in range(res.n_packs)]


def cpdata_01(lengths: list[int], *, capacity: int, dp_size: int, first_index: int = 0, **_: object) -> Placement:
    arr = np.asarray(lengths, dtype=np.int64)
    mine = (np.arange(arr.shape[0]) + first_index) % dp_size
    return [_packs(arr[mine == r], capacity, "bfd") or [[]] for r in range(dp_size)]


BASELINES: dict[str, Callable[..., Placement]] = {
    "nemo_rl_ffd": lambda lengths, *, capacity, dp_size, **_: _deal(_ffd(lengths, capacity), dp_size),
    "verl_kk": functools.partial(_verl, cap=False),
    "verl_kk_cap": functools.partial(_verl, cap=True),
    "megatron_dp_balanced": lambda lengths, *, capacity, dp_size, **_: _deal(
        _packs(lengths, capacity, "next_fit"), dp_size),
    "cpdata_0.1": cpdata_01,
}
"""Method name -> ``f(lengths, *, capacity, dp_size, first_index) -> placement``."""
