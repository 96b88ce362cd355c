"""The close's last phase (cpdata.packing.world_densify): ranks under the busiest take dearer waiting documents in
place of cheaper ones, never past the busiest rank, clearing past a document's own tokens no more than the tiles it
adds pay for (PAD_TILES), and the books (loads, room) always those of the pieces the step lists."""

from __future__ import annotations

import numpy as np

from cpdata.layout.world_owners import owner_ranks
from cpdata.layout.world_plan import alone_tiles
from cpdata.layout.world_step import StepBins
from cpdata.packing import world_densify
from cpdata.packing.world_densify import PAD_TILES, Densify
from cpdata.packing.world_steps import WorldStepPacker
from tests.test_world_step import LOCAL, NODE, PACKS, TILE, WORLD, _run, _windows

SHORT = 100  # a tile each


def _step() -> tuple[StepBins, list[tuple[int, int, tuple[int, int, int]]]]:
    """4 ranks of 512 tokens, 2 micro-batches: a 1,024-token document on ranks 0-1 of micro-batch 0 (18 tiles a
    rank), and five 100-token documents in each micro-batch of ranks 2 and 3 (a tile each: 10 a rank). The step
    stands at 18 / 14 = 1.29 x its mean rank."""
    bins, step = _with_shorts([(0, 1024, (0, 0, 2))])
    assert bins.load == [18, 18, 10, 10]
    return bins, step


def _with_shorts(step: list[tuple[int, int, tuple[int, int, int]]]
                 ) -> tuple[StepBins, list[tuple[int, int, tuple[int, int, int]]]]:  # fmt: skip
    """``step`` (keys from 0) and five 100-token documents in each micro-batch of ranks 2 and 3, on a fresh step of 4
    ranks of 512 tokens, 2 micro-batches."""
    bins, key = StepBins(2, 4, 512, 4, TILE), len(step)
    for r in (2, 3):
        for k in (0, 1):
            for _ in range(5):
                step.append((key, SHORT, (k, r, 1)))
                key += 1
    for _, s, where in step:
        bins.restore(s, where)
    return bins, step


def _books(step: list[tuple[int, int, tuple[int, int, int]]]) -> tuple[list[float], list[list[int]]]:
    """The loads and room of a fresh step (:func:`_step`'s shape) holding exactly ``step``'s pieces."""
    fresh = _rebuilt(StepBins(2, 4, 512, 4, TILE), step)
    return fresh.load, fresh.room


def _rebuilt(bins: StepBins, step: list[tuple[int, int, tuple[int, int, int]]]) -> StepBins:
    """A fresh step of ``bins``' shape holding exactly ``step``'s pieces (its books, to compare with ``bins``')."""
    fresh = StepBins(bins.packs, bins.world, bins.local, bins.node_size, bins.tile)
    for _, s, where in step:
        fresh.restore(s, where)
    return fresh


def test_a_waiting_document_takes_the_place_of_cheaper_ones_on_the_least_loaded_rank():
    """Two waiting 500-token documents (10 tiles each, the five 100-token ones they replace 5): the first goes to
    rank 2, the second to rank 3 (then the least loaded), each lifting its rank 10 -> 15, under the busiest (18);
    a third would lift a rank to 20 and waits. The ten documents cleared are returned; the step's tokens grow."""
    bins, step = _step()
    waiting = [(100, 500), (101, 500), (102, 500)]
    tokens = bins.placed
    cleared = Densify(bins, step, waiting).run()
    assert bins.load == [18, 18, 15, 15] and max(bins.load) == 18
    assert waiting == [(102, 500)] and sorted(s for _, s in cleared) == [SHORT] * 10
    assert {(key, where) for key, _, where in step} >= {(100, (0, 2, 1)), (101, (0, 3, 1))}
    assert not {key for key, _ in cleared} & {key for key, _, _ in step}
    assert bins.placed == tokens  # (500 in, 500 out, twice)
    assert _books(step) == (bins.load, bins.room)


