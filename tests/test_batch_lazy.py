"""A contiguous batch builds its host views when they are read, never to be pickled, pinned, moved or copied.

Lazily built views equal eagerly built ones (values, dtype, shape, strides, storage, byte offset); the
views and the layout are built once per buffer and shared by shallow copies (``default_convert``); a
replaced key still detaches the batch from its buffer; byte counts come from the plan without views.
The internal state (``_views.builds``: view builds of one buffer) is the witness, not timing.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from test_batch_views import filled
from test_shard_node import plans_for, shard_node
from torch.utils.data._utils.collate import default_convert
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from cpdata import CPDataLoader, CPDataset
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nodes.dataloader import hand_over
from cpdata.worker.batch import ShardedBatch
from tests.flat_options import records

MAPS = ("local_token_global_indices", "gather_index")
DOCS = [{"input_ids": np.arange(1, 1 + 40 + (i * 37) % 300, dtype=np.int64)} for i in range(40)]
CFG = {"capacity": 512, "cp_size": 4, "cp_rank": 1, "layout": "balanced", "seed": 0}


def pipeline_batches(qkv_format: str) -> list[ShardedBatch]:
    """ShardForRank's batches with extras and given labels (bshd: B = 2 rows under a static layout)."""
    layout = "balanced" if qkv_format == "thd" else "contiguous"
    node = shard_node(plans_for(layout, 2, n=4), batch_size=2, qkv_format=qkv_format, cp_size=2, cp_rank=1,
                      layout=layout)  # fmt: skip
    return list(node)


def untouched(batch: ShardedBatch) -> bool:
    """No view of the batch's buffer built yet (neither its tensors nor its layout maps)."""
    return batch._views is not None and batch._views.builds == 0 and batch._tensors is None


