"""build_loader end to end: every document token arrives once, CP ranks agree, resume is exact."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from state_contract import assert_items_equal, run_save_load_contract
from torchdata.nodes import IterableWrapper

from cpdata.nodes.loader import (
    GraphOptions,
    build_loader,
    build_node,
    close_loader,
    closing_loader,
    shard_graph,
)
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.nodes.shard import ShardForRank
from cpdata.worker.batch import ShardedBatch

CONFIG = {"capacity": 64, "cp_size": 2, "layout": "thd", "plan": StreamPlan(algorithm="bfd"), "data": DataPolicy(seed=3)}


def documents(n: int = 40, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 1000, size=int(rng.integers(3, 30)), dtype=np.int64)} for _ in range(n)]


def digests(batches) -> list[int]:
    return [b.info["digest"] for b in batches]


def real_tokens(shards: tuple[ShardedBatch, ...]) -> list[np.ndarray]:
    """The documents' pieces of one batch, reassembled from every rank's shard."""
    gather = shards[0].layout.gather_index
    ids = torch.cat([s["input_ids"] for s in shards], dim=-1)[..., gather].reshape(-1).numpy()
    pad = torch.cat([s["padding_mask"] for s in shards], dim=-1)[..., gather].reshape(-1).numpy()
    cu = shards[0]["cu_seqlens_padded"].numpy()
    lens = shards[0]["seq_lens"].numpy()
    assert not pad[np.concatenate([np.arange(c, c + n) for c, n in zip(cu[:-1], lens, strict=True)])].any()
    return [ids[c : c + n] for c, n in zip(cu[:-1], lens, strict=True) if n]


@pytest.mark.parametrize(("layout", "cp_size", "qkv_format", "batch_size"),
                         [("thd", 2, "bshd", 1), ("balanced", 4, "thd", 2), ("round_robin", 2, "bshd", 2)])  # fmt: skip
def test_every_token_arrives_once_and_ranks_agree(layout, cp_size, qkv_format, batch_size):
    docs = documents()
    kw = dict(capacity=64, cp_size=cp_size, layout=layout, qkv_format=qkv_format, batch_size=batch_size,
              delivery=Delivery(prefetch=2))
    per_rank = []
    for r in range(cp_size):
        with closing_loader(build_loader(docs, cp_rank=r, **kw)) as loader:
            per_rank.append(list(loader))
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) > 3
    assert all(digests(b) == digests(per_rank[0]) for b in per_rank)
    pieces = []
    for shards in zip(*per_rank, strict=True):
        assert [s.layout.cp_rank for s in shards] == list(range(cp_size))
        pieces += real_tokens(shards)
    got = sorted(tuple(p.tolist()) for p in pieces)
    assert got == sorted(tuple(d["input_ids"].tolist()) for d in docs)


def test_node_and_all_ranks_agree():
    docs = documents()
    every = list(ShardForRank(shard_graph(docs, GraphOptions(**CONFIG)), cp_size=2, cp_rank=0, layout="thd", all_ranks=True))
    node = build_node(docs, cp_rank=1, delivery=Delivery(pin_memory=False, prefetch=0), **CONFIG)
    for one, both in zip(node, every, strict=True):
        assert all(torch.equal(one[k], both[1][k]) for k in one)


def run_loader(loader, n: int | None = None) -> list[int]:
    it = iter(loader)
    return [b.info["digest"] for _, b in zip(range(n), it, strict=False)] if n is not None else digests(it)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_at_midpoints_and_across_epochs(prefetch):
    docs = documents(30)
    make = lambda: build_loader(docs, cp_rank=0, delivery=Delivery(prefetch=prefetch), **CONFIG)  # noqa: E731
    with closing_loader(make()) as loader:
        epoch = run_loader(loader)
        second = run_loader(loader)  # restart_on_stop_iteration: a new epoch
    n = len(epoch)
    assert n >= 5 and second == epoch
    for mid in (0, 1, n // 2, n - 1, n):
        with closing_loader(make()) as loader:
            it = iter(loader)
            head = [next(it).info["digest"] for _ in range(mid)]
            state = loader.state_dict()
            tail = digests(it)
            next_epoch = run_loader(loader, 2)
        assert head + tail == epoch
        with closing_loader(make()) as resumed:
            resumed.load_state_dict(state)
            got = run_loader(resumed)
            if mid == n:  # saved at the end of an epoch: the restored loader starts the next one
                assert got == epoch
            else:
                assert got == tail
                assert run_loader(resumed, 2) == next_epoch


def test_state_dict_before_load_does_not_swallow_the_restore():
    # torch.distributed.checkpoint calls state_dict() on a fresh loader before load_state_dict().
    docs = documents(30)
    make = lambda: build_loader(docs, cp_rank=0, delivery=Delivery(prefetch=0), **CONFIG)  # noqa: E731
    with closing_loader(make()) as loader:
        epoch = run_loader(loader)
        it = iter(loader)
        head = [next(it).info["digest"] for _ in range(3)]
        state = loader.state_dict()
    with closing_loader(make()) as resumed:
        resumed.state_dict()
        resumed.load_state_dict(state)
        assert run_loader(resumed) == epoch[3:]
        assert run_loader(resumed) == epoch  # the next epoch starts at its beginning
    assert head == epoch[:3]


def test_resume_inside_second_epoch():
    docs = documents(30)
    make = lambda: build_loader(docs, cp_rank=1, **CONFIG)  # noqa: E731
    with closing_loader(make()) as loader:
        run_loader(loader)
        it = iter(loader)
        first = [next(it).info["digest"] for _ in range(2)]
        state = loader.state_dict()
        rest = digests(it)
    with closing_loader(make()) as resumed:
        resumed.load_state_dict(state)
        assert run_loader(resumed) == rest
    assert len(first) == 2 and rest


@pytest.mark.parametrize(("change", "match"), [
    ({"cp_size": 4}, "cp_size"), ({"layout": "balanced"}, "layout"), ({"batch_size": 2, "qkv_format": "thd"}, "batch_size"),
    ({"capacity": 128}, "capacity"),
])  # fmt: skip
def test_refuses_state_from_another_configuration(change, match):
    docs = documents(20)
    with closing_loader(build_loader(docs, cp_rank=0, **CONFIG)) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with closing_loader(build_loader(docs, cp_rank=0, **{**CONFIG, **change})) as other:
        other.load_state_dict(state)
        with pytest.raises(ValueError, match=match):
            next(iter(other))


def test_close_stops_threads():
    gc.collect()
    before = threading.active_count()
    loader = build_loader(documents(20), cp_rank=0, delivery=Delivery(prefetch=4), **CONFIG)
    it = iter(loader)
    next(it)
    assert threading.active_count() > before  # the prefetch thread runs
    close_loader(loader)
    close_loader(loader)  # idempotent
    assert threading.active_count() == before
    assert len(run_loader(loader)) > 1  # usable again: a fresh epoch
    close_loader(loader)
    assert threading.active_count() == before


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
def test_split_documents_keep_targets_inside_documents(algorithm):
    """Documents cut across packs: one -100 target per document end, every other target the next token."""
    rng = np.random.default_rng(7)
    docs = [{"input_ids": rng.integers(1, 1000, size=int(rng.integers(3, 150)), dtype=np.int64)} for _ in range(30)]
    assert any(len(d["input_ids"]) > 64 for d in docs)
    collated = list(shard_graph(docs, GraphOptions(**{**CONFIG, "plan": StreamPlan(algorithm=algorithm, overflow="split")})))
    batches = list(ShardForRank(IterableWrapper(collated), cp_size=2, cp_rank=0, layout="thd", all_ranks=True))
    by_doc: dict[int, dict[int, tuple[int, int]]] = {}
    continued = 0
    for shards, batch in zip(batches, collated, strict=True):
        gather = shards[0].layout.gather_index
        whole = {k: torch.cat([s[k] for s in shards], dim=-1)[..., gather].reshape(-1).numpy()
                 for k in ("input_ids", "labels", "position_ids", "padding_mask", "document_ids")}  # fmt: skip
        real = ~whole["padding_mask"]
        for slot, index in enumerate(p.index for p in batch.plans[0].pieces):
            mine = real & (whole["document_ids"] == slot)
            continued += int(whole["position_ids"][mine][0] > 0)
            for pos, tok, lab in zip(whole["position_ids"][mine], whole["input_ids"][mine], whole["labels"][mine],
                                     strict=True):  # fmt: skip
                by_doc.setdefault(index, {})[int(pos)] = (int(tok), int(lab))
    assert continued > 0  # some piece starts inside its document
    assert sorted(by_doc) == list(range(len(docs)))
    for index, tokens in by_doc.items():
        ids = docs[index]["input_ids"]
        assert sorted(tokens) == list(range(len(ids)))
        assert [tokens[p][0] for p in range(len(ids))] == ids.tolist()
        assert [tokens[p][1] for p in range(len(ids))] == [*ids[1:].tolist(), -100]


def compare_batches(actual, expected) -> None:
    """Tensors, layout and info of ShardedBatches (or tuples of them), bit for bit."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            compare_batches(a, e)
        return
    assert isinstance(actual, ShardedBatch)
    assert_items_equal(dict(actual), dict(expected), "tensors")
    assert_items_equal(actual.layout, expected.layout, "layout")
    assert_items_equal(actual.info, expected.info, "info")


