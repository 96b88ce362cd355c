"""The "cpdata" transformers attention at cp 2 and 4 on gloo: losses and gradients summed over ranks = each document alone.

One spawn per cp size runs every family of tests/hf_zoo.py on every layout
(contiguous, round_robin, thd, balanced). Each rank runs its own shard
through ``model(**hf_model_kwargs(batch, "cpdata", group=...))`` WITHOUT
``num_items_in_batch`` (hf_model_kwargs fills in the pack's target count the
worker recorded, ``batch.info["n_targets"]``, checked against
``global_target_count``'s all-reduce), backpropagates its own loss, and the ranks' losses and
parameter gradients are summed; rank 0 hands the sums and the whole pack
back and this process compares them with every document run alone (HF's own
attention, references shared by the layouts whose packs hold the same tokens).
At cp 2 the rank function also checks the sharder's ctx: entering it around
"cpdata" changes nothing, HF sdpa inside it honours a uniform window given
``config=``, and a model whose attention never calls SDPA makes leaving it raise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpdata.adapters import global_target_count, hf_model_kwargs, register_hf_attention
from cpdata.device.cp_attention import ContextParallelAttention
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.hf_zoo import FAMILIES, alone_reference, build, grads, max_rel_error
from tests.test_hf_attention import full_pack

LAYOUTS = ("contiguous", "round_robin", "thd", "balanced")
_REF: dict[tuple, tuple] = {}


def _pack(cp: int, rank: int, layout: str) -> tuple:
    """Every rank's batch of the first pack holding at least three documents (built in-process, no collective)."""
    graph = shard_graph(hf_zoo.docs(), GraphOptions(capacity=32, cp_size=cp, layout=layout, qkv_format="thd" if layout == "thd" else "bshd", plan=StreamPlan(overflow="split")))  # fmt: skip
    for batches in ShardForRank(graph, cp_size=cp, cp_rank=rank, layout=layout, all_ranks=True):
        if batches[0].info["n_documents"] >= 3:
            return batches
    raise AssertionError("no pack with three documents")


def _summed(model, kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    """This rank's loss and gradients, summed over the CP group (one all-reduce of the flat gradient)."""
    loss = model(**kwargs).loss
    loss.backward()
    g = grads(model)
    flat = torch.cat([t.reshape(-1) for t in g.values()] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    out, at = {}, 0
    for name, t in g.items():
        out[name], at = flat[at : at + t.numel()].view_as(t), at + t.numel()
    return flat[-1].item(), out


def _rank(rank: int, world: int) -> list:
    register_hf_attention()
    group = dist.group.WORLD
    out = []
    for family in FAMILIES:
        model = build(family, "cpdata")
        for layout in LAYOUTS:
            batches = _pack(world, rank, layout)
            batch = batches[rank]
            kwargs = hf_model_kwargs(batch, "cpdata", group=group)  # no num_items_in_batch: filled in
            assert int(kwargs["num_items_in_batch"]) == int(global_target_count(batch, group))
            loss, g = _summed(model, kwargs)
            if rank == 0:
                out.append((family, layout, loss, g, full_pack(batches)))
    if world == 2:
        out.append(_ctx_checks(rank, world, group))
    return out if rank == 0 else []


def _ctx_checks(rank: int, world: int, group) -> tuple:
    batches = _pack(world, rank, "balanced")
    batch = batches[rank]
    model = build("mistral", "cpdata")
    alone = model(**hf_model_kwargs(batch, "cpdata", group=group)).loss
    with ContextParallelAttention(batch.layout, group, document_ids=batch["document_ids"],
                                  cu_seqlens_padded=batch["cu_seqlens_padded"]) as ctx:  # fmt: skip
        inside = model(**hf_model_kwargs(batch, "cpdata", group=group)).loss
    assert torch.equal(alone, inside) and ctx.served == model.config.num_hidden_layers
    sdpa = build("mistral", "sdpa")
    n = global_target_count(batch, group)
    with ContextParallelAttention(batch.layout, group):
        in_ctx, g = _summed(sdpa, hf_model_kwargs(batch, "sdpa", config=sdpa, num_items_in_batch=n))
    eager = build("llama", "eager")
    try:
        with ContextParallelAttention(batch.layout, group):
            eager(input_ids=batch["input_ids"].reshape(1, -1), use_cache=False)  # local-only attention
    except ValueError as e:
        bypass = str(e)
    else:
        bypass = ""
    window = _ctx_window(batch, full_pack(batches), group)
    return ("ctx", in_ctx, g, full_pack(batches), bypass, window)


def _ctx_window(batch, full, group) -> float:
    """The ctx's window= (non-HF models): local SDPA calls equal full attention with a sliding-window mask."""
    import torch.nn.functional as F

    size = full["document_ids"].numel()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, size, 4, generator=g, dtype=torch.float64) for _ in range(3))
    pos = batch.layout.local_token_global_indices.reshape(-1)
    doc = full["document_ids"]
    i = torch.arange(size)
    keep = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).index_select(2, pos)
    with ContextParallelAttention(batch.layout, group, document_ids=batch["document_ids"].reshape(1, -1),
                                  cu_seqlens_padded=batch["cu_seqlens_padded"], window=3) as ctx:  # fmt: skip
        out = F.scaled_dot_product_attention(*(t.index_select(2, pos) for t in (q, k, v)), is_causal=True)
    assert ctx.served == 1
    return (out - ref).abs().max().item()


def _check(results: list, cp: int) -> dict[str, float]:
    worst: dict[str, float] = {}
    for family, layout, loss, g, full in [r for r in results if r[0] != "ctx"]:
        key = (family, tuple(full["input_ids"].tolist()), tuple(full["padding_mask"].tolist()))
        if key not in _REF:
            _REF[key] = alone_reference(build(family, "eager"), full)
        ref_loss, ref_grad, n_docs = _REF[key]
        err = max_rel_error(loss, g, ref_loss, ref_grad)
        assert err < 1e-6 and n_docs >= 3, (family, layout, cp, err)
        worst[family] = max(worst.get(family, 0.0), err)
    assert len(worst) == len(FAMILIES)
    print(f"cp {cp}: max relative error per family over {list(LAYOUTS)}: "
          + ", ".join(f"{f} {e:.1e}" for f, e in worst.items()))  # fmt: skip
    return worst


@pytest.mark.parametrize("cp", [2, 4])
def test_losses_and_gradients_summed_over_ranks_equal_each_document_alone(cp):
    results = run_ranks(_rank, cp, timeout=600)[0]
    _check(results, cp)
    if cp == 2:
        _, loss, g, full, bypass, window = results[-1]
        key = ("mistral", tuple(full["input_ids"].tolist()), tuple(full["padding_mask"].tolist()))
        if key not in _REF:
            _REF[key] = alone_reference(build("mistral", "eager"), full)
        assert max_rel_error(loss, g, *_REF[key][:2]) < 1e-6, "HF sdpa in the ctx, masks with the window"
        assert "does not call" in bypass and "'cpdata'" in bypass
        assert window < 1e-12, "the ctx's window= at cp 2"
