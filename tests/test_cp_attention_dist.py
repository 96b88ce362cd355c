"""The CP attention context on real gloo ranks: full-sequence SDPA from local shards, forward and backward.

Every rank builds the same full Q/K/V (shared seed), takes its layout row, runs
SDPA on its local slices inside ``ContextParallelAttention`` and compares with
single-process full attention sliced to its local order; gradients of q, k, v
are compared with the full reference's gradients at the same positions (the
gather's reduce-scatter sums every rank's loss, so each local key gradient is
the full loss's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from test_gather_dist import GATHERS, SCATTERS, counting_collectives

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.device.cp_attention import ContextParallelAttention
from cpdata.layout.maps import alignment, inverse_indices, rank_indices
from cpdata.layout.shard_layout import ShardLayout

CP_LAYOUTS = ("balanced", "contiguous", "round_robin", "thd")


def _pack(layout: str, cp: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(rows [cp, L], document id per global position) of a random pack with several documents."""
    doc_mult, pack_mult = alignment(layout, cp)
    lens = rng.integers(1, 5, size=int(rng.integers(2, 5))) * doc_mult
    total = int(lens.sum())
    pack_len = total + (-total) % pack_mult + pack_mult
    rows = rank_indices(layout, cp, lens, pack_len)
    docs = np.minimum(np.searchsorted(np.cumsum(lens), np.arange(pack_len), side="right"), len(lens) - 1)
    return rows, docs


