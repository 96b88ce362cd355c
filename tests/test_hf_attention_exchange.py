"""The "cpdata" transformers attention over a K/V exchange plan at cp 2 and 4 on gloo.

Batches built with ``kv_exchange=True`` carry each rank's plan
(``layout.kv_exchange``); the attention then moves only the keys a rank's
documents need, one ``batch_isend_irecv`` per layer forward and one backward,
and no all-gather. Every family of tests/hf_zoo.py (sliding windows, softcap,
sinks, alternating layer types) runs on every layout, ``tiled`` included
(tile 64, packs of 128 / 256 tokens), and ``world`` (the ranks as nodes of 2:
at cp 4, keys cross "nodes"); each rank backpropagates its own loss,
the ranks' losses and gradients are summed and compared with every document
run alone through HF's own attention. The collectives are counted on the
way: all-to-alls per layer, none of the all-gather kind, and the K/V tokens
each rank receives equal its plan's ``n_recv`` per layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.bench.hf_reference import full_pack
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.hf_zoo import FAMILIES, build, error_against_alone
from tests.test_hf_attention_dist import _summed

LAYOUTS = ("contiguous", "round_robin", "thd", "balanced", "tiled", "world")
TILE = 64


def _pack(cp: int, rank: int, layout: str) -> tuple:
    """Every rank's batch (with its exchange plan) of the first pack holding at least three documents."""
    spec = {"tiled": f"tiled:{TILE}", "world": "world:2"}.get(layout, layout)
    graph = shard_graph(hf_zoo.docs(), GraphOptions(capacity=64 * cp, cp_size=cp, layout=spec, qkv_format="thd" if layout == "thd" else "bshd", plan=StreamPlan(overflow="split")))  # fmt: skip
    shards = ShardForRank(graph, cp_size=cp, cp_rank=rank, layout=spec, all_ranks=True, kv_exchange=True)
    for batches in shards:
        if batches[0].info["n_documents"] >= 3:
            return batches
    raise AssertionError("no pack with three documents")


class _Counted:
    """Counts the collectives the attention issues and the tokens it receives (patched on ``dist``)."""

    def __init__(self) -> None:
        self.received: list[int] = []  # tokens arriving, per batch_isend_irecv call
        self.gathers = 0
        self._saved = {}

    def __enter__(self) -> _Counted:
        swap = dist.batch_isend_irecv

        def batch_isend_irecv(ops):
            self.received.append(sum(op.tensor.shape[0] for op in ops if op.op.__name__ == "irecv"))
            return swap(ops)

        def refuse(name):
            def gathered(*args, **kwargs):
                self.gathers += 1
                raise AssertionError(f"{name} called with a K/V exchange plan")

            return gathered

        self._saved = {"batch_isend_irecv": swap}
        dist.batch_isend_irecv = batch_isend_irecv
        for name in ("all_gather", "all_gather_into_tensor"):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, refuse(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _rank(rank: int, world: int) -> list:
    register_hf_attention()
    group = dist.group.WORLD
    out = []
    for family in FAMILIES:
        model = build(family, "cpdata")
        layers = model.config.num_hidden_layers
        for layout in LAYOUTS:
            batches = _pack(world, rank, layout)
            batch = batches[rank]
            plan = batch.layout.kv_exchange
            n = int(sum(int((b["labels"] != -100).sum()) for b in batches))
            kwargs = hf_model_kwargs(batch, "cpdata", group=group, num_items_in_batch=n)
            model.zero_grad(set_to_none=True)
            with _Counted() as counted:
                loss, summed = _summed(model, kwargs)  # forward, backward, all-reduce of the gradients
            moves = layers if plan.n_recv or plan.n_send else 0  # a rank with no keys to move calls no one
            forward, backward = counted.received[:moves], counted.received[moves:]
            assert forward == [plan.n_recv] * moves, (family, layout, forward, plan.n_recv)
            assert backward == [plan.n_send] * moves and counted.gathers == 0, (family, layout, backward)
            fraction = plan.n_recv / ((world - 1) * batch["input_ids"].numel())
            if rank == 0:
                out.append((family, layout, loss, summed, full_pack(batches), fraction))
    out.append(("flex", *_flex_forward(world, rank, group)))
    return out if rank == 0 else []


def _flex_forward(world: int, rank: int, group) -> tuple[float, float]:
    """The flex kernel (eager on CPU, forward only) over the exchanged keys' ``BlockMask``: the dense loss."""
    register_hf_attention("cpdata_flex", kernel="flex")
    batch = _pack(world, rank, "tiled")[rank]
    model = build("mistral", "cpdata")
    n = hf_model_kwargs(batch, "cpdata", group=group)["num_items_in_batch"]
    losses = []
    for name in ("cpdata", "cpdata_flex"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            loss = model(**hf_model_kwargs(batch, name, group=group, num_items_in_batch=n)).loss.reshape(1)
        dist.all_reduce(loss)
        losses.append(loss.item())
    return losses[0], losses[1]


@pytest.mark.parametrize("cp", [2, 4])
def test_exchanged_keys_give_each_document_alone_with_one_swap_per_layer(cp):
    results = run_ranks(_rank, cp, timeout=600)[0]
    _, dense, flex = results.pop()
    assert abs(flex - dense) <= 1e-9 * abs(dense), (dense, flex)
    refs: dict[tuple, tuple] = {}
    worst: dict[str, float] = {}
    assert len(results) == len(FAMILIES) * len(LAYOUTS)
    for family, layout, loss, g, full, fraction in results:
        err, n_docs = error_against_alone(family, full, loss, g, refs)
        assert err < 1e-6 and n_docs >= 3, (family, layout, cp, err)
        assert 0 <= fraction <= 1, (family, layout, fraction)
        worst[family] = max(worst.get(family, 0.0), err)
    print(f"cp {cp}, exchange: max relative error per family over {list(LAYOUTS)}: "
          + ", ".join(f"{f} {e:.1e}" for f, e in worst.items()))  # fmt: skip
