"""``te_attention_kwargs`` against Transformer Engine's documented THD contract (TE itself needs CUDA).

Checked: DESIGN's worked examples, and that TE's own partition rule
(``get_batch_on_this_cp_rank`` / ``thd_get_partitioned_indices``: chunks
``r`` and ``2cp-1-r`` of every sequence of ``cu_seqlens_padded``, chunk size
``padded_len / 2cp``) applied to the returned arguments selects exactly the
tokens cpdata gave this rank, with no token past ``cu_seqlens_padded[-1]``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpdata.adapters import te_attention_kwargs, te_forward_kwargs
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests.dist_utils import run_ranks


def _shards(lens, cp, capacity, layout="thd", qkv_format="thd", batch_size=1, algorithm="concat"):
    docs = [{"input_ids": list(range(1, n + 1))} for n in lens]
    graph = shard_graph(docs, GraphOptions(capacity=capacity, cp_size=cp, layout=layout, qkv_format=qkv_format, batch_size=batch_size, plan=StreamPlan(algorithm=algorithm, overflow="split")))  # fmt: skip
    return list(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True))


def _te_partition(cu_seqlens_padded: list[int], cp: int, rank: int) -> list[int]:
    """TE's THD partition of one rank, written from its documentation."""
    out = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:], strict=True):
        assert (end - start) % (2 * cp) == 0, "TE needs every padded length divisible by 2*cp"
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


def test_design_worked_example_cp2():
    (r0, r1), = _shards([5, 3, 8], cp=2, capacity=20)[:1]
    for shard, expected in ((r0, [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]), (r1, [2, 3, 4, 5, 9, 10, 14, 15, 16, 17])):
        assert shard.layout.local_token_global_indices.tolist() == expected
        fwd = te_forward_kwargs(shard)
        assert fwd["qkv_format"] == "thd" and fwd["attn_mask_type"] == "padding_causal"
        assert fwd["cu_seqlens_q"].tolist() == fwd["cu_seqlens_kv"].tolist() == [0, 5, 8, 16]
        assert fwd["cu_seqlens_q_padded"].tolist() == fwd["cu_seqlens_kv_padded"].tolist() == [0, 8, 12, 20]
        assert fwd["cu_seqlens_q"].dtype == fwd["cu_seqlens_q_padded"].dtype == torch.int32
        assert type(fwd["max_seqlen_q"]) is int and fwd["max_seqlen_q"] == fwd["max_seqlen_kv"] == 8
        assert _te_partition([0, 8, 12, 20], 2, shard.layout.cp_rank) == expected


def test_design_worked_example_cp3():
    shards = _shards([5, 3, 8], cp=3, capacity=24)[0]
    fwd = te_forward_kwargs(shards[0])
    assert fwd["cu_seqlens_q_padded"].tolist() == [0, 6, 12, 24]
    assert fwd["max_seqlen_q"] == 12
    assert shards[0].layout.local_token_global_indices.tolist() == [0, 5, 6, 11, 12, 13, 22, 23]


@pytest.mark.parametrize("cp", [2, 4])
def test_te_partition_of_the_arguments_is_this_ranks_tokens(cp):
    lens = [13, 1, 40, 7, 22, 9, 3, 30, 17, 2, 11]
    checked = 0
    for shards in _shards(lens, cp=cp, capacity=64, algorithm="bfd", batch_size=2):
        for shard in shards:
            fwd = te_forward_kwargs(shard)
            padded = fwd["cu_seqlens_q_padded"].tolist()
            assert padded[-1] == shard.layout.padded_seq_len, "the last slot absorbs the tail"
            assert _te_partition(padded, cp, shard.layout.cp_rank) == shard.layout.local_token_global_indices.tolist()
            real = fwd["cu_seqlens_q"].diff()
            assert (real <= fwd["cu_seqlens_q_padded"].diff()).all()
            assert fwd["max_seqlen_q"] == int(fwd["cu_seqlens_q_padded"].diff().max())
            checked += 1
    assert checked >= 2 * cp


def test_cp1_any_layout_no_group():
    (shard,) = _shards([5, 3, 8], cp=1, capacity=16, layout="identity", qkv_format="bshd")[0]
    args = te_attention_kwargs(shard)
    assert args.context_parallel["cp_group"] is None
    assert args.forward["cu_seqlens_q"].tolist() == [0, 5, 8, 16] and args.forward["max_seqlen_q"] == 8


def test_refusals_name_the_fix():
    balanced = _shards([5, 3, 8], cp=2, capacity=20, layout="balanced", qkv_format="bshd")[0]
    with pytest.raises(ValueError, match="layout='thd'"):
        te_forward_kwargs(balanced[0])
    thd = _shards([5, 3, 8], cp=2, capacity=20)[0]
    with pytest.raises(ValueError, match="cp_group"):
        te_attention_kwargs(thd[0])
    with pytest.raises(ValueError, match="cp_comm_type"):
        te_attention_kwargs(thd[0], cp_comm_type="ring")
    two_rows = thd[0].replace(input_ids=thd[0]["input_ids"].reshape(2, -1))  # the pipeline never emits this
    with pytest.raises(ValueError, match="qkv_format='thd'"):
        te_forward_kwargs(two_rows)


def _on_ranks(rank: int, world: int) -> list:
    shard = _shards([5, 3, 8], cp=2, capacity=20)[0][rank]
    args = te_attention_kwargs(shard, dist.group.WORLD, cp_comm_type="all_gather")
    wrong = _shards([5, 3, 8], cp=2, capacity=20)[0][1 - rank]
    try:
        te_attention_kwargs(wrong, dist.group.WORLD)
        refused = False
    except ValueError:
        refused = True
    return [args.context_parallel["cp_global_ranks"], args.context_parallel["cp_comm_type"], refused]


def test_context_parallel_arguments_on_gloo():
    assert run_ranks(_on_ranks, 2) == [[[0, 1], "all_gather", True]] * 2