def test_a_swap_whose_pad_costs_more_than_it_adds_or_that_lifts_a_rank_past_the_busiest_is_not_made():
    """A 450-token document needs four 100-token documents cleared beside the 12 tokens of room, and five: 500
    tokens out for 450 in, 50 tokens of pad (about 52 tiles of linear layers) for 10 - 5 tiles. A 512-token document
    adds 10 tiles for 5 (rank at 15), then a second would lift rank 2 or 3 past the busiest. A 130-token document
    costs 2 tiles for the 2 of two cleared: no gain."""
    bins, step = _step()
    before = (list(bins.load), [list(room) for room in bins.room], list(step))
    for waiting in ([(100, 450)], [(100, 130)]):
        assert Densify(bins, step, waiting).run() == [] and len(waiting) == 1
        assert (bins.load, bins.room, step) == before
    waiting = [(100, 512), (101, 512), (102, 512)]
    Densify(bins, step, waiting).run()
    assert bins.load == [18, 18, 15, 15] and waiting == [(102, 512)]
    assert alone_tiles(512, TILE) == 10 and _books(step) == (bins.load, bins.room)


def test_a_swap_clears_past_the_documents_tokens_only_what_its_tiles_pay_for():
    """A rank full to 12 tokens fits a document only where its shortest documents sum almost exactly to what it
    lacks. A 497-token document (10 tiles) clears five 100-token ones (5 tiles) for 485 tokens of room: 3 tokens
    past its own, whose pad (3.1 tiles) the 5 tiles it adds pay for; it goes to rank 2 (the least loaded, the lower
    rank) and the step holds 3 tokens fewer. A 490-token document clears 10 tokens past its own (10.3 tiles of pad)
    for the same 5: it waits."""
    bins, step = _step()
    before = (list(bins.load), [list(room) for room in bins.room], list(step))
    waiting = [(100, 490)]
    assert Densify(bins, step, waiting).run() == [] and waiting == [(100, 490)]
    assert (bins.load, bins.room, step) == before
    assert 10 * PAD_TILES > alone_tiles(490, TILE) - 5 > 0
    tokens = bins.placed
    waiting = [(100, 497)]
    cleared = Densify(bins, step, waiting).run()
    assert waiting == [] and sorted(s for _, s in cleared) == [SHORT] * 5 and (100, 497, (0, 2, 1)) in step
    assert bins.load == [18, 18, 15, 10] and bins.placed == tokens - 3 and 3 * PAD_TILES <= 5
    assert _books(step) == (bins.load, bins.room)


def _two_node_step(whole: bool = False) -> tuple[StepBins, list[tuple[int, int, tuple[int, int, int]]]]:
    """:func:`_step` with ranks 0-1 busier: a 1,024-token document on them in each micro-batch (36 tiles a rank,
    512 and 1,024 keys received), or with ``whole`` a 512-token document on each of them in each micro-batch (20
    tiles a rank, no key received); ranks 2 and 3 as in :func:`_step` (10 tiles)."""
    wheres = [(k, r, 1) for r in (0, 1) for k in (0, 1)] if whole else [(0, 0, 2), (1, 0, 2)]
    return _with_shorts([(i, 512 if whole else 1024, where) for i, where in enumerate(wheres)])


def test_a_waiting_document_longer_than_a_rank_spreads_in_place_of_cheaper_ones():
    """Two waiting 600-token documents, longer than a rank of 512: each spreads over ranks 2-3 (THD's chunks of 150,
    its roles 13 and 11 tiles, 300 and 150 keys) in a micro-batch whose three shortest documents a rank, cleared, make
    its roles' room (3 tiles a rank out); the first lifts ranks 2 and 3 to 20 and 18, the second, mirrored (its
    first role on the less loaded rank 3: 28 and 28, against 30 and 26 in THD's orientation), under the busiest
    (36). The twelve documents cleared are returned, the step holds as many tokens, and its books are its
    pieces'."""
    bins, step = _two_node_step()
    tokens = bins.placed
    waiting = [(100, 600), (101, 600)]
    cleared = Densify(bins, step, waiting).run()
    assert waiting == [] and sorted(s for _, s in cleared) == [SHORT] * 12
    assert {(100, 600, (0, 2, 2)), (101, 600, (1, 3, -2))} <= set(step)
    assert bins.load == [36, 36, 28, 28] and bins.recv == [1024, 512, 450, 450] and bins.placed == tokens
    assert not {key for key, _ in cleared} & {key for key, _, _ in step}
    assert _books(step) == (bins.load, bins.room)


