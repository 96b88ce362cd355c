"""Padding is no document in the layout half: the K/V exchange moves nothing for pad queries, and the tile
counters charge a pad block one diagonal tile.

References: the pack's tiles at cp 1 (:func:`block_tiles` summed, which a test in ``test_layout_tiled.py``
checks against flex's own ``BlockMask`` counts), and the real tokens of the pack (no rank can need more keys
than the documents hold).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpdata.layout.exchange import exchange_plan
from cpdata.layout.maps import alignment, rank_indices
from cpdata.layout.tiled import block_groups
from cpdata.layout.tiles import block_tiles, kv_recv_tokens, live_tiles
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import graph_options

LAYOUTS = ("contiguous", "round_robin", "thd", "balanced", "tiled")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_six_short_documents_in_a_128k_pack_cost_their_own_tiles_plus_one_per_pad_block(layout):
    capacity, cp, tile = 131072, 8, 128
    d, _ = alignment(layout, cp)
    lens = [-(-200 // d) * d] * 6
    total = int(block_tiles(lens, capacity, tile).sum())
    docs_alone = sum(int(block_tiles([n], -(-n // tile) * tile, tile).sum()) for n in lens)  # 3 tiles each
    pad_blocks = capacity // tile - -(-sum(lens) // tile)
    assert total <= docs_alone + pad_blocks + len(lens)  # a block a document starts in may straddle two
    rows = rank_indices(layout, cp, lens, capacity)
    busiest = int(live_tiles(rows, lens, capacity, tile).max())
    assert busiest <= total < 1100, (layout, busiest, total)  # the tail charged as a document: ~64,840
    if layout in ("contiguous", "round_robin", "tiled"):  # whole pad blocks on every rank: the ideal share
        assert busiest <= 1.1 * total / cp + len(lens) * 2, (layout, busiest)
    assert kv_recv_tokens(rows, lens, capacity).max() <= sum(lens)


def test_pad_blocks_are_groups_of_one_tile():
    first, size, c0 = block_groups(np.array([200, 300], dtype=np.int64), 1024, 128)
    assert first.tolist() == [0, 2, 4, 5, 6, 7] and size.tolist() == [2, 2, 1, 1, 1, 1]
    assert c0.tolist() == [1, 2, 1, 1, 1, 1]
    assert block_tiles([200, 300], 1024, 128).tolist() == [1, 2, 2, 3, 1, 1, 1, 1]
    first, size, c0 = block_groups(np.zeros(0, dtype=np.int64), 512, 128)  # an empty pack: four pad blocks
    assert first.tolist() == [0, 1, 2, 3] and (size == 1).all() and (c0 == 1).all()


def test_exchange_without_real_ends_is_the_old_plan_and_with_them_needs_no_pad_keys():
    rows = rank_indices("contiguous", 4, [10, 6], 32)
    old = exchange_plan(rows, [0, 10])
    assert old.recv_counts().sum(axis=1).tolist() == [0, 8, 6, 14]  # the tail joined the last document
    new = exchange_plan(rows, [0, 10], real_ends=[10, 16])
    assert new.recv_counts().sum(axis=1).tolist() == [0, 8, 0, 0]  # rank 1's queries 8, 9 need keys 0..7 of doc 0
    with pytest.raises(ValueError, match="real_ends"):
        exchange_plan(rows, [0, 10], real_ends=[11, 16])  # past the next slot's start


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [2, 4])
def test_an_exchange_over_a_pack_with_a_pad_tail_receives_at_most_the_real_tokens(layout, cp):
    g = torch.Generator().manual_seed(cp)
    docs = [{"input_ids": torch.randint(1, 50, (200,), generator=g).tolist()} for _ in range(6)]
    graph = shard_graph(docs, graph_options(capacity=8192, cp_size=cp, layout=layout, overflow="split", batch_size=1,
                        qkv_format="thd"))  # fmt: skip
    shards = next(iter(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True, kv_exchange=True)))
    real = int(shards[0]["cu_seqlens"][-1])
    assert real == 1200 and int(shards[0]["cu_seqlens_padded"][-1]) == 8192  # one pack, a 6,992-token tail
    recv = [s.layout.kv_exchange.n_recv for s in shards]
    assert max(recv) <= real, (layout, recv)
    rows = np.stack([s.layout.local_token_global_indices.numpy() for s in shards])
    cu = shards[0]["cu_seqlens_padded"].numpy()
    ends = cu[:-1] + np.diff(shards[0]["cu_seqlens"].numpy())
    plan = exchange_plan(rows, cu[:-1], real_ends=ends)
    assert plan.recv_counts().sum(axis=1).tolist() == recv  # the worker passes the stream's real ends
    assert exchange_plan(rows, cu[:-1]).recv_counts().sum(axis=1).max() > 2 * real  # what the tail used to cost
