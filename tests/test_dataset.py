"""CPDataset under StatefulDataLoader: worker count never changes the order; resume is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_loader import CONFIG, documents
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import Delivery
from cpdata.nodes.shard import ShardForRank
from cpdata.worker.batch import ShardedBatch

CFG = {**CONFIG, "batch_size": 2, "qkv_format": "thd"}


def _odd_stream() -> list[dict[str, np.ndarray]]:
    """Documents giving an odd number of batches, so two workers end unevenly."""
    for n in range(36, 60):
        docs = documents(n)
        if len(list(shard_graph(docs, GraphOptions(**CFG)))) % 2:
            return docs
    raise AssertionError("no document count in 36..59 gives an odd number of batches")


DOCS = _odd_stream()
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")


def make_loader(num_workers: int, cp_rank: int = 0, prefetch: int = 0) -> StatefulDataLoader:
    ds = CPDataset(DOCS, cp_rank=cp_rank, delivery=Delivery(prefetch=prefetch), **CFG)
    extra = {"multiprocessing_context": "fork"} if num_workers else {}
    return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers, **extra)


@pytest.fixture(scope="module")
def reference() -> list[tuple[ShardedBatch, ...]]:
    """Every rank's batches from one process: the order any worker count must reproduce."""
    return list(ShardForRank(shard_graph(DOCS, GraphOptions(**CFG)), cp_size=2, cp_rank=0, layout="thd", all_ranks=True))


def digests(batches) -> list[int]:
    return [b.info["digest"] for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_order_matches_the_single_process_stream(num_workers, reference):
    got = list(make_loader(num_workers))
    assert len(got) == len(reference) >= 5 and len(reference) % 2 == 1  # workers end unevenly
    for batch, shards in zip(got, reference, strict=True):
        assert isinstance(batch, ShardedBatch) and batch.layout.cp_rank == 0
        assert batch.info == shards[0].info
        assert all(torch.equal(batch[k], shards[0][k]) for k in batch)
        assert torch.equal(batch.layout.gather_index, shards[0].layout.gather_index)
    assert digests(make_loader(num_workers)) == digests(got)  # a second epoch/loader: same order
    assert all(b._buffer is not None for b in got)  # the single buffer survives default_convert and pickling


def test_dataset_state_dict_before_load_does_not_swallow_the_restore(reference):
    ds = CPDataset(DOCS, cp_rank=0, **CFG)
    it = iter(ds)
    head = [next(it).info["digest"] for _ in range(2)]
    state = ds.state_dict()
    fresh = CPDataset(DOCS, cp_rank=0, **CFG)
    fresh.state_dict()
    fresh.load_state_dict(state)
    assert head + [b.info["digest"] for b in fresh] == [s[0].info["digest"] for s in reference]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_forgetting_batch_size_none_fails_loudly(num_workers):
    # default_collate would stack [1, ...] tensors; a silent fallback to a plain dict would lose the layout.
    extra = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = StatefulDataLoader(CPDataset(DOCS, cp_rank=0, **CFG), batch_size=1, num_workers=num_workers, **extra)
    with pytest.raises(ValueError, match="batch_size=None"):
        next(iter(loader))


@pytest.mark.parametrize(("num_workers", "prefetch"), [(0, 0), (2, 0), (2, 2)])
def test_exact_resume_at_midpoints(num_workers, prefetch, reference):
    want = digests(s[0] for s in reference)
    for mid in (1, 2, len(want) - 2):
        loader = make_loader(num_workers, prefetch=prefetch)
        it = iter(loader)
        head = [next(it).info["digest"] for _ in range(mid)]
        state = loader.state_dict()
        del it
        resumed = make_loader(num_workers, prefetch=prefetch)
        resumed.load_state_dict(state)
        assert head + digests(resumed) == want, mid


def test_two_cp_ranks_receive_the_same_plans(reference):
    rank0, rank1 = list(make_loader(2, cp_rank=0)), list(make_loader(2, cp_rank=1))
    assert digests(rank0) == digests(rank1) == digests(s[0] for s in reference)
    for a, b, shards in zip(rank0, rank1, reference, strict=True):
        assert (a.layout.cp_rank, b.layout.cp_rank) == (0, 1)
        gather = a.layout.gather_index
        for key in ("input_ids", "labels", "position_ids", "padding_mask", "document_ids"):
            whole = torch.cat([a[key], b[key]])[gather]
            want = torch.cat([shards[0][key], shards[1][key]])[gather]
            assert torch.equal(whole, want), key
        assert int((~torch.cat([a["padding_mask"], b["padding_mask"]])).sum()) == a.info["real_tokens"]


def test_resume_needs_the_same_worker_count():
    loader = make_loader(2)
    it = iter(loader)
    next(it)
    worker_state = loader.state_dict()["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]
    del it
    assert worker_state["worker"] == [0, 2]
    ds = CPDataset(DOCS, cp_rank=0, **CFG)  # in the main process: worker 0 of 1
    ds.load_state_dict(worker_state)
    assert ds.state_dict() is worker_state  # pending until the next __iter__
    with pytest.raises(ValueError, match="same num_workers"):
        iter(ds)


def test_constructor_checks():
    with pytest.raises(TypeError, match="pin_memory"):
        CPDataset(DOCS, cp_rank=0, delivery=Delivery(pin_memory=True), **CFG)
    with pytest.raises(ValueError, match="cp_rank"):
        CPDataset(DOCS, cp_rank=2, **CFG)
    with pytest.raises(ValueError, match="qkv_format='thd'"):
        CPDataset(DOCS, cp_rank=0, **{**CFG, "qkv_format": "bshd"})
    ds = CPDataset(DOCS, cp_rank=0, **CFG)
    with pytest.raises(ValueError, match="version"):
        ds.load_state_dict({"loader": {}})
    assert np.asarray(ds.state_dict()["worker"]).tolist() == [0, 1]


@pytest.mark.parametrize(("saved", "restored"), [(0, 2), (2, 0), (2, 3), (1, 0)])
def test_state_from_another_worker_count_is_refused_naming_both(saved, restored):
    """torchdata 0.11 alone raises a bare AssertionError between 0 and N workers; CPDataLoader names both counts."""
    from cpdata.nodes.dataloader import CPDataLoader

    def make(num_workers):
        extra = {"multiprocessing_context": "fork"} if num_workers else {}
        return CPDataLoader(CPDataset(DOCS, cp_rank=0, **CFG), num_workers=num_workers, **extra)

    loader = make(saved)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    fresh = make(restored)
    with pytest.raises(ValueError) as info:
        fresh.load_state_dict(state)
    message = str(info.value)
    assert f"saved with num_workers={saved}" in message and f"has num_workers={restored}" in message
    assert f"resume with num_workers={saved}" in message


@pytest.mark.parametrize("num_workers", [0, 2])
def test_cp_data_loader_resumes_exactly_with_the_same_worker_count(num_workers, reference):
    from cpdata.nodes.dataloader import CPDataLoader

    def make():
        extra = {"multiprocessing_context": "fork"} if num_workers else {}
        return CPDataLoader(CPDataset(DOCS, cp_rank=0, **CFG), num_workers=num_workers, **extra)

    loader = make()
    it = iter(loader)
    head = [next(it).info["digest"] for _ in range(2)]
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert head + digests(resumed) == digests(s[0] for s in reference)
    with pytest.raises(ValueError, match="batch_size=1"):
        CPDataLoader(CPDataset(DOCS, cp_rank=0, **CFG), batch_size=1)
