"""The views of a batch's one buffer: every key (any dtype, ``[B, L]`` or ``[L]``) and every layout map is a
view of the buffer at its span, in key order, with the values written; and so after each way a batch is
derived (``to(copy=True)``, a moved batch moved or pickled again, pickling, pinning, ``default_convert``)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from test_shard_node import plans_for, shard_node
from torch.utils.data._utils.collate import default_convert

from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.batch import BatchBuffer, ShardedBatch
from cpdata.worker.buffer_spans import buffer_plan


def specs_for(shape: tuple[int, ...], k: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """A batch's keys in their order, with extras of other dtypes between the tokens and the metadata."""
    i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
    return {"input_ids": (shape, i64), "labels": (shape, i64), "position_ids": (shape, i64),
            "padding_mask": (shape, np.dtype(bool)), "document_ids": (shape, i64),
            "weight": (shape, np.dtype(np.float32)), "loss_mask": (shape, np.dtype(np.int8)),
            "half": (shape, np.dtype(np.float16)), "cu_seqlens": ((k + 1,), i32), "seq_lens": ((k,), i32),
            "max_seqlen": ((), i32)}  # fmt: skip


def filled(shape: tuple[int, ...], k: int = 3, cp: int = 2) -> tuple[ShardedBatch, dict[str, np.ndarray]]:
    """A batch made through :class:`BatchBuffer` with distinct values in every key and map."""
    specs = specs_for(shape, k)
    local = int(np.prod(shape))
    maps = {"local_token_global_indices": ((local,), np.dtype(np.int64)),
            "gather_index": ((cp * local,), np.dtype(np.int64))}  # fmt: skip
    buf = BatchBuffer(buffer_plan(tuple(specs.items()), tuple(maps.items())))
    want = {}
    for i, (key, arr) in enumerate({**buf.arrays, **buf.maps}.items()):
        values = (np.arange(arr.size) * (i + 3) + i) % 97
        arr[...] = values.reshape(arr.shape).astype(arr.dtype)
        want[key] = arr.copy()
    layout = ShardLayout(padded_seq_len=cp * local, cp_size=cp, cp_rank=1)
    return buf.batch(layout=layout, info={"n": 1}), want


def check(batch: ShardedBatch, want: dict[str, np.ndarray], *, maps: bool = True) -> None:
    keys = [k for k in want if k not in ("local_token_global_indices", "gather_index")]
    assert list(batch) == keys  # key order kept
    storage = batch._buffer.untyped_storage().data_ptr()
    for key in keys:
        got, spec = batch[key], batch._views.plan.spans[key]
        assert got.dtype == torch.from_numpy(want[key]).dtype and tuple(got.shape) == want[key].shape, key
        assert got.is_contiguous() and got.untyped_storage().data_ptr() == storage, key  # a view of the buffer
        assert got.storage_offset() * got.element_size() == spec[0] and spec[0] % 16 == 0, key
        assert torch.equal(got, torch.from_numpy(want[key])), key
    for name in ("local_token_global_indices", "gather_index"):
        got = getattr(batch.layout, name)
        assert torch.equal(got, torch.from_numpy(want[name])), name
        assert (got.untyped_storage().data_ptr() == storage) == maps, name


@pytest.mark.parametrize("shape", [(1, 40), (3, 24), (56,), (2, 0)], ids=["bshd", "bshd-B3", "thd", "empty"])
def test_every_key_and_map_is_a_view_of_the_buffer_with_its_values(shape):
    batch, want = filled(shape)
    check(batch, want)
    assert batch._batch_bytes() == batch.layout.local_token_global_indices.storage_offset() * 8
    moved = batch.to("cpu", copy=True)
    check(moved, want, maps=False)
    assert moved._buffer.numel() == batch._batch_bytes()  # the maps stay behind, shared
    assert moved.layout.gather_index is batch.layout.gather_index
    for again in (moved.to("cpu", copy=True), pickle.loads(pickle.dumps(moved)), default_convert(moved)):
        check(again, want, maps=False)
    for again in (pickle.loads(pickle.dumps(batch)), default_convert(batch)):
        check(again, want)
    assert moved.to("cpu") is moved and batch.to("cpu") is batch
    assert batch.to("meta")["weight"].is_meta and batch.to("meta")["max_seqlen"].shape == ()


def test_a_pinned_batch_is_one_buffer_with_the_same_views(monkeypatch):
    batch, want = filled((2, 16))
    moved = batch.to("cpu", copy=True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())  # a CPU build cannot pin
    check(batch.pin_memory(), want)
    check(moved.pin_memory(), want, maps=False)


def test_a_replaced_key_falls_back_to_per_key_tensors():
    batch, want = filled((1, 32))
    moved = batch.to("cpu", copy=True)
    moved["weight"] = moved["weight"] * 2  # same shape: allowed, the buffer no longer backs every key
    assert moved._buffer is None and moved._views is None
    again = moved.to("cpu", copy=True)
    assert list(again) == list(batch) and torch.equal(again["weight"], torch.from_numpy(want["weight"]) * 2)
    assert torch.equal(pickle.loads(pickle.dumps(moved))["labels"], batch["labels"])


def test_the_plan_is_cached_per_shape_set_and_each_buffer_is_fresh():
    specs = specs_for((1, 8), 2)
    maps = {"gather_index": ((16,), np.dtype(np.int64))}
    plans = [buffer_plan(tuple(specs.items()), tuple(maps.items())) for _ in range(2)]
    a, b = BatchBuffer(plans[0]), BatchBuffer(plans[1])
    assert plans[0] is plans[1] and a.plan is b.plan and a.buffer.data_ptr() != b.buffer.data_ptr()
    assert list(a.arrays) == list(specs) and list(a.maps) == list(maps)
    assert buffer_plan.cache_info().currsize >= 1


@pytest.mark.parametrize(("qkv_format", "batch_size"), [("bshd", 2), ("thd", 2)])
def test_pipeline_batches_with_extras_move_as_one_buffer(qkv_format, batch_size):
    node = shard_node(plans_for("contiguous", 2, n=4), batch_size=batch_size, qkv_format=qkv_format, cp_size=2,
                      cp_rank=1, layout="contiguous")  # fmt: skip
    batches = list(node)
    assert batches
    for batch in batches:
        dtypes = {v.dtype for v in batch.values()}
        assert dtypes - {torch.int64, torch.int32, torch.bool}, "no extra dtype: the case would pass vacuously"
        moved = batch.to("cpu", non_blocking=True, copy=True)
        assert list(moved) == list(batch)
        assert len({t.untyped_storage().data_ptr() for t in moved.values()}) == 1
        for key, want in batch.items():
            got = moved[key]
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), key
            assert torch.equal(got, want), key
