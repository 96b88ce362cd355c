"""The CP attention context in one process: patching, nesting, pass-through and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpdata.device.cp_attention import AttentionContextFactory, ContextParallelAttention
from cpdata.layout.shard_layout import ShardLayout

SDPA = F.scaled_dot_product_attention
# a cp = 2 layout of rank 0: no collective runs in these tests (every call passes through or is refused)
LAYOUT = ShardLayout(local_token_global_indices=torch.tensor([0, 1, 6, 7]),
                     gather_index=torch.tensor([0, 1, 4, 5, 6, 7, 2, 3]), cp_size=2, cp_rank=0)


def test_patch_is_restored_and_contexts_nest():
    with ContextParallelAttention(LAYOUT) as outer:
        patched_outer = F.scaled_dot_product_attention
        assert patched_outer is not SDPA
        with ContextParallelAttention(LAYOUT):
            assert F.scaled_dot_product_attention not in (SDPA, patched_outer)
        assert F.scaled_dot_product_attention is patched_outer
        with pytest.raises(RuntimeError, match="already active"):
            outer.__enter__()
    assert F.scaled_dot_product_attention is SDPA
    with pytest.raises(ZeroDivisionError):  # restored on an exception too
        with ContextParallelAttention(LAYOUT):
            raise ZeroDivisionError
    assert F.scaled_dot_product_attention is SDPA


def test_out_of_order_exit_is_refused():
    a, b = ContextParallelAttention(LAYOUT), ContextParallelAttention(LAYOUT)
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="LIFO"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is SDPA


def test_calls_not_on_this_ranks_tokens_pass_through():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=g)
    k_global, v_global = torch.randn(1, 2, 8, 8, generator=g), torch.randn(1, 2, 8, 8, generator=g)
    vision = torch.randn(1, 2, 5, 8, generator=g)
    with ContextParallelAttention(LAYOUT):
        mine = F.scaled_dot_product_attention(q, k_global, v_global)  # keys already gathered by the model
        tower = F.scaled_dot_product_attention(vision, vision, vision)  # another sequence altogether
    assert torch.equal(mine, SDPA(q, k_global, v_global))
    assert torch.equal(tower, SDPA(vision, vision, vision))


def test_refusals_name_the_fix():
    q = torch.randn(1, 2, 4, 8)
    with ContextParallelAttention(LAYOUT):
        with pytest.raises(ValueError, match="either attn_mask or is_causal"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 8, dtype=torch.bool), is_causal=True)
        with pytest.raises(ValueError, match="local keys"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match="last dim must be the 8 global keys"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 5, dtype=torch.bool))
        with pytest.raises(ValueError, match="must agree"):
            F.scaled_dot_product_attention(q, q, q.double())
    with pytest.raises(ValueError, match="document_ids"):
        AttentionContextFactory(LAYOUT)(document_mask=True)
    with pytest.raises(ValueError, match="local_token_global_indices"):
        ContextParallelAttention(ShardLayout())
    with pytest.raises(ValueError, match="'refuse' or 'causal'"):
        ContextParallelAttention(LAYOUT, local_attn_mask="drop")