GRAPHS = {
    "collate": lambda docs: shard_graph(docs, GraphOptions(**CONFIG)),
    "shard": lambda docs: ShardForRank(shard_graph(docs, GraphOptions(**CONFIG)), cp_size=2, cp_rank=1, layout="thd"),
    "all_ranks_thd_b2": lambda docs: ShardForRank(shard_graph(docs, GraphOptions(**{**CONFIG, "batch_size": 2, "qkv_format": "thd"})),
                                                  cp_size=2, cp_rank=0, layout="thd", all_ranks=True),
    "build_node_prefetch": lambda docs: build_node(docs, cp_rank=0, delivery=Delivery(prefetch=2, pin_memory=False), **CONFIG),
}  # fmt: skip


@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_nodes_meet_the_state_contract(graph):
    docs = documents(24)
    make = GRAPHS[graph]
    n = sum(1 for _ in make(docs))
    assert n >= 4
    compare = assert_items_equal if graph == "collate" else compare_batches
    nodes = []

    def make_node():
        nodes.append(make(docs))
        return nodes[-1]

    try:
        run_save_load_contract(make_node, [0, 1, n // 2, n - 1, n, n + 2], compare, epochs=2,
                               round_trips=("pickle", "torch"))  # fmt: skip
    finally:
        for node in nodes:  # stop prefetch threads now rather than at garbage collection
            shutdown = getattr(getattr(node, "_it", None), "_shutdown", None)
            if shutdown:
                shutdown()