def test_a_spread_swap_keeps_the_busiest_receiver_and_pays_for_its_pad():
    """Beside ranks that receive no key (whole 512-token documents at 20 tiles), a 600-token document would make
    rank 2 receive 300: it waits; beside :func:`_step`'s busiest rank at 18 tiles it would lift rank 2 to 20: it
    waits. Beside the 1,024-token documents, a 700-token one needs 350 tokens a role, four
    100-token documents cleared a rank: 100 tokens past its own, pad of about 103 tiles for the 19 it adds: it
    waits; a 590-token one clears 10 past its own (10.3 tiles of pad) for 18: it goes in, the step 10 tokens
    fewer. A document wider than a node (4 x 512 tokens) is not tried."""
    for bins, step in (_two_node_step(whole=True), _step()):
        before = (list(bins.load), [list(room) for room in bins.room], list(step))
        waiting = [(100, 600)]
        assert Densify(bins, step, waiting).run() == [] and len(waiting) == 1
        assert (bins.load, bins.room, step) == before
    for s in (700, 2100):
        bins, step = _two_node_step()
        before = (list(bins.load), [list(room) for room in bins.room], list(step))
        waiting = [(100, s)]
        assert Densify(bins, step, waiting).run() == [] and waiting == [(100, s)]
        assert (bins.load, bins.room, step) == before
    assert 100 * PAD_TILES > 15 + 12 - 8
    tokens = bins.placed
    waiting = [(100, 590)]
    cleared = Densify(bins, step, waiting).run()
    assert waiting == [] and len(cleared) == 6 and (100, 590, (0, 2, 2)) in step
    assert bins.placed == tokens - 10 and 10 * PAD_TILES <= 13 + 11 - 6 and bins.load == [36, 36, 20, 18]
    assert _books(step) == (bins.load, bins.room)


def test_a_step_within_its_threshold_of_the_mean_is_left_as_it_is(monkeypatch):
    bins, step = _step()
    monkeypatch.setattr(world_densify, "DENSIFY_OVER", 0.3)  # (the step stands 0.29 over its mean)
    waiting = [(100, 500)]
    assert Densify(bins, step, waiting).run() == [] and waiting == [(100, 500)]


def test_the_close_densifies_without_lifting_the_busiest_rank_or_losing_tokens(monkeypatch):
    """Over random streams, every close that densifies leaves the busiest rank's load and the busiest receiver of
    keys as they were, the step no more over its mean, the tokens it holds fewer by no more than the tiles it gained
    pay for (:data:`PAD_TILES`), the same pieces between the step and the waiting list, and its books those of its
    pieces; every piece is dealt once; and some closes of these streams do densify (not vacuous)."""
    densify = WorldStepPacker._densify
    changed: list[bool] = []

    def checked(self: WorldStepPacker) -> None:
        b = self._bins
        top, ratio, tokens, total, recv = max(b.load), b.ratio(), b.placed, b.total_load, max(b.recv)
        keys = sorted([key for key, _, _ in self._step] + [key for key, _ in self._waiting])
        densify(self)
        assert max(b.load) <= top and b.ratio() <= ratio and (tokens - b.placed) * PAD_TILES <= b.total_load - total
        assert max(b.recv) <= recv
        assert sorted([key for key, _, _ in self._step] + [key for key, _ in self._waiting]) == keys
        fresh = _rebuilt(b, self._step)
        assert (fresh.load, fresh.room, fresh.recv) == (b.load, b.room, b.recv)
        changed.append(b.ratio() < ratio)

    monkeypatch.setattr(WorldStepPacker, "_densify", checked)
    for seed in range(12):
        out = _run(_windows(seed), WorldStepPacker(WORLD * LOCAL, WORLD, NODE, PACKS, TILE))
        assert sorted(k for keys, _, _ in out for k in keys) == list(range(240))
    assert len(changed) > 12 and 0 < sum(changed)


