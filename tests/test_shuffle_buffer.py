"""shuffle=True over streams (re-iterables, nodes): a buffer shuffle from (seed, epoch) with exact resume."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from state_contract import run_save_load_contract
from torchdata.nodes import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import CPDataset, Documents, build_loader, closing_loader
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.nodes.shuffle_buffer import ShuffleBuffer
from tests.flat_options import records


def _docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 100, int(rng.integers(1, 30)))} for _ in range(n)]


class Stream:
    """A re-iterable (no len, no indexing)."""

    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def _indices(node) -> list[int]:
    node.reset()
    return [d.index for d in node]


def test_a_stream_is_shuffled_per_epoch_from_seed_and_epoch():
    docs = _docs(200)
    node = Documents(Stream(docs), shuffle=True, seed=7, shuffle_buffer=32)
    first, second = _indices(node), _indices(node)
    assert sorted(first) == sorted(second) == list(range(200)), "every document once per epoch"
    assert first != list(range(200)) and first != second
    again = Documents(Stream(docs), shuffle=True, seed=7, shuffle_buffer=32)
    assert [_indices(again), _indices(again)] == [first, second], "a pure function of (seed, epoch)"
    assert _indices(Documents(Stream(docs), shuffle=True, seed=8, shuffle_buffer=32)) != first
    assert _indices(Documents(Stream(docs), shuffle=True, seed=7, shuffle_buffer=1)) == list(range(200))
    # a buffer of b keeps every document within reach: it leaves after at most b - 1 others entered after it
    assert all(i - pos < 32 for pos, i in enumerate(first))
    # the default buffer (10,000) holds the whole 200-document stream: a full permutation
    full = _indices(Documents(Stream(docs), shuffle=True, seed=7))
    assert sorted(full) == list(range(200)) and max(abs(i - p) for p, i in enumerate(full)) > 100


def test_dp_ranks_shuffle_their_own_share_and_cp_peers_agree():
    docs = _docs(90)
    shards = [_indices(Documents(Stream(docs), shuffle=True, seed=3, dp_rank=r, dp_size=3, shuffle_buffer=8))
              for r in range(3)]  # fmt: skip
    for r, shard in enumerate(shards):
        assert sorted(shard) == list(range(r, 90, 3)) and shard != sorted(shard)
    # each rank's own draws: as positions in its share's arrival order, the three shuffles differ
    arrival = [[(i - r) // 3 for i in shard] for r, shard in enumerate(shards)]
    assert len({tuple(a) for a in arrival}) == 3, "DP ranks drew the same buffer slots"
    digests = []
    for cp_rank in range(2):
        with closing_loader(build_loader(Stream(docs), capacity=64, cp_size=2, cp_rank=cp_rank, layout="balanced", plan=StreamPlan(shuffle_buffer=16), data=DataPolicy(shuffle=True, seed=9), delivery=Delivery(prefetch=0))) as loader:  # fmt: skip
            digests.append([b.layout.digest for b in loader])
    assert digests[0] == digests[1] and len(digests[0]) > 3


def test_the_buffer_drains_in_random_order_and_replays():
    buf = ShuffleBuffer(4, seed=1)
    buf.start(0)
    stream = iter(range(10))
    out = [buf.next(lambda: next(stream)) for _ in range(10)]
    assert sorted(out) == list(range(10)) and out != list(range(10))
    with pytest.raises(StopIteration):
        buf.next(lambda: next(stream))
    stream = iter(range(10))
    buf.replay(0, 6, lambda: next(stream))
    assert [buf.next(lambda: next(stream)) for _ in range(4)] == out[6:]
    with pytest.raises(ValueError, match="the stream ends after 3"):
        short = iter(range(3))
        buf.replay(0, 5, lambda: next(short))


@pytest.mark.parametrize("kind", ["iterable", "node"])
def test_documents_save_load_contract_with_a_buffer(kind):
    docs = _docs(40)

    def make():
        source = Stream(docs) if kind == "iterable" else IterableWrapper(Stream(docs))
        return Documents(source, shuffle=True, seed=5, shuffle_buffer=8, dp_rank=1, dp_size=2)

    run_save_load_contract(make, midpoints=[0, 1, 7, 19, 20, 33], epochs=2)


def _clone(batch):
    return {k: v.clone() for k, v in batch.items()}


@pytest.mark.parametrize("cut", [0, 4])
def test_loader_resume_mid_epoch_is_bit_identical(cut):
    docs = _docs(120)
    kw = dict(capacity=64, cp_size=2, cp_rank=1, layout="thd", shuffle=True, seed=3, shuffle_buffer=24, prefetch=0)
    with closing_loader(build_loader(Stream(docs), **records(**kw))) as loader:
        list(loader)
        it = iter(loader)  # epoch 1
        for _ in range(cut + 2):
            next(it)
        state = loader.state_dict()
        tail = [_clone(b) for b in it]
    with closing_loader(build_loader(Stream(docs), **records(**kw))) as restored:
        restored.load_state_dict(state)
        again = [_clone(b) for b in restored]
    assert len(again) == len(tail) > 0
    for a, b in zip(again, tail, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    with closing_loader(build_loader(Stream(docs), **records(**{**kw, "shuffle_buffer": 25}))) as other:
        other.load_state_dict(state)
        with pytest.raises(ValueError, match=r"shuffle_buffer\)=\(True, 3, None, 24\).*\(True, 3, None, 25\)"):
            next(iter(other))
    with closing_loader(build_loader(Stream(docs[:50]), **records(**kw))) as shorter:
        shorter.load_state_dict(state)
        with pytest.raises(ValueError, match="restore onto the same source|source changed"):
            next(iter(shorter))


def test_stateful_dataloader_workers_resume_a_buffered_stream_exactly():
    docs = _docs(120)
    kw = dict(capacity=64, cp_size=1, layout="identity", shuffle=True, seed=2, shuffle_buffer=16)

    def loader():
        return StatefulDataLoader(CPDataset(Stream(docs), **records(cp_rank=0, **kw)), batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")  # fmt: skip

    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    tail = [_clone(b) for b in it]
    second = loader()
    second.load_state_dict(state)
    again = [_clone(b) for b in second]
    assert len(again) == len(tail) > 2
    assert all(torch.equal(a[k], b[k]) for a, b in zip(again, tail, strict=True) for k in a)


def test_shuffle_buffer_is_checked():
    for bad in (0, -1, 2.5, True, "big"):
        with pytest.raises(ValueError, match=rf"^shuffle_buffer must be an int >= 1, got (\w+ )?{re.escape(repr(bad))} "
                                             r"\(documents held to shuffle a stream\); the default is 10000$"):
            Documents(Stream(_docs(3)), shuffle=True, shuffle_buffer=bad)
