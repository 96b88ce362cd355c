"""The CP attention context in one process: patching, nesting, pass-through and refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.device.cp_attention import ContextParallelAttention
from cpdata.layout.shard_layout import ShardLayout

SDPA = F.scaled_dot_product_attention
# a cp = 2 layout of rank 0: no collective runs in these tests (every call passes through or is refused)
LAYOUT = ShardLayout(local_token_global_indices=torch.tensor([0, 1, 6, 7]),
                     gather_index=torch.tensor([0, 1, 4, 5, 6, 7, 2, 3]), cp_size=2, cp_rank=0)


def _quiet(layout: ShardLayout = LAYOUT) -> ContextParallelAttention:
    """A context that makes no SDPA call on purpose (these tests check the patching itself)."""
    return ContextParallelAttention(layout, require_calls=False)


def test_patch_is_restored_and_contexts_nest():
    with _quiet() as outer:
        patched_outer = F.scaled_dot_product_attention
        assert patched_outer is not SDPA
        with _quiet():
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
    a, b = _quiet(), _quiet()
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
    with _quiet():
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


def test_a_model_that_bypasses_sdpa_inside_the_ctx_is_reported():
    """cp 2, no SDPA call at all (an eager-style attention): leaving the ctx names the cause and the fix."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"does not call\s.*scaled_dot_product_attention.*'cpdata'"):
        with ContextParallelAttention(LAYOUT):
            torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q  # attention by hand: the patch never sees it
    with pytest.raises(ZeroDivisionError):  # an exception in flight is not replaced by the report
        with ContextParallelAttention(LAYOUT):
            raise ZeroDivisionError
    with ContextParallelAttention(LAYOUT) as ctx:  # the "cpdata" HF attention reports the calls it served
        from cpdata.device.cp_attention import active_contexts, record_served_call

        assert active_contexts() == (ctx,)
        record_served_call()
    assert ctx.served == 1 and active_contexts() == ()
    one = ShardLayout(local_token_global_indices=torch.arange(4), gather_index=torch.arange(4), cp_size=1)
    with ContextParallelAttention(one):  # cp 1: local attention is the whole attention, nothing to report
        pass


@pytest.mark.parametrize("causal", [True, False])
def test_window_keeps_the_last_w_keys_over_global_positions(causal):
    """cp 1 (no collective): the ctx's window equals an explicit sliding-window mask, inside each document."""
    n, w = 12, 3
    layout = ShardLayout(local_token_global_indices=torch.arange(n), gather_index=torch.arange(n), cp_size=1)
    docs = torch.tensor([0] * 7 + [1] * 5)[None]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with ContextParallelAttention(layout, document_ids=docs, cu_seqlens_padded=torch.tensor([0, 7, 12]),
                                  window=w) as ctx:  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert ctx.served == 1
    i = torch.arange(n)
    keep = (docs[0][:, None] == docs[0][None, :]) & (i[:, None] - i[None, :] < w)
    keep &= (i[None, :] <= i[:, None]) if causal else (i[None, :] - i[:, None] < w)
    assert torch.allclose(out, SDPA(q, k, v, attn_mask=keep), atol=1e-12)
    assert not torch.allclose(out, SDPA(q, k, v, attn_mask=docs[0][:, None] == docs[0][None, :]), atol=1e-3)
    with pytest.raises(ValueError, match=r"^window must be an int >= 1 or None, got 0 \(a sliding window's keys"):
        ContextParallelAttention(layout, window=0)


@pytest.mark.parametrize("additive", [False, True])
def test_a_callers_global_mask_applies_within_the_document_mask(additive):
    """cp 1: a mask over the global keys (bool, or additive with -inf) is combined with the documents: a key
    outside the query's document stays hidden whatever the caller's mask allows."""
    n = 10
    layout = ShardLayout(local_token_global_indices=torch.arange(n), gather_index=torch.arange(n), cp_size=1)
    docs = torch.tensor([0] * 6 + [1] * 4)[None]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = torch.rand(n, n, generator=g) < 0.6
    allowed |= torch.eye(n, dtype=torch.bool)  # every query keeps a key
    mask = allowed if not additive else torch.zeros(n, n, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    with ContextParallelAttention(layout, document_ids=docs, cu_seqlens_padded=torch.tensor([0, 6, 10])) as ctx:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ctx.served == 1
    same_doc = docs[0][:, None] == docs[0][None, :]
    assert torch.allclose(out, SDPA(q, k, v, attn_mask=allowed & same_doc), atol=1e-12)
    assert (allowed & ~same_doc).any(), "the caller's mask alone would cross documents"
    assert not torch.allclose(out, SDPA(q, k, v, attn_mask=allowed), atol=1e-3)


def test_document_mask_false_counts_documents_not_empty_slots():
    """``ctx(document_mask=False)`` is allowed where every row holds one document: a slot of only pads (real
    length 0) is no second document; two real documents in a row are refused."""
    docs = torch.tensor([0, 0, 1, 1])  # rank 0's ids; the slots: [0, 6) one document, [6, 8) pads only
    one = AttentionContextFactory(LAYOUT, None, docs, torch.tensor([0, 6, 8]), torch.tensor([0, 6, 6]))
    assert one(document_mask=False, require_calls=False).core.document_ids is None
    two = AttentionContextFactory(LAYOUT, None, docs, torch.tensor([0, 6, 8]), torch.tensor([0, 6, 7]))
    with pytest.raises(ValueError, match="a pack with 2 documents in one row"):
        two(document_mask=False)
