"""Layout ``tiled`` and the tile / K/V counters: flex's own BlockMask counts, permutations, balance, resume."""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from state_contract import assert_items_equal, run_save_load_contract

from cpdata.layout.maps import (
    LAYOUTS,
    alignment,
    causal_work,
    inverse_indices,
    layout_spec,
    layout_tile,
    rank_indices,
)
from cpdata.layout.tiled import (
    SWAP_TOLERANCE,
    TILES,
    block_groups,
    deal_blocks,
    resplit_pairs,
    swap_blocks,
    tiled_owners,
)
from cpdata.layout.tiles import block_tiles, first_keys, ideal_tiles, kv_recv_tokens, live_tiles
from cpdata.nodes.loader import build_node
from cpdata.packing import plan_lengths
from cpdata.packing.distributions import sample_lengths
from tests.flat_options import records

SPECS = [layout_spec("tiled", t) for t in TILES]
ALL = [name for name in LAYOUTS if name != "tiled"] + SPECS


def _pack(rng: np.random.Generator, layout: str, cp: int, blocks: int) -> tuple[np.ndarray, int]:
    """Random slot lengths (aligned for ``layout``) and a pack length of ``blocks`` pack multiples."""
    d, m = alignment(layout, cp)
    pack_len = m * blocks
    lens, used = [], 0
    while True:
        n = int(rng.integers(1, max(2, pack_len // int(rng.integers(1, 6)))))
        n = -(-n // d) * d
        if used + n > pack_len - int(rng.integers(0, 2)) * d:
            break
        lens.append(n)
        used += n
    return np.asarray(lens, dtype=np.int64), pack_len


def _flex_tiles(rows: np.ndarray, lens: np.ndarray, pack_len: int, tile: int) -> list[int]:
    """``kv_num_blocks + full_kv_num_blocks`` of flex's ``create_block_mask``, one batch entry per rank."""
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.from_numpy(rows)
    start = torch.from_numpy(first_keys(lens, pack_len)[rows])  # a pad query: its own key only
    bm = create_block_mask(lambda b, h, q, k: (k >= start[b, q]) & (k <= pos[b, q]), rows.shape[0], None,
                           rows.shape[1], pack_len, device="cpu", BLOCK_SIZE=tile)  # fmt: skip
    full = bm.full_kv_num_blocks
    counts = bm.kv_num_blocks.sum(dim=(1, 2)) + (0 if full is None else full.sum(dim=(1, 2)))
    return counts.tolist()


@pytest.mark.parametrize("tile", [64, 128])
def test_live_tiles_equal_flex_block_mask_counts(tile):
    rng = np.random.default_rng(tile)
    checked = 0
    for layout in ("contiguous", "round_robin", "thd", "balanced", layout_spec("tiled", tile)):
        for cp in (2, 4):
            d, m = alignment(layout, cp)
            blocks = max(1, (4 * cp * tile) // m)
            lens, pack_len = _pack(rng, layout, cp, blocks)
            rows = rank_indices(layout, cp, lens, pack_len)
            got = live_tiles(rows, lens, pack_len, tile).tolist()
            assert got == _flex_tiles(rows, lens, pack_len, tile), (layout, cp, lens.tolist())
            checked += len(lens) > 1 and len(set(got)) > 1
    assert checked >= 4, "every case had one document or equal counts: too easy to pass"


def test_block_tiles_sum_to_the_whole_pack_and_tiled_ranks_pay_their_blocks():
    rng = np.random.default_rng(0)
    for cp in (1, 2, 3, 8):
        for tile in TILES:
            lens, pack_len = _pack(rng, layout_spec("tiled", tile), cp, 3)
            cost = block_tiles(lens, pack_len, tile)
            assert cost.sum() == live_tiles(np.arange(pack_len)[None], lens, pack_len, tile).sum()
            owners = tiled_owners(lens, pack_len, cp, tile)
            rows = rank_indices("tiled", cp, lens, pack_len, tile=tile)
            assert np.array_equal(live_tiles(rows, lens, pack_len, tile), np.bincount(owners, cost, minlength=cp))


lens_strategy = st.lists(st.integers(0, 700), max_size=12)


@settings(max_examples=100, deadline=None)
@given(lens=lens_strategy, tail=st.integers(0, 300), tile=st.sampled_from(TILES), cp=st.integers(1, 8))
def test_ideal_tiles_are_the_whole_packs_live_tiles_over_cp_at_any_pack_length(lens, tail, tile, cp):
    pack_len = sum(lens) + tail
    if pack_len == 0:
        return
    whole = live_tiles(np.arange(pack_len)[None], lens, pack_len, tile)[0]  # one rank, every query: the brute count
    assert ideal_tiles(lens, pack_len, tile, cp) == whole / cp
    assert block_tiles(lens, pack_len, tile).shape == (-(-pack_len // tile),)  # a partial last block counts


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(ALL), cp=st.integers(1, 8), lens=lens_strategy, extra=st.integers(0, 3))
def test_every_layout_is_a_permutation_with_equal_shards_for_every_cp_and_tile(layout, cp, lens, extra):
    if layout == "identity" and cp > 1:
        return
    d, m = alignment(layout, cp)
    lens = [-(-n // d) * d for n in lens]
    pack_len = -(-sum(lens) // m) * m + extra * m
    rows = rank_indices(layout, cp, lens, pack_len)
    assert rows.shape == (cp, pack_len // cp)
    assert np.array_equal(np.sort(rows.reshape(-1)), np.arange(pack_len))
    assert np.array_equal(rows.reshape(-1)[inverse_indices(rows)], np.arange(pack_len))
    tile = layout_tile(layout)
    if tile is not None:  # whole aligned blocks, each rank's in increasing global order
        blocks = rows.reshape(cp, -1, tile)
        assert (blocks[..., 0] % tile == 0).all() and (np.diff(blocks, axis=-1) == 1).all()
        assert (np.diff(blocks[..., 0], axis=-1) > 0).all()


def _brute_recv(rows: np.ndarray, lens: np.ndarray, pack_len: int) -> list[int]:
    first = first_keys(lens, pack_len)
    out = []
    for row in rows:
        need = np.zeros(pack_len, dtype=bool)
        for q in row:
            need[first[q] : q + 1] = True
        need[row] = False
        out.append(int(need.sum()))
    return out


def test_kv_recv_tokens_equal_brute_force():
    rng = np.random.default_rng(3)
    seen = 0
    for layout in ("contiguous", "round_robin", "thd", "balanced", "tiled:64"):
        for cp in (2, 3):
            lens, pack_len = _pack(rng, layout, cp, max(1, 384 // alignment(layout, cp)[1]))
            rows = rank_indices(layout, cp, lens, pack_len)
            got = kv_recv_tokens(rows, lens, pack_len).tolist()
            assert got == _brute_recv(rows, lens, pack_len), (layout, cp)
            seen += sum(got) > 0
    assert seen >= 6


def _packs(name: str, capacity: int, cp: int, n: int) -> list[np.ndarray]:
    lengths = sample_lengths(name, int(n * capacity / 400) + 64, seed=1)
    result = plan_lengths(lengths, capacity=capacity, layout="tiled", cp_size=cp, overflow="split")
    off, slot = np.asarray(result.pack_offsets), np.asarray(result.slot_len)
    return [slot[off[p] : off[p + 1]] for p in range(min(n, off.size - 1))]


@pytest.mark.parametrize(("name", "cp"), [("alpaca", 4), ("sft", 8), ("long_context", 4)])
def test_tiled_balances_tiles_where_balanced_does_not_and_keeps_kv_local(name, cp):
    capacity = 32768
    for tile, bound in ((128, 1.02), (256, 1.03)):
        worst, worst_balanced, recv, recv_all = 0.0, 0.0, [], []
        for lens in _packs(name, capacity, cp, 4):
            ideal = block_tiles(lens, capacity, tile).sum() / cp
            tiled = rank_indices("tiled", cp, lens, capacity, tile=tile)
            worst = max(worst, live_tiles(tiled, lens, capacity, tile).max() / ideal)
            other = rank_indices("balanced", cp, lens, capacity)
            worst_balanced = max(worst_balanced, live_tiles(other, lens, capacity, tile).max() / ideal)
            recv.append(kv_recv_tokens(tiled, lens, capacity).max())
            recv_all.append(kv_recv_tokens(other, lens, capacity).max())
        assert worst <= bound, (name, cp, tile, worst)
        assert worst_balanced > worst, (name, cp, tile, worst_balanced)
        assert np.mean(recv) < np.mean(recv_all), (name, cp, tile)


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.integers(0, 900), max_size=14), tile=st.sampled_from(TILES), extra=st.integers(0, 3))
def test_block_groups_are_every_documents_blocks_and_their_tiles(lens, tile, extra):
    pack_len = (-(-sum(lens) // tile) + extra or 1) * tile
    first, size, c0 = block_groups(np.asarray(lens, dtype=np.int64), pack_len, tile)
    n = pack_len // tile
    assert first[0] == 0 and int(size.sum()) == n and np.array_equal(first[1:], (first + size)[:-1])
    assert np.array_equal(np.repeat(c0 - first, size) + np.arange(n), block_tiles(lens, pack_len, tile))


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(0, 3000), max_size=12), cp=st.integers(2, 8), tile=st.sampled_from(TILES),
       extra=st.integers(0, 2))  # fmt: skip
def test_the_deal_gives_every_rank_m_blocks_and_counts_their_tiles(lens, cp, tile, extra):
    pack_len = (-(-sum(lens) // (cp * tile)) + extra or 1) * cp * tile
    n = pack_len // tile
    owner, loads = deal_blocks(*block_groups(np.asarray(lens, dtype=np.int64), pack_len, tile), n, cp)
    assert np.array_equal(np.bincount(owner, minlength=cp), np.full(cp, n // cp))
    assert loads == np.bincount(owner, block_tiles(lens, pack_len, tile), minlength=cp).astype(int).tolist()


def test_swaps_balance_a_random_deal_and_keep_equal_counts():
    lens, pack_len, cp, tile = np.array([9054, 10065, 12555, 1025]), 32768, 4, 128
    n, cost = pack_len // tile, block_tiles(lens, pack_len, tile)
    owner = np.random.default_rng(0).permutation(np.repeat(np.arange(cp), n // cp))
    loads = np.bincount(owner, cost, minlength=cp).astype(int).tolist()
    assert max(loads) > 1.03 * cost.sum() / cp  # a real imbalance to remove
    swap_blocks(*block_groups(lens, pack_len, tile), owner, cp, loads)
    assert np.array_equal(np.bincount(owner, minlength=cp), np.full(cp, n // cp))
    assert np.bincount(owner, cost).max() <= (1 + SWAP_TOLERANCE) * cost.sum() / cp


@pytest.mark.parametrize(("lens", "cp", "most"), [
    ([9054, 10065, 12555, 1025], 4, 0.32),
    ([7777, 1726, 7613, 7884, 7667], 4, 0.14),
    ([7777, 1726, 7613, 7884, 7667], 8, 0.29),
    ([3456, 13933, 34, 15170, 173], 8, 0.61),
])  # fmt: skip
def test_tiled_needs_few_keys_from_other_ranks_on_long_documents(lens, cp, most):
    """K/V the busiest-receiving rank needs over an all-gather's, on 32K long_context packs of the bench (a deal
    by density alone, documents cut every ``m`` blocks: 0.96, 0.37, 0.49, 0.87), and the tiles still balanced."""
    pack_len, tile = 32768, 128
    rows = rank_indices("tiled", cp, lens, pack_len, tile=tile)
    assert kv_recv_tokens(rows, lens, pack_len).max() / ((cp - 1) / cp * pack_len) <= most
    ideal = block_tiles(lens, pack_len, tile).sum() / cp
    assert live_tiles(rows, lens, pack_len, tile).max() <= (1 + SWAP_TOLERANCE) * ideal


def test_pairwise_resplits_take_a_small_deal_to_the_integer_bound():
    lens, pack_len, cp, tile = np.array([2015, 2071]), 4096, 8, 128  # 4 blocks a rank
    n, cost = pack_len // tile, block_tiles(lens, pack_len, tile)
    bound = max(-(-int(cost.sum()) // cp), int(cost.max()))
    first, size, c0 = block_groups(lens, pack_len, tile)
    owner, loads = deal_blocks(first, size, c0, n, cp)
    swap_blocks(first, size, c0, owner, cp, loads)
    assert np.bincount(owner, cost).max() > bound  # where single swaps stall
    resplit_pairs(first, size, c0, owner, cp)
    assert np.bincount(owner, cost).max() == bound
    assert np.array_equal(np.bincount(owner, minlength=cp), np.full(cp, n // cp))
    assert np.array_equal(owner, tiled_owners(lens, pack_len, cp, tile))


@pytest.mark.parametrize(("lens", "cp", "blocks"), [
    ([13, 35, 12, 362], 4, 2),  # at 2 blocks a rank the deal's busiest rank is optimal, the others not
    ([150, 213], 4, 2),
    ([329, 42, 3], 4, 2),
    ([400, 61, 300], 4, 3),
    ([700, 24], 3, 4),
])  # fmt: skip
def test_small_deals_leave_no_pair_of_ranks_a_better_split(lens, cp, blocks):
    """Up to RESPLIT_BLOCKS blocks a rank, no two ranks can share their blocks out more evenly (less sum of
    squared live tiles, the busiest no busier): brute force over every split of every pair's blocks."""
    tile = 64
    pack_len = cp * blocks * tile
    rows = rank_indices("tiled", cp, lens, pack_len, tile=tile)
    cost = block_tiles(lens, pack_len, tile)
    load = live_tiles(rows, lens, pack_len, tile)
    held = rows[:, ::tile] // tile  # every rank's whole blocks
    assert np.array_equal(load, cost[held].sum(axis=1)), "a tiled rank pays its blocks' tiles"
    better = []
    for a, b in itertools.combinations(range(cp), 2):
        both = np.concatenate([held[a], held[b]])
        for pick in itertools.combinations(range(2 * blocks), blocks):
            la = int(cost[both[list(pick)]].sum())
            lb = int(load[a] + load[b]) - la
            if max(la, lb) <= load.max() and la * la + lb * lb < load[a] ** 2 + load[b] ** 2:
                better.append((a, b, la, lb))
    assert not better, (load.tolist(), better[:3])


def test_tiled_causal_work_in_info_equals_the_rows_work():
    from cpdata.layout.maps import layout_run_block
    from cpdata.offline.metrics import pack_geometry

    rng = np.random.default_rng(5)
    packs = [_pack(rng, "tiled:64", 3, 4)[0] for _ in range(5)]
    pack_len = alignment("tiled:64", 3)[1] * 4
    block = layout_run_block("tiled:64", 3, packs, pack_len)
    real = [np.minimum(lens, rng.integers(0, 200, size=lens.size)) for lens in packs]
    work = block.causal_work(np.concatenate(real))
    for p, (lens, table) in enumerate(zip(packs, block.tables(), strict=True)):
        rows = rank_indices("tiled:64", 3, lens, pack_len)
        assert np.array_equal(table.rows(), rows) and np.array_equal(table.inverse(), inverse_indices(rows))
        assert np.array_equal(work[p], causal_work(rows, pack_geometry(real[p], lens, pack_len).positions))


@pytest.mark.parametrize(("args", "message"), [
    (("balanced", 128), "applies to layout 'tiled' only"),
    (("tiled", 100), "tile must be one of [64, 128, 256]"),
    (("tiled:64", 256), "already says tile 64"),
])  # fmt: skip
def test_layout_spec_errors_name_the_fix(args, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layout_spec(*args)


def test_layout_spec_strings_and_alignment():
    assert (layout_spec("tiled"), layout_spec("tiled", 128), layout_spec("tiled", 256)) == ("tiled", "tiled", "tiled:256")
    assert alignment("tiled", 4) == (1, 512) and alignment("tiled", 4, tile=256) == alignment("tiled:256", 4) == (1, 1024)
    with pytest.raises(ValueError, match="128 is written 'tiled'"):
        alignment("tiled:128", 2)
    with pytest.raises(ValueError, match="capacity=1000 is not a multiple of 1024"):
        plan_lengths(np.array([10, 20]), capacity=1000, layout="tiled:256", cp_size=4)


def _docs(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"input_ids": rng.integers(1, 1000, size=int(rng.integers(5, 300))).tolist()} for _ in range(n)]


def test_tiled_loader_resumes_exactly_and_refuses_another_tile():
    from cpdata.worker.batch import ShardedBatch

    docs = _docs(40)
    config = dict(capacity=512, cp_size=2, layout="tiled", tile=64, prefetch=0, pin_memory=False)

    def compare(actual, expected):
        assert isinstance(actual, ShardedBatch)
        assert_items_equal(dict(actual), dict(expected), "tensors")
        assert_items_equal(actual.layout, expected.layout, "layout")
        assert_items_equal(actual.info, expected.info, "info")

    make = lambda: build_node(docs, **records(cp_rank=1, **config))  # noqa: E731
    items = list(make())
    assert len(items) >= 4 and items[0].info["layout"] == "tiled:64"
    rows = items[0].layout.local_token_global_indices.numpy().reshape(-1, 64)
    assert (rows[:, 0] % 64 == 0).all() and (np.diff(rows, axis=1) == 1).all()
    run_save_load_contract(make, [0, 1, len(items) // 2, len(items)], compare, round_trips=("pickle",))
    node = make()
    next(node)
    state = node.get_state()
    other = build_node(docs, **records(cp_rank=1, **{**config, "tile": 128}))
    with pytest.raises(ValueError, match="saved with .*'tiled:64'.* this node has .*'tiled'"):
        other.reset(state)


_CHILD = """
import hashlib, sys
import numpy as np
from cpdata.layout.maps import rank_indices
from cpdata.packing.distributions import sample_lengths
h = hashlib.sha256()
for seed in range(6):
    lens = sample_lengths("sft", 60, seed=seed)
    lens = lens[np.cumsum(lens) <= 32768]
    for tile in (64, 128, 256):
        h.update(rank_indices("tiled", 4, lens, 32768, tile=tile).tobytes())
print(h.hexdigest())
"""


def test_tiled_rows_are_the_same_in_another_process():
    h = hashlib.sha256()
    for seed in range(6):
        lens = sample_lengths("sft", 60, seed=seed)
        lens = lens[np.cumsum(lens) <= 32768]
        for tile in (64, 128, 256):
            h.update(rank_indices("tiled", 4, lens, 32768, tile=tile).tobytes())
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "123"})  # fmt: skip
    assert out.stdout.strip() == h.hexdigest()


def test_flex_mask_bytes_equal_create_block_mask_tensors():
    from torch.nn.attention.flex_attention import create_block_mask

    from cpdata.bench.attention import flex_mask_bytes

    for local, keys, tile in ((256, 512, 64), (384, 768, 128)):
        bm = create_block_mask(lambda b, h, q, k: k <= q, None, None, local, keys, device="cpu", BLOCK_SIZE=tile)
        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices")  # fmt: skip
        tensors = [getattr(bm, n) for n in names]
        assert all(t is not None for t in tensors)
        assert sum(t.numel() * t.element_size() for t in tensors) == flex_mask_bytes(local, keys, tile)


def test_precompute_with_a_tile_records_it_and_inspect_counts_tiles(tmp_path):
    from cpdata.offline.metrics import summarize
    from cpdata.offline.precompute_plan import precompute

    lengths = np.random.default_rng(0).integers(10, 3000, size=200)
    np.save(tmp_path / "lens.npy", lengths)
    store = precompute(tmp_path / "lens.npy", tmp_path / "plan", capacity=8192, cp_size=4, layout="tiled", tile=256)
    assert (store.config["layout"], store.manifest["config"]["pack_multiple"]) == ("tiled:256", 1024)
    rows = {row.layout: row for row in summarize(store).layouts}
    assert "tiled:256" in rows and "tiled" in rows
    assert rows["tiled:256"].tiles_mean <= 1.03 and rows["tiled"].tiles_mean <= 1.02
    assert rows["balanced"].tiles_mean > 1.1 > rows["balanced"].imbalance_mean  # pairs equal, tiles not
