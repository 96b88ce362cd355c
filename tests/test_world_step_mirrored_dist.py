"""A world step's mirrored placements (a spread document's THD roles counted down from its window's last rank,
:func:`cpdata.layout.world_owners.owner_ranks`) and uneven cuts (as :func:`cpdata.layout.spread.capped_chunks`
cuts past Megatron's width: roles' chunks of unequal lengths, an empty one) through the whole path on 4 gloo
ranks as 2 "nodes" x 2: the packer's owners, each rank's layout, the K/V exchange and the ``"cpdata"``
attention give, summed over the ranks, the loss and every gradient of each document run alone (every family of
tests/hf_zoo.py, < 1e-6 relative).

The deal widens past Megatron's width only inside a node of more than 4 ranks, which 4 gloo ranks cannot hold;
the uneven test cuts every spread document unevenly instead (the cut is a pure function of the slot length, its
ranks and the rank size, which is all the rest of the path reads), each role holding what TE THD's would: the
packer's deal is unchanged, only the chunks move."""

from __future__ import annotations

import numpy as np
import pytest

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.bench.hf_reference import full_pack
from cpdata.layout.maps import layout_spec
from cpdata.layout.world_plan import thd_chunks
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


def _first_pack(spread: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The index, slot lengths and owners of the first pack whose deal spreads a document over ``spread`` ranks or
    more (negative: mirrored, over ``-spread`` or more)."""
    plans = Pack(Documents(hf_zoo.docs()), capacity=CAPACITY, layout=LAYOUT, cp_size=CP, overflow="split",
                 world_step=STEP)  # fmt: skip
    for k, plan in enumerate(plans):
        if ((plan.owners[:, 1] <= spread) if spread < 0 else (plan.owners[:, 1] >= spread)).any():
            return k, plan.slot_lens, plan.owners
    raise AssertionError(f"no step of the zoo's documents spreads a document over {spread} ranks")


def _uneven(s: int, c: int, local: int, node_size: int) -> tuple[int, ...]:
    """TE THD's chunks with half of the first role's back chunk moved to its front chunk and the last role's two
    chunks joined into its first (the second empty): every role holds what THD's does."""
    chunk = list(thd_chunks(s, c))
    moved = chunk[-1] // 2
    chunk[0], chunk[-1] = chunk[0] + moved, chunk[-1] - moved
    chunk[c - 1], chunk[c] = chunk[c - 1] + chunk[c], 0
    return tuple(chunk)


def _cut_unevenly(set_attr=setattr) -> None:
    """Every spread document cut by :func:`_uneven` (``set_attr``: the test's ``monkeypatch.setattr``)."""
    from cpdata.layout import spread, world_owners

    set_attr(spread, "spread_chunks", _uneven)
    set_attr(world_owners, "spread_chunks", _uneven)
    world_owners.role_costs.cache_clear()


def _rank(rank: int, world: int, spread: int, uneven: bool) -> list:
    import torch.distributed as dist

    if uneven:
        _cut_unevenly()
    register_hf_attention()
    k, _, _ = _first_pack(spread)
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


def _like_each_document_alone(out: list, full: object) -> None:
    cache: dict = {}
    for family, loss, grad in out:
        err, n_docs = error_against_alone(family, full, loss, grad, cache)
        assert err < 1e-6 and n_docs >= 2, (family, err, n_docs)
    assert len(out) == len(FAMILIES)


def test_a_mirrored_spread_document_trains_like_each_document_alone():
    k, lens, owners = _first_pack(-2)
    results = run_ranks(_rank, CP, -2, False, timeout=600)
    held, recv = zip(*(r[0] for r in results), strict=True)
    _, out, full = results[0]
    # the mirrored document's first and last chunks (THD's first role) are on the window's last rank
    d = int(np.flatnonzero(owners[:, 1] < -1)[0])
    first, c = owners[d].tolist()
    start, end = int(lens[:d].sum()), int(lens[: d + 1].sum()) - 1
    assert [r for r in range(CP) if start in held[r]] == [first] and end in held[first], (first, c)
    assert first + c + 1 >= 0 and recv[first] > 0  # (its first role lacks the middle chunks: the exchange moved them)
    _like_each_document_alone(out, full)


def test_an_unevenly_cut_spread_document_trains_like_each_document_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpdata.layout import world_owners
    from cpdata.layout.world_owners import owner_ranks

    _cut_unevenly(monkeypatch.setattr)
    try:
        k, lens, owners = _first_pack(3)
        results = run_ranks(_rank, CP, 3, True, timeout=600)
    finally:
        monkeypatch.undo()
        world_owners.role_costs.cache_clear()
    held = [set(r[0][0]) for r in results]
    _, out, full = results[0]
    # the chunks are where the uneven cut puts them: the first role's front chunk, longer than THD's, on the
    # first rank; the last role's whole share one run on the last
    d = int(np.flatnonzero(owners[:, 1] >= 3)[0])
    (first, c), s, start = owners[d].tolist(), int(lens[d]), int(lens[:d].sum())
    chunk = _uneven(s, c, CAPACITY // CP, 2)
    ranks, ends = list(owner_ranks(first, c)), np.cumsum(chunk)
    assert chunk[0] > thd_chunks(s, c)[0] and chunk[c] == 0
    assert set(range(start, start + chunk[0])) <= held[ranks[0]] and start + chunk[0] not in held[ranks[0]]
    last = set(range(start + ends[c - 2], start + ends[c - 1]))
    assert last <= held[ranks[-1]] and len(last) == chunk[c - 1]
    _like_each_document_alone(out, full)
