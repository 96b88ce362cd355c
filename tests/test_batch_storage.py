"""One storage per batch: every tensor and both layout maps are views of one buffer, end to end.

Through ``default_convert``, pinning, pickling, a ``StatefulDataLoader``
worker (the batch arrives in the training process as one shared-memory
storage) and ``ShardedBatch.to(device, non_blocking=True)`` (one copy).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data._utils.collate import default_convert
from torch.utils.data._utils.pin_memory import pin_memory
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import CPDataset
from cpdata.worker.batch import ShardedBatch
from tests.flat_options import records

DOCS = [{"input_ids": np.arange(1, 1 + 40 + (i * 37) % 300, dtype=np.int64)} for i in range(60)]
CFG = {"capacity": 512, "cp_size": 4, "layout": "balanced", "seed": 0}


def tensors_of(batch: ShardedBatch) -> list[torch.Tensor]:
    lay = batch.layout
    return [*batch.values(), lay.local_token_global_indices, lay.gather_index]


def storages(batch: ShardedBatch) -> int:
    return len({t.untyped_storage().data_ptr() for t in tensors_of(batch)})


def first_batch(**over) -> ShardedBatch:
    return next(iter(CPDataset(DOCS, **records(cp_rank=1, **{**CFG, **over}))))


def assert_same(a: ShardedBatch, b: ShardedBatch) -> None:
    assert list(a) == list(b) and a.info == b.info
    for x, y in zip(tensors_of(a), tensors_of(b), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_the_layout_maps_live_in_the_batch_buffer():
    batch = first_batch()
    assert storages(batch) == 1
    lay = batch.layout
    assert lay.gather_index.numel() == 4 * lay.local_token_global_indices.numel() == 512
    assert torch.equal(torch.sort(lay.gather_index).values, torch.arange(512))  # a permutation, intact
    assert torch.equal(lay.gather_index[lay.local_token_global_indices], torch.arange(128) + 128)  # rank 1


def test_default_convert_copy_and_pickle_keep_one_storage():
    batch = first_batch()
    for other in (default_convert(batch), pickle.loads(pickle.dumps(batch))):
        assert isinstance(other, ShardedBatch) and storages(other) == 1
        assert_same(other, batch)


def test_pinning_is_one_call_on_one_storage(monkeypatch):
    batch = first_batch()
    calls = []

    def fake_pin(self, *args, **kwargs):  # a CPU build cannot pin: count the calls, copy like pinning does
        calls.append(self.numel())
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    pinned = pin_memory(batch)  # what DataLoader(pin_memory=True)'s thread calls
    assert calls == [batch._buffer.numel()]
    assert isinstance(pinned, ShardedBatch) and storages(pinned) == 1
    assert pinned._buffer.data_ptr() != batch._buffer.data_ptr()
    assert_same(pinned, batch)


def test_to_device_is_one_copy_and_leaves_the_maps_on_the_host(monkeypatch):
    batch = first_batch()
    copies = []
    real_to, real_clone = torch.Tensor.to, torch.Tensor.clone

    def counting_to(self, *args, **kwargs):
        copies.append(self.numel())
        return real_to(self, *args, **kwargs)

    def counting_clone(self, *args, **kwargs):  # a forced copy on the same device is a clone
        copies.append(self.numel())
        return real_clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    moved = batch.to("cpu", non_blocking=True, copy=True)
    same = batch.to("cpu")
    monkeypatch.undo()
    assert copies == [batch._batch_bytes(), batch._batch_bytes()]
    assert batch._batch_bytes() < batch._buffer.numel()  # the maps are not part of the copy
    assert len({t.untyped_storage().data_ptr() for t in moved.values()}) == 1
    assert moved.layout.gather_index.data_ptr() == batch.layout.gather_index.data_ptr()
    assert_same(moved, batch)
    assert same is batch  # already there: nothing moved (as Tensor.to)


def test_a_worker_batch_arrives_as_one_shared_memory_storage():
    loader = StatefulDataLoader(CPDataset(DOCS, **records(cp_rank=1, **CFG)), batch_size=None, num_workers=1,
                                multiprocessing_context="fork")  # fmt: skip
    local = list(CPDataset(DOCS, **records(cp_rank=1, **CFG)))
    got = list(loader)
    assert len(got) == len(local) > 1
    for batch, want in zip(got, local, strict=True):
        assert isinstance(batch, ShardedBatch) and storages(batch) == 1
        assert batch._buffer.untyped_storage().is_shared()
        assert_same(batch, want)


def test_sharder_moves_a_presharded_batch_in_one_call(monkeypatch):
    from cpdata.bench.step_shard import LocalMesh
    from cpdata.nemo.sharder import ContextParallelSharder

    batch = first_batch()
    sharder = ContextParallelSharder(None, LocalMesh(1, 4, "cpu"), batch)
    calls = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        calls.append(self.numel())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    _, local = sharder.shard(batch)
    monkeypatch.undo()
    assert calls == [batch._batch_bytes()]
    assert type(local) is dict and list(local) == list(batch)
    assert all(local[k] is batch[k] for k in batch)  # already on the mesh's device: the same views
    assert sharder.shard_layout is batch.layout
    with pytest.raises(ValueError, match="cp_rank=1 but this process is cp_rank=2"):
        ContextParallelSharder(None, LocalMesh(2, 4, "cpu"), batch).shard(batch)


def test_moved_views_are_the_spans_views_and_the_plan_travels():
    batch = first_batch()
    moved = batch.to("cpu", copy=True)
    for key, want in batch.items():
        got = moved[key]
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), key
        offset = batch._views.plan.spans[key][0]
        assert got.storage_offset() * got.element_size() == offset and torch.equal(got, want)
    assert moved._views.plan is batch._views.plan  # computed once per span table, kept by every derived batch
    assert pickle.loads(pickle.dumps(batch))._views.plan == batch._views.plan


def test_sharder_fast_path_equals_the_general_path():
    from cpdata.bench.step_shard import LocalMesh
    from cpdata.device.batch_context import AttentionContextFactory
    from cpdata.nemo.raw_shard import DeviceShard
    from cpdata.nemo.sharder import ContextParallelSharder

    batch = first_batch()
    mesh = LocalMesh(1, 4, "cpu")
    sharder = ContextParallelSharder(None, mesh, batch)
    ctx, out = sharder.shard(batch)
    ref_ctx, ref, ref_layout = DeviceShard(device=torch.device("cpu"))(mesh, None, batch)
    assert type(out) is dict and list(out) == list(ref) and all(out[k] is ref[k] for k in ref)
    assert sharder.shard_layout is ref_layout is batch.layout
    assert isinstance(ctx, AttentionContextFactory) and (ctx.layout, ctx.group) == (ref_ctx.layout, ref_ctx.group)
    assert ctx.document_ids is out["document_ids"]
    with pytest.raises(ValueError, match="laid out for cp_size=4 but the CP mesh has cp_size=2"):
        ContextParallelSharder(None, LocalMesh(1, 2, "cpu"), batch).shard(batch)
    with pytest.raises(ValueError, match="loss_mask= applies to raw full batches"):
        ContextParallelSharder(None, mesh, batch, loss_mask=torch.ones(1, 512)).shard(batch)
    sharder.shard_batch = lambda *args, **kwargs: ("own", {"x": 1}, None)  # a replaced shard_batch is honoured
    assert sharder.shard(batch) == ("own", {"x": 1})


def _gap_bytes(batch: ShardedBatch) -> np.ndarray:
    """The bytes of ``batch``'s buffer that no tensor or layout map covers, and a check that there are some."""
    from cpdata.worker.buffer_spans import gap_index

    views = batch._views
    gaps = gap_index((views.plan.spans, views.plan.map_spans), views.buffer.numel())
    assert gaps.size > 0, "no alignment gap in this batch: the test would pass vacuously"
    return views.buffer.numpy()[gaps]


