"""The defaults of both CP attentions protect a user's slip, at cp 2 on gloo.

- The ``"cpdata"`` attention checks the CP layout by default: ranks fed different packs (a ``dp_rank``
  slip) are refused on every rank at the first attention call, instead of attending over a mix of two
  packs' K/V. ``register_hf_attention(verify_layout=False)`` is the explicit opt-out.
- The sharder's ctx is document-masked by default over a packed batch: a plain model's ``is_causal``
  SDPA equals each document alone (pads see only themselves). ``ctx(document_mask=False)`` is refused
  on a pack of several documents and allowed on a one-document pack, where it is causal over the row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.adapters.hf_attention import _LAST
from cpdata.device.batch_context import AttentionContextFactory
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.flat_options import graph_options
from tests.hf_zoo import build
from tests.test_hf_attention import full_pack
from tests.test_layout_check_dist import _outcome

LAYOUT = "balanced"


def _packs(cp: int, docs, n: int) -> list[tuple]:
    graph = shard_graph(docs, graph_options(capacity=64, cp_size=cp, layout=LAYOUT, overflow="split"))
    return [b for b, _ in zip(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=LAYOUT, all_ranks=True),
                              range(n), strict=False)]  # fmt: skip


def _layout_slip(rank: int, cp: int) -> dict:
    register_hf_attention()  # the default: verify_layout=True
    register_hf_attention("cpdata_unchecked", verify_layout=False)
    packs = _packs(cp, hf_zoo.docs(), 2)
    slip = packs[rank % 2][rank]  # rank 0 holds pack 0's shard, rank 1 pack 1's
    group = dist.group.WORLD
    out = {"digests_differ": packs[0][0].layout.digest != packs[1][0].layout.digest}
    for name in ("cpdata", "cpdata_unchecked"):
        model = build("llama", name)
        out[name] = _outcome(lambda m=model, n=name: m(**hf_model_kwargs(slip, n, group=group)))
        _LAST.state = None  # a refused step never consumed its state: the next name starts afresh
    return out


def test_the_cpdata_attention_refuses_ranks_fed_different_packs_by_default():
    results = run_ranks(_layout_slip, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["digests_differ"], "the two packs share a plan: the slip would not be visible"
        assert "CP ranks received different shard plans" in r["cpdata"], (rank, r["cpdata"])
        assert r["cpdata_unchecked"] == "ok", "the opt-out runs (over a mix of two packs' K/V)"


def _ctx_defaults(rank: int, cp: int) -> dict:
    group = dist.group.WORLD
    several = next(b for b in _packs(cp, hf_zoo.docs(), 8) if b[0].info["n_documents"] >= 3)
    one = _packs(cp, hf_zoo.docs([40]), 1)[0]
    out = {}
    for name, batches in (("several", several), ("one", one)):
        batch, full = batches[rank], full_pack(batches)
        size = full["input_ids"].numel()
        g = torch.Generator().manual_seed(size)
        q, k, v = (torch.randn(1, 2, size, 4, generator=g, dtype=torch.float64) for _ in range(3))
        i, doc, pad = torch.arange(size), full["document_ids"], full["padding_mask"].bool()
        causal = i[None, :] <= i[:, None]
        per_doc = causal & (doc[:, None] == doc[None, :]) & (~pad[:, None] | (i[:, None] == i[None, :]))
        pos = batch.layout.local_token_global_indices.reshape(-1)
        local = [t.index_select(2, pos) for t in (q, k, v)]
        factory = AttentionContextFactory.of_batch(batch.layout, group, batch)
        with factory():
            default = F.scaled_dot_product_attention(*local, is_causal=True)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=per_doc).index_select(2, pos)
        across = F.scaled_dot_product_attention(q, k, v, is_causal=True).index_select(2, pos)
        out[name] = {"default_is_per_document": torch.allclose(default, want, atol=1e-12),
                     "per_document_differs_from_causal": not torch.allclose(want, across, atol=1e-6)}  # fmt: skip

        def opt_out(f=factory, loc=local, ref=across):
            with f(document_mask=False):
                assert torch.allclose(F.scaled_dot_product_attention(*loc, is_causal=True), ref, atol=1e-12)

        out[name]["opt_out"] = _outcome(opt_out)
    return out


def test_the_ctx_is_document_masked_by_default_and_opting_out_needs_one_document():
    for rank, r in enumerate(run_ranks(_ctx_defaults, 2, timeout=120)):
        several, one = r["several"], r["one"]
        assert several["default_is_per_document"] and several["per_document_differs_from_causal"], (rank, several)
        assert "document_mask=False" in several["opt_out"] and "across documents" in several["opt_out"], several
        assert one["default_is_per_document"] and one["opt_out"] == "ok", (rank, one)
