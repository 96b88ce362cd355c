"""Ranks kept sorted by a value as pieces land: ``(value, rank)`` keys, unique however many ranks share a value, so a
rank's entry is found by one bisection and most changes rewrite it in place (a piece moves its rank past no other).
The world step's books (:class:`~cpdata.layout.step_loads.StepLoads`) keep their loads and projected loads this way,
so that no piece costs a pass over the world."""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["move_key", "ranked"]


def ranked(values: list[float]) -> list[tuple[float, int]]:
    """The ranks sorted by a value (ties: the lower rank), as ``(value, rank)`` keys: each key is unique, so a
    rank's entry is found by one bisection, however many ranks share its value (:func:`move_key` keeps the order)."""
    return sorted(zip(values, range(len(values)), strict=True))


def move_key(keys: list[tuple[float, int]], old: float, new: float, r: int) -> None:
    """In sorted ``(value, rank)`` keys, rank ``r``'s value goes from ``old`` to ``new`` (in place where its order
    holds: most pieces move it past no other rank)."""
    key = (new, r)
    i = bisect_left(keys, (old, r))
    if new >= old:  # (it can only move right: its left neighbour stays before it)
        if i + 1 == len(keys) or key < keys[i + 1]:
            keys[i] = key
            return
        del keys[i]
        keys.insert(bisect_left(keys, key, i), key)
    else:  # (it can only move left)
        if i == 0 or keys[i - 1] < key:
            keys[i] = key
            return
        del keys[i]
        keys.insert(bisect_left(keys, key, 0, i), key)
