"""Token buffers: the layout every rank gathers from, and the pool that hands buffers out again."""

from __future__ import annotations

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX
from cpdata.worker.token_buffer import BufferPool, concatenate_arrays, concatenate_spaced


def test_each_item_is_followed_by_the_target_of_its_last_token():
    a = {"input_ids": np.array([5, 6, 7]), "labels": np.array([6, 7, IGNORE_INDEX]), "w": np.array([1.5, 2, 3], np.float32)}
    b = {"input_ids": np.array([8, 9], dtype=np.int32), "w": np.array([4, 5], np.float32)}
    buf = concatenate_arrays([a, b], [3, 2], np.array([IGNORE_INDEX, 42]))
    assert buf.total == 7
    np.testing.assert_array_equal(buf.ids, [5, 6, 7, IGNORE_INDEX, 8, 9, 42, 0, IGNORE_INDEX])
    # a's own labels; b has none: next-token ids, its last token's target the element after it
    np.testing.assert_array_equal(buf.labels[[0, 1, 2, 4, 5, 7]], [6, 7, IGNORE_INDEX, 9, 42, IGNORE_INDEX])
    assert buf.extras["w"].dtype == np.float32
    np.testing.assert_array_equal(buf.extras["w"][[0, 1, 2, 4, 5, 7]], [1.5, 2, 3, 4, 5, 0])
    plain = concatenate_arrays([{"input_ids": np.array([1, 2])}], [2], np.array([IGNORE_INDEX]))
    assert plain.labels is None and plain.extras == {}


def test_spaced_concatenation_leaves_one_zero_after_each_array():
    arrays = [np.array([3, 4]), np.array([], dtype=np.int64), np.array([7], dtype=np.int32)]
    out = np.full(6, -1, dtype=np.int64)
    concatenate_spaced(arrays, out)
    reference = np.concatenate([np.append(a, 0) for a in arrays])  # each array, then one spare element
    np.testing.assert_array_equal(out, reference)
    assert out.tolist() == [3, 4, 0, 0, 7, 0]
    empty = np.full(2, -1, dtype=np.int64)
    concatenate_spaced([], empty[:0])  # nothing to write: the array is left alone
    assert empty.tolist() == [-1, -1]


def test_the_pool_hands_an_array_out_again_only_once_nothing_refers_to_it():
    pool = BufferPool(size=2)
    first = pool.take(100)
    view = first[10:20]
    del first
    second = pool.take(50)  # the first is still referred to by a view
    assert not np.shares_memory(second, view)
    del view
    third = pool.take(80)  # the first array is free again: reused, no new allocation
    assert len(pool._arrays) == 2 and any(np.shares_memory(third, a) for a in pool._arrays)
    fourth = pool.take(10)  # both pooled arrays in use: a fresh one, not pooled
    assert not any(np.shares_memory(fourth, a) for a in pool._arrays)
    del second, third
    assert pool.take(400).shape == (400,)  # a free array too short is replaced by a larger one
