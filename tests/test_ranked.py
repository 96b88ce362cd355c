"""Ranks kept sorted by a value (:mod:`cpdata.layout.ranked`): after any sequence of moves the keys are what sorting
the ranks' values from scratch gives, ties by rank."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cpdata.layout.ranked import move_key, ranked

VALUES = st.sampled_from([0.0, 1.0, 1.5, 2.0, 7.0])  # (few values: many ties)


@given(st.lists(VALUES, min_size=1, max_size=12), st.lists(st.tuples(st.integers(0, 11), VALUES), max_size=40))
def test_moves_keep_the_keys_sorted_as_from_scratch(start: list[float], moves: list[tuple[int, float]]) -> None:
    values = list(start)
    keys = ranked(values)
    for r, new in moves:
        r %= len(values)
        move_key(keys, values[r], new, r)
        values[r] = new
        assert keys == sorted(zip(values, range(len(values)), strict=True))
