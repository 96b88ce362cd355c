"""Document-causal masks of a CP shard (local queries x global keys) against a brute-force mask."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from cpdata.adapters import document_causal_mask, flex_block_mask
from cpdata.layout.maps import LAYOUTS, alignment
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank

LENS = [7, 30, 3, 12, 45, 1, 9, 20, 16, 5]


def _shards(layout: str, cp: int, qkv_format: str = "bshd", batch_size: int = 1, capacity: int = 48):
    g = torch.Generator().manual_seed(cp)
    docs = [{"input_ids": torch.randint(1, 50, (n,), generator=g).tolist()} for n in LENS]
    graph = shard_graph(docs, GraphOptions(capacity=capacity, cp_size=cp, layout=layout, batch_size=batch_size, qkv_format=qkv_format, plan=StreamPlan(overflow="split")))  # fmt: skip
    return list(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True))


def _brute(shards, rank: int, pad_free: bool = False) -> torch.Tensor:
    """``[B, 1, L, S]`` from the global document ids (assembled from every rank) and global positions;
    ``pad_free``: a pad query keeps its own key only (the mask given ``cu_seqlens``)."""
    rows = shards[0]["document_ids"].reshape(-1, shards[0]["document_ids"].shape[-1]).shape[0]
    stream = shards[0].layout.padded_seq_len
    doc = torch.empty(rows, stream, dtype=torch.int64)
    pad = torch.empty(rows, stream, dtype=torch.bool)
    for s in shards:
        doc[:, s.layout.local_token_global_indices] = s["document_ids"].reshape(rows, -1)
        pad[:, s.layout.local_token_global_indices] = s["padding_mask"].reshape(rows, -1).bool()
    pos = shards[rank].layout.local_token_global_indices.tolist()
    mask = torch.zeros(rows, 1, len(pos), stream, dtype=torch.bool)
    for b in range(rows):
        for i, q in enumerate(pos):
            for k in range(q + 1):
                mask[b, 0, i, k] = bool(doc[b, k] == doc[b, q]) and not (pad_free and pad[b, q] and k != q)
    return mask


CASES = [(layout if layout != "tiled" else "tiled:64", cp, "bshd", 1) for layout in LAYOUTS for cp in (1, 2, 3)
         if not (layout == "identity" and cp > 1)]  # fmt: skip
CASES += [("thd", 2, "thd", 2), ("balanced", 2, "thd", 3), ("contiguous", 2, "bshd", 2), ("round_robin", 3, "bshd", 2)]


@pytest.mark.parametrize("layout,cp,qkv_format,batch_size", CASES)
def test_dense_mask_equals_brute_force(layout, cp, qkv_format, batch_size):
    checked = pads = 0
    capacity = max(48, alignment(layout, cp)[1])  # tiled: whole 64-token blocks per rank
    for shards in _shards(layout, cp, qkv_format, batch_size, capacity)[:3]:
        for r, s in enumerate(shards):
            got = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
            assert torch.equal(got, _brute(shards, r)), (layout, cp, r)
            pad_free = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"],
                                            cu_seqlens=s["cu_seqlens"])  # fmt: skip
            assert torch.equal(pad_free, _brute(shards, r, pad_free=True)), (layout, cp, r)
            checked += int(got.sum())
            pads += int(s["padding_mask"].sum())
    assert checked > 0 and pads > 0


def test_whole_pack_without_a_layout_is_block_diagonal_causal():
    (s,) = _shards("identity", 1)[1]
    got = document_causal_mask(None, s["document_ids"], s["cu_seqlens_padded"])
    assert torch.equal(got, _brute([s], 0))
    assert got.diagonal(dim1=-2, dim2=-1).all(), "every query, pads included, sees itself: no all-masked row"



def test_a_layout_without_padded_seq_len_has_rows_of_cp_times_the_local_tokens():
    """A hand-built layout (no ``padded_seq_len``): each row is ``cp * L`` keys long, so the mask of B = 2 rows
    at cp = 2 is the pipeline layout's, over all ``S`` keys of each row, in its own row's documents."""
    from dataclasses import replace

    shards = _shards("contiguous", 2, "bshd", 2)[0]
    for r, s in enumerate(shards):
        bare = replace(s.layout, padded_seq_len=None)
        for cu_seqlens in (None, s["cu_seqlens"]):
            got = document_causal_mask(bare, s["document_ids"], s["cu_seqlens_padded"], cu_seqlens=cu_seqlens)
            assert got.shape[-1] == 2 * s["document_ids"].shape[-1]
            assert torch.equal(got, _brute(shards, r, pad_free=cu_seqlens is not None)), (r, cu_seqlens is None)
    assert s["document_ids"].shape[0] == 2 and s["document_ids"][1].max() > s["document_ids"][0].max()

def _eval_mask_mod(block_mask, rows: int, local: int, keys: int) -> torch.Tensor:
    b = torch.arange(rows)[:, None, None]
    q = torch.arange(local)[None, :, None]
    k = torch.arange(keys)[None, None, :]
    return block_mask.mask_mod(b, torch.zeros(()), q, k)[:, None]


FLEX_CASES = [("balanced", 2, "bshd", 1), ("thd", 2, "thd", 2), ("contiguous", 2, "bshd", 2),
              ("contiguous", 3, "bshd", 3)]  # the last two: [B, L] document ids, B > 1


@pytest.mark.parametrize("layout,cp,qkv_format,batch_size", FLEX_CASES)
def test_flex_block_mask_matches_the_dense_mask(layout, cp, qkv_format, batch_size):
    shards = _shards(layout, cp, qkv_format, batch_size)[0]
    s = shards[1]
    dense = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"], cu_seqlens=s["cu_seqlens"])
    assert torch.equal(dense, _brute(shards, 1, pad_free=True))
    bm = flex_block_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"], block_size=16,
                         cu_seqlens=s["cu_seqlens"])  # fmt: skip
    rows, _, local, keys = dense.shape
    assert rows == (batch_size if qkv_format == "bshd" else 1)
    if rows > 1:  # rows hold other documents: a mask that reused row 0's bounds would differ
        assert not torch.equal(dense[0], dense[1])
    assert bm.shape == (rows, 1, local, keys)
    assert torch.equal(_eval_mask_mod(bm, rows, local, keys), dense)
    # a block the mask rules out entirely is skipped, one it touches is kept: compare at block level
    padded = F.pad(dense[:, 0], (0, -keys % 16, 0, -local % 16))
    blocks = padded.unflatten(1, (-1, 16)).unflatten(3, (-1, 16)).any(dim=(2, 4))
    assert torch.equal(bm.to_dense()[:, 0].bool(), blocks)
    assert not blocks.all(), "the documents rule some blocks out"


def test_flex_attention_runs_on_cpu_forward():
    """torch 2.13 runs flex_attention on CPU unfused, forward only (backward raises NotImplementedError)."""
    from torch.nn.attention.flex_attention import flex_attention

    shards = _shards("balanced", 2)[0]
    s = shards[0]
    bm = flex_block_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
    dense = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
    local, keys = dense.shape[-2:]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, local, 8, generator=g)
    k, v = torch.randn(2, 1, 2, keys, 8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense))


def test_flex_attention_over_rows_of_a_batch_equals_sdpa_with_the_dense_mask():
    """``[B, L]`` document ids at B = 3: each row attends within its own documents."""
    from torch.nn.attention.flex_attention import flex_attention

    s = _shards("contiguous", 2, "bshd", 3)[0][1]
    assert s["document_ids"].shape[0] == 3
    bm = flex_block_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
    dense = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
    local, keys = dense.shape[-2:]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, local, 8, generator=g)
    k, v = torch.randn(2, 3, 2, keys, 8, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense))


def test_mismatched_inputs_are_refused():
    shards = _shards("balanced", 2)[0]
    s = shards[0]
    with pytest.raises(ValueError, match="local positions"):
        document_causal_mask(s.layout, s["document_ids"][:, :-1], s["cu_seqlens_padded"])
    with pytest.raises(ValueError, match="document_ids must be"):
        document_causal_mask(s.layout, s["document_ids"][None], s["cu_seqlens_padded"])


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("block", [4, 16])
def test_interval_block_mask_equals_create_block_mask(window, block):
    """The interval construction gives torch's own BlockMask tile for tile (partial and full), ragged tails too."""
    from torch.nn.attention.flex_attention import create_block_mask

    from cpdata.device.attention_masks import QuerySlots, block_mask

    g = torch.Generator().manual_seed(block + (window or 0))
    row_len, local = 101, 37
    cuts = torch.sort(torch.randint(1, row_len, (6,), generator=g)).values
    slot_start = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
    if window in (None, 40):  # a contiguous rank's queries: full tiles inside the documents
        pos = torch.arange(40, 40 + local)
    else:  # any subset (round-robin / balanced ranks)
        pos = torch.sort(torch.randperm(row_len, generator=g)[:local]).values
    start = slot_start[torch.searchsorted(slot_start, pos, right=True) - 1][None]
    slots = QuerySlots(pos=pos, start=start, end=torch.full_like(start, row_len), row_len=row_len)
    mine = block_mask(*slots.intervals(window=window), row_len, block_size=block)

    def mask_mod(b, h, q, k):
        keep = (k >= start[b, q]) & (k <= pos[q])
        return keep & (k > pos[q] - window) if window is not None else keep

    ref = create_block_mask(mask_mod, 1, None, local, row_len, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), name
    assert torch.equal(mine.to_dense(), ref.to_dense())
    if window is None and block == 4:
        assert int(mine.full_kv_num_blocks.sum()) > 0 and int(mine.kv_num_blocks.sum()) > 0, "full and partial"