def _node_held_step(seed: int) -> tuple[StepBins, list, list[tuple[int, int]]]:
    """A random step of 8 ranks of 512 tokens (nodes of 4), 2 micro-batches: a document of 1,500-2,048 tokens on
    node 0's 4 ranks in each micro-batch, node 1's ranks full to within a few tokens of documents of 1-150 tokens,
    and waiting documents of 513-1,500 tokens (longer than a rank) and 1-400 among them."""
    rng = np.random.default_rng(seed)
    bins, step, key = StepBins(2, 8, 512, 4, TILE), [], 0
    for k in (0, 1):
        step.append((key, int(rng.integers(1500, 2049)), (k, 0, 4) if k == 0 else (k, 3, -4)))
        key += 1
    for r in range(4, 8):
        for k in (0, 1):
            room = 512
            while room > 8:
                s = min(int(rng.integers(1, 151)), room)
                step.append((key, s, (k, r, 1)))
                key, room = key + 1, room - s
    for _, s, where in step:
        bins.restore(s, where)
    lengths = np.where(rng.random(12) < 0.5, rng.integers(513, 1501, 12), rng.integers(1, 401, 12))
    return bins, step, [(1000 + i, int(s)) for i, s in enumerate(lengths)]


def test_spread_swaps_keep_the_busiest_rank_and_receiver_pay_for_their_pad_and_stay_inside_a_node():
    """Over random steps whose node 0 one long document holds (:func:`_node_held_step`): densify leaves the busiest
    rank's load and the busiest receiver of keys as they were, the step no more over its mean, the tokens it holds
    fewer by no more than the tiles it gained pay for, every piece once in the step, the waiting list or the cleared,
    every spread piece it placed inside one node, and its books those of its pieces; and some steps take a waiting
    document longer than a rank, and some end holding fewer tokens, the pad paid for (not vacuous)."""
    spread = fewer = 0
    for seed in range(24):
        bins, step, waiting = _node_held_step(seed)
        top, ratio, tokens, total, recv = max(bins.load), bins.ratio(), bins.placed, bins.total_load, max(bins.recv)
        pieces = sorted([(key, s) for key, s, _ in step] + waiting)
        cleared = Densify(bins, step, waiting).run()
        assert max(bins.load) <= top and max(bins.recv) <= recv and bins.ratio() <= ratio
        assert (tokens - bins.placed) * PAD_TILES <= bins.total_load - total
        assert sorted([(key, s) for key, s, _ in step] + waiting + cleared) == pieces
        fresh = _rebuilt(bins, step)
        assert (fresh.load, fresh.room, fresh.recv) == (bins.load, bins.room, bins.recv)
        taken = [(s, where) for key, s, where in step if key >= 1000 and s > 512]
        assert all(len({r // 4 for r in owner_ranks(first, c)}) == 1 for _, (_, first, c) in taken)
        spread += len(taken)
        fewer += bins.placed < tokens
    assert spread > 0 and fewer > 0


def test_the_packers_close_densifies(monkeypatch):
    """The step from the first test, closed by the packer: the two waiting 500-token documents, which no top-up
    can place (2 x 12 tokens of room on ranks 2 and 3), leave in its packs; without the phase they wait."""
    def closed() -> list[int]:
        _, step = _step()
        packer = WorldStepPacker(4 * 512, 4, 4, 2, TILE)
        packer.load_carry([([k for k, _, _ in step], [s for _, s, _ in step]), ([100, 101], [500, 500])],
                          np.array([w for _, _, w in step]))  # fmt: skip
        return packer._close(keep_empty=True).keys.tolist()

    assert {100, 101} <= set(closed())
    monkeypatch.setattr(WorldStepPacker, "_densify", lambda self: None)
    assert not {100, 101} & set(closed())


def test_a_waiting_document_that_fits_the_room_goes_in_with_nothing_cleared():
    """A 12-token document fits the 12 tokens left in rank 2's first micro-batch (five documents there already, the
    most any slot holds): it goes in, one tile, nothing cleared, and the books widen to the slot's six documents."""
    bins, step = _step()
    waiting = [(100, 12)]
    assert Densify(bins, step, waiting).run() == [] and waiting == []
    assert bins.load == [18, 18, 11, 10] and (100, 12, (0, 2, 1)) in step
    assert _books(step) == (bins.load, bins.room)