def _reference(q, k, v, w, docs, causal: bool, document: bool, enable_gqa: bool):
    """Full attention, its weighted loss and the gradients of q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = q.shape[-2]
    keep = torch.ones(s, s, dtype=torch.bool)
    if causal:
        keep &= torch.ones(s, s, dtype=torch.bool).tril()
    if document:
        d = torch.from_numpy(docs)
        keep &= d[:, None] == d[None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=enable_gqa)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _attention_matches_full(rank: int, cp: int) -> dict:
    group = None  # the default group is the CP group here
    rng = np.random.default_rng(cp)
    checked, reordered, differs = 0, 0, 0
    for layout in CP_LAYOUTS:
        rows, docs = _pack(layout, cp, rng)
        reordered += int(not np.array_equal(rows.reshape(-1), np.arange(rows.size)))
        s = rows.size
        lay = ShardLayout(
            local_token_global_indices=torch.from_numpy(rows[rank]),
            padded_seq_len=s,
            gather_index=torch.from_numpy(inverse_indices(rows)),
            cp_size=cp,
            cp_rank=rank,
        )
        idx = torch.from_numpy(rows[rank])
        for causal, document, heads_kv, lazy in ((True, False, 2, False), (True, True, 1, True), (False, True, 2, False)):
            g = torch.Generator().manual_seed(s * 7 + heads_kv)
            q = torch.randn(2, 2, s, 5, generator=g, dtype=torch.float64)
            k = torch.randn(2, heads_kv, s, 5, generator=g, dtype=torch.float64)
            v = torch.randn(2, heads_kv, s, 3, generator=g, dtype=torch.float64)
            w = torch.randn(2, 2, s, 3, generator=g, dtype=torch.float64)
            gqa = heads_kv != 2
            ref, dq, dk, dv = _reference(q, k, v, w, docs, causal, document, gqa)
            lq, lk, lv = (t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v))
            # two bshd rows: stream slots, the second row's after the first's
            doc_local = torch.from_numpy(docs[rows[rank]]) + torch.tensor([[0], [int(docs[-1]) + 1]])
            cu = torch.from_numpy(np.append(np.flatnonzero(np.diff(docs, prepend=-1)), s))
            cu = torch.cat((cu, cu[1:] + s)) if document else None
            this = lay if not lazy else ShardLayout(local_token_global_indices=idx.to(torch.int32).view(1, -1))
            with ContextParallelAttention(this, group, document_ids=doc_local if document else None,
                                          cu_seqlens_padded=cu):  # fmt: skip
                out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa)
                with counting_collectives() as calls:  # masks and the inverse are cached: one gather a call
                    again = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa)
            assert F.scaled_dot_product_attention is not None
            assert [n for n, _ in calls] and all(n in GATHERS for n, _ in calls) and len(calls) == 1, calls
            assert torch.allclose(out, ref.index_select(2, idx), atol=1e-12), (layout, causal, document)
            assert torch.equal(out, again)
            with counting_collectives() as back:
                (out * w.index_select(2, idx)).sum().backward()
            assert len(back) == 1 and back[0][0] in SCATTERS, back
            assert torch.allclose(lq.grad, dq.index_select(2, idx), atol=1e-12)
            assert torch.allclose(lk.grad, dk.index_select(2, idx), atol=1e-12)
            assert torch.allclose(lv.grad, dv.index_select(2, idx), atol=1e-12)
            # local-only attention differs (guards against a vacuous pass; rank 0 of contiguous may agree)
            local_only = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa)
            differs += int(not torch.allclose(local_only, out))
            checked += 1
    restored = F.scaled_dot_product_attention is _SDPA
    return {"checked": checked, "reordered": reordered, "differs": differs, "restored": restored}


_SDPA = F.scaled_dot_product_attention


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_in_ctx_equals_full_attention_forward_and_backward(cp):
    results = run_ranks(_attention_matches_full, cp, timeout=120)
    assert all(r["checked"] == 3 * len(CP_LAYOUTS) for r in results)
    assert all(r["restored"] for r in results)
    assert results[0]["reordered"] >= 3  # balanced, round_robin and thd reorder tokens
    assert all(r["differs"] >= 3 * len(CP_LAYOUTS) - 3 for r in results)


def _global_mask_and_factory(rank: int, cp: int) -> bool:
    rows = rank_indices("round_robin", cp, [], 4 * cp)
    s = rows.size
    lay = ShardLayout(
        local_token_global_indices=torch.from_numpy(rows[rank]),
        gather_index=torch.from_numpy(inverse_indices(rows)),
        cp_size=cp,
        cp_rank=rank,
    )
    idx = torch.from_numpy(rows[rank])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 4, generator=g, dtype=torch.float64) for _ in range(3))
    band = (torch.arange(s)[:, None] - torch.arange(s)[None, :]).abs() <= 2  # a sliding window over global keys
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    factory = AttentionContextFactory(lay, None)
    with factory():
        out = F.scaled_dot_product_attention(
            *(t.index_select(2, idx) for t in (q, k, v)), attn_mask=band.index_select(0, idx)
        )
        # a local-key mask cannot be applied, the fix is named
        try:
            F.scaled_dot_product_attention(*(t.index_select(2, idx) for t in (q, k, v)),
                                           attn_mask=torch.ones(s // cp, s // cp, dtype=torch.bool))
        except ValueError as e:
            assert "attention_mask=None" in str(e)
        else:
            raise AssertionError("a local-key mask was accepted")
    with factory(local_attn_mask="causal"):
        causal = F.scaled_dot_product_attention(*(t.index_select(2, idx) for t in (q, k, v)),
                                                attn_mask=torch.ones(s // cp, s // cp, dtype=torch.bool))
    full_causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(causal, full_causal.index_select(2, idx), atol=1e-12)
    return torch.allclose(out, ref.index_select(2, idx), atol=1e-12)


def test_global_key_mask_is_applied_and_local_key_mask_is_refused_or_replaced():
    assert all(run_ranks(_global_mask_and_factory, 2, timeout=60))


class _Presharded(dict):
    def __init__(self, tensors, layout):
        super().__init__(tensors)
        self.layout = layout


def _tiny_attention(input_ids: torch.Tensor, causal: bool, values: bool = False) -> torch.Tensor:
    """A one-layer 'model': fixed embeddings to Q/K/V ``[B, 2, S, 4]``, one SDPA call (``values``: V itself)."""
    table = torch.randn(50, 3, 2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, k, v = table[input_ids].permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, D]
    return v if values else F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sharder_ctx(rank: int, cp: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from cpdata.nemo.sharder import ContextParallelSharder

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    done = []
    # a raw full batch, NeMo style: shard() returns the CP attention ctx
    raw = {"input_ids": torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(1))}
    ref = _tiny_attention(torch.cat([raw["input_ids"], raw["input_ids"].new_zeros(2, 16 - 13)], 1), True)
    sharder = ContextParallelSharder(None, mesh, raw)
    ctx, out = sharder.shard(raw)
    with ctx():
        local = _tiny_attention(out["input_ids"], True)
    assert torch.allclose(local, ref.index_select(2, sharder.shard_layout.local_token_global_indices), atol=1e-12)
    assert torch.allclose(sharder.gather_token_tensor(local, seq_dim=2, trim=True), ref[:, :, :13], atol=1e-12)
    done.append("raw")
    # a worker-sharded packed batch: same ctx, with the document mask on request
    lens, pack_len = np.array([6, 2, 6]) * (2 * cp), 14 * 2 * cp
    rows = rank_indices("thd", cp, lens, pack_len)
    docs = torch.from_numpy(np.repeat(np.arange(3), lens))
    ids = torch.randint(0, 50, (1, pack_len), generator=torch.Generator().manual_seed(2))
    layout = ShardLayout(local_token_global_indices=torch.from_numpy(rows[rank]), padded_seq_len=pack_len,
                         gather_index=torch.from_numpy(inverse_indices(rows)), cp_size=cp, cp_rank=rank)
    idx = layout.local_token_global_indices
    cu = torch.from_numpy(np.append(0, np.cumsum(lens)))
    batch = _Presharded({"input_ids": ids[:, idx], "document_ids": docs[None, idx], "cu_seqlens_padded": cu}, layout)
    ctx, out = ContextParallelSharder(None, mesh, batch).shard(batch)
    with ctx(document_mask=True):
        local = _tiny_attention(out["input_ids"], True)
    per_doc = torch.cat([_tiny_attention(part, True) for part in ids.split(lens.tolist(), dim=1)], dim=2)
    assert torch.allclose(local, per_doc.index_select(2, idx), atol=1e-12)
    done.append("presharded")
    # a raw THD batch (NeMo's packed collater output): the ctx knows the documents from the slots
    real = np.array([3, 2, 6]) * cp  # real lengths inside the slots [12, 4, 12] * cp
    thd = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(pack_len)[None],
           "seq_lens": torch.from_numpy(real)[None], "seq_lens_padded": torch.from_numpy(lens)[None],
           "qkv_format": "thd"}  # fmt: skip
    sharder = ContextParallelSharder(None, mesh, thd)
    ctx, out = sharder.shard(thd)
    with ctx(document_mask=True):
        local = _tiny_attention(out["input_ids"][None], True)
    idx = sharder.shard_layout.local_token_global_indices
    starts = np.append(0, np.cumsum(lens)[:-1])
    is_real = torch.from_numpy(np.concatenate([np.arange(n) < r for n, r in zip(lens, real, strict=True)]))
    v = _tiny_attention(ids, True, values=True)  # a pad query sees its own key only: its output is its value
    want = torch.where(is_real[None, None, :, None], per_doc, v).index_select(2, idx)
    assert torch.allclose(local, want, atol=1e-12) and starts.size == 3 and not is_real.all()
    done.append("thd")
    return done


@pytest.mark.parametrize("cp", [2, 4])
def test_sharder_ctx_for_raw_and_presharded_batches(cp):
    assert run_ranks(_sharder_ctx, cp, timeout=120) == [["raw", "presharded", "thd"]] * cp
