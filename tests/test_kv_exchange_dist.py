"""The K/V exchange on real gloo ranks: attention through it equals full document-causal attention.

Every rank builds the same random packs (shared seed), takes its row of the
layout and its part of the worker's exchange plan, and runs causal SDPA with a
document mask on its local slices, (a) inside ``ContextParallelAttention`` and
(b) with the mask helper over the exchanged keys. Both are compared with
single-process full attention (float64, 1e-10), forward and backward (the
gradients of q, k, v at the rank's positions). The collectives are counted: one
``batch_isend_irecv`` forward and one backward per call, no all-gather, and the
bytes each rank receives are exactly the plan's keys times the K/V row size.
Then the plan from the real pipeline (``ShardForRank(kv_exchange=True)`` in each
process) is checked for determinism and for send/receive agreement across
processes, and every other batch goes through the ctx the sharder hands out
(``AttentionContextFactory(...)(document_mask=True)``, bshd rows included)
against full attention over the reassembled documents.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from test_gather_dist import GATHERS, counting_collectives

from cpdata.adapters import document_causal_mask
from cpdata.device.batch_context import AttentionContextFactory
from cpdata.device.cp_attention import ContextParallelAttention
from cpdata.device.kv_exchange import exchange_tokens
from cpdata.layout.exchange import exchange_plan
from cpdata.layout.maps import alignment, inverse_indices, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import graph_options

CP_LAYOUTS = ("balanced", "contiguous", "round_robin", "thd")
TOL = 1e-10


def _pack(layout: str, cp: int, rng: np.random.Generator, long: bool):
    """(rows [cp, L], slot starts [K], document id per global position); ``long``: one document spans most."""
    doc_mult, pack_mult = alignment(layout, cp)
    if long:
        lens = np.array([12, 1, 2]) * doc_mult
    else:
        lens = rng.integers(1, 4, size=int(rng.integers(3, 7))) * doc_mult
    total = int(lens.sum())
    pack_len = total + (-total) % pack_mult + pack_mult
    rows = rank_indices(layout, cp, lens, pack_len)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    docs = np.minimum(np.searchsorted(np.cumsum(lens), np.arange(pack_len), side="right"), len(lens) - 1)
    return rows, starts, docs


def _reference(q, k, v, w, docs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    d = torch.from_numpy(docs)
    keep = torch.ones(d.numel(), d.numel(), dtype=torch.bool).tril() & (d[:, None] == d[None, :])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _close(a, b) -> bool:
    return torch.allclose(a, b, atol=TOL, rtol=0)


def _exchange_matches_full(rank: int, cp: int) -> dict:
    rng = np.random.default_rng(100 + cp)
    out = {"checked": 0, "fewer": 0, "received": 0, "differs": 0, "bidirectional": 0}
    for layout in CP_LAYOUTS:
        for long in (False, True):
            rows, starts, docs = _pack(layout, cp, rng, long)
            s, local = rows.size, rows.shape[1]
            plan = exchange_plan(rows, starts).rank(rank)
            lay = ShardLayout(local_token_global_indices=torch.from_numpy(rows[rank]), padded_seq_len=s,
                              gather_index=torch.from_numpy(inverse_indices(rows)), cp_size=cp, cp_rank=rank,
                              kv_exchange=plan)  # fmt: skip
            idx = torch.from_numpy(rows[rank])
            g = torch.Generator().manual_seed(s)
            q, k, v = (torch.randn(2, 2, s, e, generator=g, dtype=torch.float64) for e in (5, 5, 3))
            w = torch.randn(2, 2, s, 3, generator=g, dtype=torch.float64)
            ref, dq, dk, dv = _reference(q, k, v, w, docs)
            doc_local = torch.from_numpy(docs[rows[rank]]) + torch.tensor([[0], [len(starts)]])  # two bshd rows
            cu = torch.from_numpy(np.append(starts, s).astype(np.int32))
            cu_rows = torch.cat((cu, cu[1:] + s))
            row_elems = 2 * 2 * (5 + 3)  # B * H * (Ek + Ev) per key
            for path in ("ctx", "mask"):
                lq, lk, lv = (t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v))
                with counting_collectives() as calls:
                    if path == "ctx":
                        with ContextParallelAttention(lay, None, document_ids=doc_local,
                                                      cu_seqlens_padded=cu_rows) as attn:  # fmt: skip
                            attn.attention(lq, lk, lv, is_causal=True)  # the first call exchanges the doc ids too
                            calls.clear()
                            o = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
                    else:
                        mask = document_causal_mask(lay, doc_local[0], cu)  # one stream: [1, 1, L, K]
                        assert mask.shape == (1, 1, local, local + plan.n_recv)
                        kv = exchange_tokens(torch.cat((lk, lv), dim=-1), lay, None, seq_dim=2)
                        kx, vx = kv.split((5, 3), dim=-1)
                        o = F.scaled_dot_product_attention(lq, kx, vx, attn_mask=mask)
                moves = bool(plan.n_recv or plan.n_send)  # a rank with no keys to move calls no one
                assert [n for n, _ in calls] == ["batch_isend_irecv"] * moves, calls
                if moves:
                    (recv_dtype, recv_shape), (_, send_shape) = calls[0][1][:2]
                    assert recv_dtype == torch.float64 and recv_shape == (plan.n_recv, 2, 2, 8), recv_shape
                    assert send_shape == (plan.n_send, 2, 2, 8), send_shape
                    # bytes received = the plan's keys x one key's K and V bytes (float64)
                    assert int(np.prod(recv_shape)) * recv_dtype.itemsize == plan.n_recv * row_elems * 8
                assert _close(o, ref.index_select(2, idx)), (layout, long, path)
                with counting_collectives() as back:
                    (o * w.index_select(2, idx)).sum().backward()
                assert [n for n, _ in back] == ["batch_isend_irecv"] * moves and not (set(n for n, _ in back) & GATHERS)
                assert not moves or back[0][1][0][1] == (plan.n_send, 2, 2, 8)  # the gradients of the keys sent
                assert _close(lq.grad, dq.index_select(2, idx)), (layout, long, path)
                assert _close(lk.grad, dk.index_select(2, idx)), (layout, long, path)
                assert _close(lv.grad, dv.index_select(2, idx)), (layout, long, path)
                local_only = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
                out["differs"] += int(not _close(local_only, o))
                if path == "ctx":  # bidirectional: the plan holds each query's causal keys only, so all travel
                    with ContextParallelAttention(lay, None, document_ids=doc_local, cu_seqlens_padded=cu_rows):
                        both_ways = F.scaled_dot_product_attention(*(t.detach() for t in (lq, lk, lv)))
                    same_doc = torch.from_numpy(docs[:, None] == docs[None, :])
                    want = F.scaled_dot_product_attention(q, k, v, attn_mask=same_doc).index_select(2, idx)
                    assert _close(both_ways, want), (layout, long, "bidirectional")
                    out["bidirectional"] += 1
                out["checked"] += 1
            out["fewer"] += int(plan.n_recv < (cp - 1) * local)
            out["received"] += int(plan.n_recv > 0)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_through_the_exchange_equals_full_document_causal_attention(cp):
    results = run_ranks(_exchange_matches_full, cp, timeout=120)
    assert all(r["checked"] == 2 * 2 * len(CP_LAYOUTS) == 2 * r["bidirectional"] for r in results)
    assert sum(r["fewer"] for r in results) >= len(CP_LAYOUTS)  # the exchange moves less than an all-gather
    assert sum(r["received"] for r in results) >= 2 * len(CP_LAYOUTS)  # and something does move
    assert sum(r["differs"] for r in results) >= cp * len(CP_LAYOUTS)  # local-only attention is not the answer


def _digest(plan) -> str:
    h = hashlib.sha256()
    for a in (plan.starts, plan.lengths, plan.owners, plan.local_starts, plan.need):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def _pipeline_plans(rank: int, cp: int) -> dict:
    """Each rank's own pipeline: the plans agree across processes and send what the others receive."""
    g = torch.Generator().manual_seed(7)
    docs = [{"input_ids": torch.randint(1, 50, (int(n),), generator=g).tolist()}
            for n in torch.randint(3, 90, (40,), generator=g)]  # fmt: skip
    out = {"batches": 0, "moved": 0, "attended": 0, "windowed": 0}
    for layout, qkv, batch_size in (("balanced", "thd", 2), ("thd", "thd", 1), ("contiguous", "bshd", 2),
                                    ("round_robin", "bshd", 1)):  # fmt: skip
        kw = dict(capacity=128, cp_size=cp, layout=layout, overflow="split", batch_size=batch_size, qkv_format=qkv)
        mine = ShardForRank(shard_graph(docs, graph_options(**kw)), cp_size=cp, cp_rank=rank, layout=layout, kv_exchange=True)
        every = ShardForRank(shard_graph(docs, graph_options(**kw)), cp_size=cp, cp_rank=0, layout=layout, all_ranks=True)
        for batch, shards in zip(mine, every, strict=True):
            ex = batch.layout.kv_exchange
            assert ex.cp_rank == rank and ex.cp_size == cp
            rows = np.stack([s.layout.local_token_global_indices.numpy() for s in shards])
            n_rows = batch["document_ids"].shape[0] if qkv == "bshd" else 1
            cu = batch["cu_seqlens_padded"].numpy()
            ends = cu[:-1] + np.diff(batch["cu_seqlens"].numpy())  # pads need no keys
            here = exchange_plan(rows, cu[:-1], n_rows=n_rows, real_ends=ends)  # recomputed from the batch
            assert ex.recv_counts == here.rank(rank).recv_counts
            assert np.array_equal(ex.send_runs, here.rank(rank).send_runs)
            counts = torch.tensor([list(ex.send_counts), list(ex.recv_counts)], dtype=torch.int64)
            every_counts = [torch.empty_like(counts) for _ in range(cp)]
            dist.all_gather(every_counts, counts)
            sent = torch.stack([c[0] for c in every_counts])  # [src, dst]
            received = torch.stack([c[1] for c in every_counts])  # [dst, src]
            assert torch.equal(sent, received.T), (layout, sent, received)
            digest = torch.tensor(list(bytes.fromhex(_digest(here))), dtype=torch.uint8)
            digests = [torch.empty_like(digest) for _ in range(cp)]
            dist.all_gather(digests, digest)
            assert all(torch.equal(d, digest) for d in digests)
            if out["batches"] % 2 == 0:  # the batch as the sharder's ctx takes it: attention equals full
                out["windowed"] += _check_batch_attention(batch, shards, rows, rank, qkv)
                out["attended"] += 1
            out["batches"] += 1
            out["moved"] += int(sent.sum())
    return out