def views(buffer: torch.Tensor, spans: dict) -> dict[str, torch.Tensor]:
    """The reference: each span's typed view of ``buffer``, one ``as_strided`` per key."""
    return {k: buffer.view(dtype).as_strided(shape, strides, offset // dtype.itemsize)
            for k, (offset, _, dtype, shape, strides) in spans.items()}  # fmt: skip


def same_view(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert got.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
    assert got.storage_offset() * got.element_size() == want.storage_offset() * want.element_size()
    assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_lazy_views_equal_eager_views_of_the_buffer(qkv_format):
    batches = pipeline_batches(qkv_format)
    assert batches
    for batch in batches:
        assert untouched(batch)  # the worker's output: a filled buffer, no view
        plan, buffer = batch._views.plan, batch._buffer
        eager, eager_maps = views(buffer, plan.spans), views(buffer, plan.map_spans)  # one as_strided per key
        assert list(batch) == list(eager) and len(batch) == len(eager) and untouched(batch)  # keys from the plan
        for key, want in eager.items():
            same_view(batch[key], want)
        assert batch._views.builds == 1  # every key from one build
        for name in MAPS:
            same_view(getattr(batch.layout, name), eager_maps[name])
        assert batch._views.builds == 2 and batch.layout is batch.layout
        assert batch.layout.digest == batch.info["digest"]
        assert all(batch[k] is v for k, v in batch.tensors().items())  # built once, the same objects after


def test_pickle_pin_to_and_copy_build_no_host_view(monkeypatch):
    batch = pipeline_batches("thd")[0]
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())  # a CPU build cannot pin
    shallow = copy.copy(batch)
    received = pickle.loads(pickle.dumps(batch))
    pinned = torch_pin_memory(batch)  # the pin-memory thread's call
    moved = pinned.to("cpu", copy=True)
    assert batch.nbytes() == sum(span[1] for span in batch._views.plan.spans.values())
    for b in (batch, shallow, received, pinned):
        assert untouched(b)
    assert moved._views.builds == 0 and moved._tensors is None
    assert shallow._views is batch._views  # shared: built at most once for both
    assert received._views is not batch._views and pinned._buffer.data_ptr() != batch._buffer.data_ptr()
    plan = batch._views.plan
    assert received._views.plan == plan and moved._views.plan is pinned._views.plan is plan
    rec = received.layout  # the receiver builds its own views, equal to the sender's
    for name in MAPS:
        assert torch.equal(getattr(rec, name), getattr(batch.layout, name))
        assert getattr(rec, name).untyped_storage().data_ptr() == received._buffer.untyped_storage().data_ptr()
    assert moved.layout is pinned.layout  # a moved batch's maps are its source's, on the host
    for b in (received, pinned, moved):
        assert list(b) == list(batch) and b.info == batch.info
        for key in batch:
            assert torch.equal(b[key], batch[key]), key


def test_default_convert_shares_the_views_and_keeps_the_buffer():
    batch = pipeline_batches("bshd")[0]
    converted = default_convert(batch)  # copy.copy, then update() with every key read from the original
    assert isinstance(converted, ShardedBatch) and converted is not batch
    assert converted._views is batch._views and batch._views.builds == 1  # one build, shared
    assert converted._buffer is batch._buffer and all(converted[k] is batch[k] for k in batch)
    assert converted.layout is batch.layout
    again = pickle.loads(pickle.dumps(converted))
    assert untouched(again) and again._views.plan == batch._views.plan


def test_a_replacement_detaches_only_the_batch_it_is_made_on():
    batch, want = filled((2, 8))
    shallow = copy.copy(batch)
    twice = shallow["weight"] * 2
    shallow["weight"] = twice
    assert shallow._buffer is None and shallow["weight"] is twice
    assert batch._buffer is not None and torch.equal(batch["weight"], torch.from_numpy(want["weight"]))
    assert shallow.layout is batch.layout  # resolved before detaching: the maps stay views of the buffer
    assert all(shallow[k] is batch[k] for k in batch if k != "weight")
    shallow["labels"] = shallow["labels"]  # the same object: nothing changes
    with pytest.raises(ValueError, match="may only be replaced by a tensor of shape"):
        batch["weight"] = torch.zeros(3)
    with pytest.raises(TypeError, match="keys are fixed"):
        batch["new"] = torch.zeros(1)
    assert batch._buffer is not None and batch._views.builds == 2  # tensors once, layout maps once, shared
    copied = copy.copy(shallow)
    copied["labels"] = copied["labels"] + 1  # a copy of a detached batch owns its dict
    assert torch.equal(shallow["labels"], batch["labels"])
    replaced = batch.replace(weight=None)
    assert "weight" not in replaced and replaced.layout is batch.layout and batch._buffer is not None
    received = pickle.loads(pickle.dumps(shallow))  # a detached batch pickles its own tensors
    assert isinstance(received, ShardedBatch) and received._buffer is None and received.info == shallow.info
    assert list(received) == list(shallow) and all(torch.equal(received[k], shallow[k]) for k in shallow)
    assert received.layout.digest == shallow.layout.digest and torch.equal(received.layout.gather_index,
                                                                           shallow.layout.gather_index)


def test_byte_counts_come_from_the_plan_and_match_the_tensors():
    for batch in (*pipeline_batches("thd")[:1], filled((3, 8))[0]):
        assert untouched(batch)
        nbytes, map_nbytes = batch.nbytes(), batch._map_nbytes()
        assert untouched(batch)
        assert nbytes == sum(t.numel() * t.element_size() for t in batch.values())
        lay = batch.layout
        assert map_nbytes == sum(getattr(lay, n).numel() * getattr(lay, n).element_size() for n in MAPS)
        moved = batch.to("cpu", copy=True)
        assert moved.nbytes() == nbytes and moved._map_nbytes() == map_nbytes
        plain = ShardedBatch(batch.tensors(), layout=lay)  # no buffer: counted from the tensors
        assert plain.nbytes() == nbytes and plain._map_nbytes() == map_nbytes
    contiguous = ShardedBatch.contiguous({"a": torch.zeros(3, dtype=torch.int8)},
                                         layout=ShardLayout(gather_index=torch.arange(5)))  # fmt: skip
    assert contiguous.nbytes() == 3 and contiguous._map_nbytes() == 40


def test_the_loader_hands_batches_over_without_viewing_them():
    batch = next(iter(CPDataset(DOCS, **records(**CFG))))
    assert untouched(batch) and hand_over(batch) is batch and untouched(batch)
    assert hand_over({"x": np.zeros(2)})["x"].dtype == torch.float64  # anything else: default_convert
    local = list(CPDataset(DOCS, **records(**CFG)))
    in_process = list(CPDataLoader(CPDataset(DOCS, **records(**CFG)), num_workers=0))
    assert all(untouched(b) for b in in_process)
    got = list(CPDataLoader(CPDataset(DOCS, **records(**CFG)), num_workers=1, multiprocessing_context="fork"))
    assert len(got) == len(local) == len(in_process) > 1
    for a, b, want in zip(got, in_process, local, strict=True):
        assert untouched(a) and a._buffer.untyped_storage().is_shared()  # one shared storage, views not built
        for other in (a, b):
            assert list(other) == list(want) and other.info == want.info
            assert all(torch.equal(other[k], want[k]) for k in want)
            assert torch.equal(other.layout.gather_index, want.layout.gather_index)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real pinning and a device copy")
def test_real_pinning_and_device_move_build_no_host_view():
    batch = pipeline_batches("thd")[0]
    pinned = batch.pin_memory()
    assert untouched(pinned) and pinned._buffer.is_pinned()
    moved = pinned.to("cuda", non_blocking=True)
    assert untouched(pinned) and moved._views.builds == 0
    torch.cuda.synchronize()
    for key in batch:
        assert moved[key].is_cuda and torch.equal(moved[key].cpu(), batch[key]), key
    assert pinned.layout.gather_index.is_pinned() and moved.layout is pinned.layout


def test_a_pickled_batch_carries_its_record_without_the_maps_it_holds():
    gather = torch.arange(6).flip(0)
    lay = ShardLayout(gather_index=gather, padded_seq_len=6, cp_size=2, cp_rank=1, digest=7)
    batch = ShardedBatch.contiguous({"a": torch.arange(3), "b": torch.ones(2, 3, dtype=torch.bool)}, layout=lay)
    assert untouched(batch)
    fn, args = batch.__reduce__()
    record = args[2]
    assert record.gather_index is None and record.digest == 7 and record.cp_rank == 1  # the map travels in the buffer
    received = fn(*args)
    assert untouched(received) and "ShardedBatch(cp_rank=1/2" in repr(received)
    assert torch.equal(received.layout.gather_index, gather) and received.layout.digest == 7
    assert received.layout.gather_index.untyped_storage().data_ptr() == received._buffer.untyped_storage().data_ptr()
    assert torch.equal(received["b"], torch.ones(2, 3, dtype=torch.bool)) and received["b"].stride() == (3, 1)
