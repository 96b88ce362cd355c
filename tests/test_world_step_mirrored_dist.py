"""A world step's mirrored placements (a spread document's THD roles counted down from its window's last rank,
:func:`cpdata.layout.world_step.owner_ranks`) through the whole path on 4 gloo ranks as 2 "nodes" x 2: the
packer's owners, each rank's layout, the K/V exchange and the ``"cpdata"`` attention give, summed over the
ranks, the loss and every gradient of each document run alone (every family of tests/hf_zoo.py, < 1e-6
relative)."""

from __future__ import annotations

import numpy as np

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.bench.hf_reference import full_pack
from cpdata.layout.maps import layout_spec
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.pack import Pack
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.source import Documents
from tests import hf_zoo
from tests.dist_utils import run_ranks
from tests.hf_zoo import FAMILIES, build, error_against_alone
from tests.test_hf_attention_dist import _summed

CP, CAPACITY, STEP = 4, 64, 2
LAYOUT = layout_spec("world", node_size=2)


def _mirrored_pack() -> tuple[int, np.ndarray, np.ndarray]:
    """The index, slot lengths and owners of the first pack whose deal mirrors a spread document."""
    plans = Pack(Documents(hf_zoo.docs()), capacity=CAPACITY, layout=LAYOUT, cp_size=CP, overflow="split",
                 world_step=STEP)  # fmt: skip
    for k, plan in enumerate(plans):
        if (plan.owners[:, 1] < -1).any():
            return k, plan.slot_lens, plan.owners
    raise AssertionError("no step of the zoo's documents mirrors a spread document")


def _rank(rank: int, world: int) -> list:
    import torch.distributed as dist

    register_hf_attention()
    k, _, _ = _mirrored_pack()
    graph = shard_graph(hf_zoo.docs(), GraphOptions(capacity=CAPACITY, cp_size=CP, layout=LAYOUT,
                                                    plan=StreamPlan(overflow="split", world_step=STEP)))  # fmt: skip
    shards = ShardForRank(graph, cp_size=CP, cp_rank=rank, layout=LAYOUT, all_ranks=True, kv_exchange=True)
    batches = next(b for i, b in enumerate(shards) if i == k)
    batch = batches[rank]
    out = []
    for family in FAMILIES:
        loss, grad = _summed(build(family, "cpdata"), hf_model_kwargs(batch, "cpdata", group=dist.group.WORLD))
        out.append((family, loss, grad))
    held = (batch.layout.local_token_global_indices.reshape(-1).tolist(), int(batch.layout.kv_exchange.n_recv))
    return [held, out, full_pack(batches)] if rank == 0 else [held]


def test_a_mirrored_spread_document_trains_like_each_document_alone():
    k, lens, owners = _mirrored_pack()
    results = run_ranks(_rank, CP, timeout=600)
    held, recv = zip(*(r[0] for r in results), strict=True)
    _, out, full = results[0]
    # the mirrored document's first and last chunks (THD's first role) are on the window's last rank
    d = int(np.flatnonzero(owners[:, 1] < -1)[0])
    first, c = owners[d].tolist()
    start, end = int(lens[:d].sum()), int(lens[: d + 1].sum()) - 1
    assert [r for r in range(CP) if start in held[r]] == [first] and end in held[first], (first, c)
    assert first + c + 1 >= 0 and recv[first] > 0  # (its first role lacks the middle chunks: the exchange moved them)
    cache: dict = {}
    for family, loss, grad in out:
        err, n_docs = error_against_alone(family, full, loss, grad, cache)
        assert err < 1e-6 and n_docs >= 2, (family, err, n_docs)
    assert len(out) == len(FAMILIES)
