"""The world packer (``bfd`` / ``ffd`` under a ``world`` layout): every piece packed once, each pack a plan the
deal replays from its slot lengths (no piece cut, short ones whole), packs near ``ceil(tokens / capacity)``
with the carry, and a planner restored from its state mid-stream emits the packs of the uninterrupted one."""

from __future__ import annotations

import numpy as np
import pytest

from cpdata.bench.distributions import sample
from cpdata.layout.maps import layout_spec
from cpdata.layout.world_plan import plan_runs
from cpdata.packing import plan_lengths
from cpdata.packing.decreasing import MAX_AGE, WorldPacker
from cpdata.packing.planner import StreamPlanner
from cpdata.packing.records import PackingConfig

WORLD, NODE, LOCAL = 8, 4, 1024


@pytest.mark.parametrize("name", ["alpaca", "sft", "long_context"])
@pytest.mark.parametrize("algorithm", ["bfd", "ffd"])  # bfd: windows of 256 and the carry; ffd: one window
def test_every_pack_is_a_plan_the_deal_replays_and_packs_stay_near_the_bound(name, algorithm):
    lengths = sample(name, 3000, 2)
    spec = layout_spec("world", node_size=NODE)
    capacity = WORLD * LOCAL
    world = plan_lengths(lengths, capacity=capacity, layout=spec, cp_size=WORLD, overflow="split",
                         algorithm=algorithm, window=256 if algorithm == "bfd" else None)  # fmt: skip
    plain = plan_lengths(lengths, capacity=capacity, layout="contiguous", cp_size=WORLD, overflow="split",
                         algorithm=algorithm, window=256)  # fmt: skip
    assert sorted(world.slot_len.tolist()) == sorted(plain.slot_len.tolist())  # the same pieces, each once
    off, slot = np.asarray(world.pack_offsets), np.asarray(world.slot_len)
    for p in range(off.size - 1):
        lens = slot[off[p] : off[p + 1]]
        runs = plan_runs(lens, capacity, WORLD, NODE)
        assert runs is not None, (p, lens.tolist())  # the deal follows the packer's plan
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        pieces = {}
        for start, n, rank in runs:
            d = int(np.searchsorted(starts, start, side="right") - 1)
            pieces.setdefault(d, []).append((rank, n))
        per_rank = np.zeros(WORLD, dtype=np.int64)
        for d, parts in pieces.items():
            assert sum(n for _, n in parts) == lens[d]
            ranks = sorted({r for r, _ in parts})
            assert len(ranks) == 1 if lens[d] <= LOCAL else -(-lens[d] // LOCAL) <= len(ranks) <= WORLD
            for r, n in parts:
                per_rank[r] += n
        assert (per_rank <= LOCAL).all()
    bound = -(-int(slot.sum()) // capacity)
    assert off.size - 1 <= bound * 1.08 + 1, (off.size - 1, bound)


def test_a_restored_planner_emits_the_packs_of_the_uninterrupted_one():
    config = PackingConfig.resolve(capacity=WORLD * LOCAL, layout=layout_spec("world", node_size=NODE),
                                   cp_size=WORLD, overflow="split", window=200)  # fmt: skip
    lengths = sample("ultrachat", 1600, 4)
    windows = [(lo, lo + 200) for lo in range(0, 1600, 200)]

    def run(restore_after: int | None) -> list[list[int]]:
        planner, packs = StreamPlanner(config), []
        for i, (lo, hi) in enumerate(windows):
            packs += list(planner.add_window(lengths[lo:hi], np.arange(lo, hi))[2])
            if i == restore_after:
                assert planner._packer.carry_columns()[1].size, "the carry is exercised"
                fresh = StreamPlanner(config)
                fresh.load_state(planner.state())
                planner = fresh
        return packs + list(planner.finish())

    assert isinstance(StreamPlanner(config)._packer, WorldPacker)
    straight = run(None)
    assert run(3) == straight and sum(map(len, straight)) > 0


def test_ffd_state_with_open_packs_is_refused():
    packer = WorldPacker(WORLD * LOCAL, WORLD, NODE, carry=False)
    with pytest.raises(ValueError, match="carries nothing between windows"):
        packer.load_carry([([0], [10])])


def test_world_bfd_holds_back_only_packs_with_a_quarter_rank_of_room():
    """Two ranks of 64 tokens: six pieces of 63 fill three packs to one token of room a rank, which leave at
    once; the pack of the 20-token piece keeps 44 + 64 tokens of room (over a quarter rank) and is carried."""
    packer = WorldPacker(128, 2, 2)
    out = packer.place(np.arange(7, dtype=np.int64), np.array([63] * 6 + [20], dtype=np.int64))
    assert [list(p) for p in out] == [[0, 1], [2, 3], [4, 5]]
    assert packer.carry_columns()[1].tolist() == [6]
    assert [list(p) for p in packer.finish()] == [[6]]


def test_world_bfd_emits_a_carried_pack_once_its_oldest_piece_is_max_age_windows_old():
    """One 1-token piece a window: the open pack would take pieces for 128 windows, but leaves once its first
    piece is more than MAX_AGE windows old; every piece waits at most MAX_AGE + 1 windows."""
    packer, arrived, waits = WorldPacker(128, 2, 2), {}, []
    for w in range(3 * MAX_AGE):
        arrived[w] = w
        for pack in packer.place(np.array([w], dtype=np.int64), np.ones(1, dtype=np.int64)):
            waits += [w - arrived[k] for k in pack]
    assert waits, "a pack left before the end of the stream"
    assert max(waits) <= MAX_AGE + 1


def test_world_bfd_carries_the_emptiest_packs():
    """One rank of 64 tokens a pack: pieces of 40, 35 and 30 tokens open a pack each (rooms 24, 29, 34, all over
    a quarter rank); the two emptiest (30 and 35) are carried, the fullest leaves."""
    packer = WorldPacker(64, 1, 1)
    out = packer.place(np.arange(3, dtype=np.int64), np.array([40, 35, 30], dtype=np.int64))
    assert [list(p) for p in out] == [[0]]
    assert sorted(packer.carry_columns()[1].tolist()) == [1, 2]