def test_alignment_gaps_of_a_batch_buffer_are_zero_whatever_the_allocator_left():
    # Fill freed heap memory of the batch's size with 0xFF first, so an uninitialised gap would show it
    # (glibc hands a freed chunk of the same size back to the next allocation of that size).
    size = first_batch()._views.buffer.numel()
    for _ in range(8):
        junk = np.full(size, 0xFF, dtype=np.uint8)
        del junk
    batch = first_batch()
    assert (_gap_bytes(batch) == 0).all()
    again = pickle.loads(pickle.dumps(batch))
    assert (_gap_bytes(again) == 0).all()


def test_alignment_gaps_of_a_contiguous_batch_are_zero():
    src = first_batch()
    torch.empty(1 << 16, dtype=torch.uint8).fill_(0xFF)  # leave junk where the next buffer may come from
    batch = ShardedBatch.contiguous(dict(src), layout=src.layout, info=src.info)
    assert (_gap_bytes(batch) == 0).all()
    assert_same(batch, src)


def test_a_contiguous_batch_refuses_what_a_plain_batch_refuses():
    src = first_batch()
    for build in (ShardedBatch, ShardedBatch.contiguous):
        with pytest.raises(TypeError, match=r"values must be torch tensors; keys \['input_ids'\] are not"):
            build({**src, "input_ids": [1, 2]}, layout=src.layout)
        with pytest.raises(TypeError, match="layout must be a ShardLayout, got dict"):
            build(dict(src), layout={})


_DTYPES = {1: torch.bool, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.sampled_from(sorted(_DTYPES))),
                min_size=0, max_size=6),
       st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=1, max_size=1), st.sampled_from(sorted(_DTYPES))),
                min_size=0, max_size=3),
       st.integers(0, 40))  # fmt: skip
def test_gap_index_is_every_byte_no_span_covers(tensors, maps, extra):
    """The gaps from the span tables equal a byte mask over the whole buffer (the reference), in order."""
    from cpdata.worker.buffer_spans import gap_index, span_table

    def specs(items):
        return {str(i): (tuple(shape), _DTYPES[size], size) for i, (shape, size) in enumerate(items)}

    spans, end = span_table(specs(tensors))
    map_spans, total = span_table(specs(maps), end)
    total += extra  # a buffer longer than its spans: the tail is a gap too
    covered = np.zeros(total, dtype=bool)
    for offset, nbytes, *_ in (*spans.values(), *map_spans.values()):
        covered[offset : offset + nbytes] = True
    got = gap_index((spans, map_spans), total)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.flatnonzero(~covered))
