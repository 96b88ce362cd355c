"""Pad is free: every mask cpdata builds lets a pad query see its own key only.

A pack's pads (the tail, and each slot's alignment pads) carry no target, so what a pad query attends to
never reaches the loss; it only costs tiles. With the batch's ``cu_seqlens`` every mask (the helpers'
dense mask and ``BlockMask``, the ``"cpdata"`` attention's, hf_model_kwargs' sdpa and eager masks) keeps
one key for a pad query, its own: one diagonal tile per pad block, and no empty softmax row. Real
queries keep exactly the keys they had (the tests against each document alone hold them to that).
"""

from __future__ import annotations

import math

import pytest
import torch

from cpdata.adapters import document_causal_mask, flex_block_mask, hf_model_kwargs, register_hf_attention
from cpdata.adapters.hf_attention import attention_state
from cpdata.layout.maps import LAYOUTS, inverse_indices, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import graph_options

TILE = 128
SIX = [200, 180, 230, 150, 210, 230]  # 1,200 real tokens in a 16K pack
register_hf_attention()


def _pack(layout: str, cp: int, lens=SIX, capacity: int = 16384) -> tuple:
    g = torch.Generator().manual_seed(cp)
    docs = [{"input_ids": torch.randint(1, 50, (n,), generator=g).tolist()} for n in lens]
    graph = shard_graph(docs, graph_options(capacity=capacity, cp_size=cp, layout=layout, overflow="split"))
    return next(iter(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True)))


def _tiles(bm) -> int:
    full = bm.full_kv_num_blocks
    return int(bm.kv_num_blocks.sum()) + (0 if full is None else int(full.sum()))


def _own_tiles(lens) -> int:
    """Causal tiles of each document alone, from position 0: ``b (b + 1) / 2`` for ``b`` query blocks."""
    return sum(math.ceil(n / TILE) * (math.ceil(n / TILE) + 1) // 2 for n in lens)


CASES = [(layout, 1) for layout in LAYOUTS] + [(layout, 2) for layout in LAYOUTS if layout != "identity"]


@pytest.mark.parametrize("layout,cp", CASES)
def test_a_16k_pack_of_six_short_documents_costs_its_documents_and_one_tile_per_pad_block(layout, cp):
    shards = _pack(layout, cp)
    assert shards[0].info["n_documents"] == len(SIX)
    pads = sum(int(s["padding_mask"].sum()) for s in shards)
    budget = _own_tiles(SIX) + math.ceil(pads / TILE)
    mine = old = 0
    for s in shards:
        lay = s.layout if cp > 1 else None
        doc, cu, real = s["document_ids"].reshape(1, -1), s["cu_seqlens_padded"], s["cu_seqlens"]
        bm = flex_block_mask(lay, doc, cu, cu_seqlens=real)
        state = attention_state("cpdata", s.layout, doc, cu, real)  # the "cpdata" attention's own BlockMask
        assert _tiles(state.mask("flex", None, torch.device("cpu"))) == _tiles(bm)
        mine += _tiles(bm)
        old += _tiles(flex_block_mask(lay, doc, cu))  # pads attending their slot, as before
    print(f"{layout} cp {cp}: {mine} tiles (pads over their slot: {old}); budget 2 x {budget}")
    assert mine <= 2 * budget, (layout, cp, mine, budget)
    assert old > 2 * budget, "the pack is not pad-heavy: the case would pass vacuously"


@pytest.mark.parametrize("cp", [1, 2])
def test_an_empty_pad_pack_has_no_causal_block(cp):
    size = 1024
    rows = rank_indices("balanced", cp, [], size)
    cu_pad, cu = torch.tensor([0, size], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    for rank in range(cp):
        lay = ShardLayout(local_token_global_indices=torch.from_numpy(rows[rank]), padded_seq_len=size,
                          gather_index=torch.from_numpy(inverse_indices(rows)), cp_size=cp, cp_rank=rank)  # fmt: skip
        doc = torch.zeros(1, rows.shape[1], dtype=torch.int64)
        dense = document_causal_mask(lay, doc, cu_pad, cu_seqlens=cu)[0, 0]
        pos = lay.local_token_global_indices.long()
        assert torch.equal(dense, torch.nn.functional.one_hot(pos, size).bool())  # the diagonal, nothing else
        bm = flex_block_mask(lay, doc, cu_pad, cu_seqlens=cu)
        per_block = bm.kv_num_blocks + (0 if bm.full_kv_num_blocks is None else bm.full_kv_num_blocks)
        diagonal = [len(set((pos[i : i + TILE] // TILE).tolist())) for i in range(0, pos.numel(), TILE)]
        assert per_block.reshape(-1).tolist() == diagonal  # only the tiles holding each query's own key
        assert _tiles(flex_block_mask(lay, doc, cu_pad)) > per_block.numel()  # what pads over their slot cost


@pytest.mark.parametrize("layout,cp", [("identity", 1), ("thd", 2), ("balanced", 2), ("round_robin", 2)])
def test_pad_rows_of_every_dense_mask_hold_only_the_diagonal(layout, cp):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    shards = _pack(layout, cp, lens=[5, 23, 9, 40, 3], capacity=128)
    checked = 0
    for s in shards:
        pad = s["padding_mask"].reshape(-1)
        pos = s.layout.local_token_global_indices.reshape(-1).long()
        lay = s.layout if cp > 1 else None
        doc, cu, real = s["document_ids"].reshape(1, -1), s["cu_seqlens_padded"], s["cu_seqlens"]
        masks = {"helper": document_causal_mask(lay, doc, cu, cu_seqlens=real, keys="global")[0, 0],
                 "cpdata": attention_state("cpdata", s.layout, doc, cu, real).mask("dense", None, pos.device)[0, 0]}
        if cp == 1:  # hf_model_kwargs' sdpa and eager masks (at cp > 1 they are the helper's, inside the ctx)
            masks["sdpa"] = hf_model_kwargs(s, "sdpa", config=config)["attention_mask"][0, 0]
            masks["eager"] = hf_model_kwargs(s, "eager", config=config)["attention_mask"][0, 0] == 0
        for name, keep in masks.items():
            assert torch.equal(keep[pad], torch.nn.functional.one_hot(pos[pad], keep.shape[-1]).bool()), name
            assert keep[~pad].sum(-1).ge(1).all() and not keep[~pad][:, pos[pad]].any(), name  # real: no pad key
            checked += int(pad.sum())
    assert checked > 0, "no pad in the pack: the case would pass vacuously"
