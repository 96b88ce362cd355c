"""The close's moves on an open step's books (:class:`cpdata.layout.step_moves.StepMoves`).

References: each move is checked against the books rebuilt from the pieces where they end (``restore`` of each
on a new step), and against the rule it states (the least loaded rank, the busiest rank's load, the level), with
the case on each side of the rule's bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpdata.layout.step_moves import StepMoves
from cpdata.layout.world_plan import alone_tiles

WORLD, NODE, TILE = 8, 4, 128


def _rebuilt(packs: int, world: int, local: int, pieces: list[tuple[int, tuple[int, int, int]]]) -> StepMoves:
    """A new step holding ``pieces`` (``(tokens, placement)``), each put back where it is."""
    bins = StepMoves(packs, world, local, NODE, TILE)
    for s, where in pieces:
        bins.restore(s, where)
    return bins


def _books(bins: StepMoves) -> tuple[list, list]:
    return list(bins.load), [list(room) for room in bins.room]


def test_top_up_places_a_whole_piece_on_the_least_loaded_rank_only_up_to_the_busiest_load() -> None:
    """A 512-token piece costs 10 tiles: with the busiest rank at 10 it goes to an empty rank (at the bound); once
    no rank with room is at 0, it waits and the books stay as they were. Past a rank's tokens it never tops up."""
    pieces = [(512, (0, 0, 1)), (256, (0, 1, 1))]
    bins = _rebuilt(2, 4, 512, pieces)
    assert bins.load[:2] == [alone_tiles(512, TILE), alone_tiles(256, TILE)] == [10, 3]
    got = bins.top_up(128)  # (one tile: the least loaded, rank 2 before rank 3, its micro-batch of least room)
    assert got == (0, 2, 1)
    pieces.append((128, got))
    got = bins.top_up(512)  # rank 3 at 0: 10 tiles, equal to the busiest, allowed
    assert got == (0, 3, 1)
    pieces.append((512, got))
    before = _books(bins)
    assert bins.top_up(512) is None and _books(bins) == before  # (rank 2 at 1 would reach 11 > 10)
    assert bins.top_up(513) is None and _books(bins) == before  # (past a rank's 512 tokens: a spread piece)
    assert _books(bins) == _books(_rebuilt(2, 4, 512, pieces))


def test_move_takes_a_whole_piece_to_the_least_loaded_other_rank_within_the_level() -> None:
    pieces = [(256, (0, 0, 1)), (256, (1, 0, 1)), (512, (0, 1, 1)), (128, (0, 2, 1))]
    bins = _rebuilt(2, 4, 512, pieces)  # loads 6, 10, 1, 0
    got = bins.move(256, (0, 0, 1), level=3)  # rank 3 at 0 + 3 tiles: at the level, allowed
    assert got == (0, 3, 1)
    pieces[0] = (256, got)
    before = _books(bins)
    assert bins.move(256, (1, 0, 1), level=3) is None and _books(bins) == before  # (rank 2 at 1 + 3 > 3)
    got = bins.move(256, (1, 0, 1), level=4)  # the least loaded other rank with room
    assert got == (0, 2, 1)
    pieces[1] = (256, got)
    assert _books(bins) == _books(_rebuilt(2, 4, 512, pieces)) and bins.load == [0, 10, 4, 3]
    before = _books(bins)
    with pytest.raises(ValueError, match=r"no whole piece of 300 tokens can leave \(1, 3, 1\)"):
        bins.move(300, (1, 3, 1), level=100)  # (nothing of 300 tokens there: refused, the books unchanged)
    assert _books(bins) == before


def test_move_never_puts_a_piece_back_on_its_own_rank() -> None:
    """The piece's rank is the least loaded (1 tile against 10): it goes to the next, rank 1, into micro-batch 1
    (micro-batch 0 is full there)."""
    bins = _rebuilt(2, 4, 512, [(128, (0, 0, 1)), (512, (0, 1, 1)), (512, (0, 2, 1)), (512, (0, 3, 1))])
    assert bins.move(128, (0, 0, 1), level=100) == (1, 1, 1) and bins.load == [0, 11, 10, 10]


def test_a_piece_that_waited_fills_an_empty_micro_batch_on_its_least_loaded_width() -> None:
    """At close, an empty micro-batch takes the longest waiting piece past the level: of the widths from its
    fewest ranks (5 of 2,048 each for 10,240 tokens) up to Megatron's 8, the one whose busiest rank's load after
    it is least (brute force; on 5 ranks those would stand 648 tiles above the other 3)."""
    local, s = 2048, 5 * 2048
    bins = StepMoves(2, WORLD, local, NODE, TILE)
    bins.set_density([s])
    for r in range(WORLD):  # micro-batch 0: one whole document a rank, equal loads
        bins.restore(1000, (0, r, 1))
    widths = {c: bins.choose(s, c, np.inf, 1) for c in range(5, 9)}
    want = min(widths, key=lambda c: (widths[c][0], c))
    where = bins.open_empty(s)
    assert where is not None and where[0] == 1 and abs(where[2]) == want == 8
    assert max(bins.load) == widths[8][0] < widths[5][0]
    assert bins.open_empty(s) is None  # (no micro-batch is empty now)


def test_empty_widths_are_the_widths_within_a_fraction_of_the_least_busiest_load() -> None:
    """The widths of a spread piece in the first empty micro-batch (5..8 ranks for 10,240 tokens of 2,048 a rank),
    least busiest first, cut at ``within`` of the least; ``open_empty`` takes the one it is given."""
    local, s = 2048, 5 * 2048
    bins = StepMoves(3, WORLD, local, NODE, TILE)
    for r, n in enumerate([1000, 1200, 900, 1500, 1000, 1100, 700, 1300]):  # micro-batch 0: unequal ranks
        bins.restore(n, (0, r, 1))
    every = bins.empty_widths(s, within=1.0)
    brute = sorted((bins.choose(s, c, np.inf, 1) for c in range(5, 9)), key=lambda best: (best[0], abs(best[3])))
    assert every == brute and len(every) == 4
    assert bins.empty_widths(s) == every[:1]  # (within 0: the least, as open_empty alone takes it)
    near = bins.empty_widths(s, within=0.2)  # (483, 574, 658 and 726 tiles on 8, 7, 6 and 5 ranks)
    assert near == [best for best in every if best[0] <= 1.2 * every[0][0]] and 1 < len(near) < 4
    _, k, first, c = every[-1]
    assert bins.open_empty(s, every[-1]) == (k, first, c) == (1, first, c)
    assert bins.empty_widths(s, within=1.0)[0][1] == 2 and bins.empty_widths(local) == []  # (next empty; a whole piece)