WINDOW = 5


def _check_batch_attention(batch, shards, rows: np.ndarray, rank: int, qkv: str) -> bool:
    n_rows = batch["document_ids"].shape[0] if qkv == "bshd" else 1
    s = rows.size
    docs = torch.empty(n_rows, s, dtype=torch.int64)
    pad = torch.empty(n_rows, s, dtype=torch.bool)
    for sh in shards:
        docs[:, sh.layout.local_token_global_indices] = sh["document_ids"].reshape(n_rows, -1)
        pad[:, sh.layout.local_token_global_indices] = sh["padding_mask"].reshape(n_rows, -1).bool()
    g = torch.Generator().manual_seed(s)
    q, k, v, w = (torch.randn(n_rows, 2, s, 4, generator=g, dtype=torch.float64) for _ in range(4))
    keep = torch.ones(s, s, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
    keep &= ~pad[:, :, None] | torch.eye(s, dtype=torch.bool)  # a pad query keeps its own key only
    q0, k0, v0 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q0, k0, v0, attn_mask=keep[:, None])
    (ref * w).sum().backward()
    idx = torch.from_numpy(rows[rank])
    lq, lk, lv = (t.index_select(2, idx).clone().requires_grad_() for t in (q, k, v))
    factory = AttentionContextFactory.of_batch(batch.layout, None, batch)  # what sharder.shard returns
    with counting_collectives() as calls, factory(document_mask=True):
        o = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True)
    assert {n for n, _ in calls} == {"batch_isend_irecv"}, calls  # K/V and (once) the document ids
    assert _close(o, ref.index_select(2, idx)) and not pad.all()  # pads too: the exchange leaves a pad its own key
    (o * w.index_select(2, idx)).sum().backward()
    for got, want in ((lq, q0), (lk, k0), (lv, v0)):
        assert _close(got.grad, want.grad.index_select(2, idx))
    # window= (a non-HF sliding-window model): the exchanged keys still serve it, the window is in the mask
    pos = torch.arange(s)
    near = keep & (pos[None, :, None] - pos[None, None, :] < WINDOW)
    ref_w = F.scaled_dot_product_attention(q, k, v, attn_mask=near[:, None]).index_select(2, idx)
    with counting_collectives() as calls, factory(document_mask=True, window=WINDOW):
        o_w = F.scaled_dot_product_attention(*(t.detach() for t in (lq, lk, lv)), is_causal=True)
    assert {n for n, _ in calls} == {"batch_isend_irecv"}, calls
    assert _close(o_w, ref_w)
    return not _close(o_w, o.detach())  # the window changed something (a pad-only tail pack may have nothing)


def test_pipeline_plans_are_deterministic_and_agree_across_processes():
    results = run_ranks(_pipeline_plans, 4, timeout=120)
    windowed = [r.pop("windowed") for r in results]  # per rank: the batches whose queries the window changed
    assert results[0]["batches"] >= 8 and all(r == results[0] for r in results)
    assert results[0]["moved"] > 0 and results[0]["attended"] >= 4 and min(windowed) >= 1, windowed
