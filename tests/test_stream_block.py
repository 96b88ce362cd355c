"""build_streams over a block of batches against each batch's stream from the definitions; CollatedPack's
lazily computed metadata."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_collate import make_plans
from torchdata.nodes import IterableWrapper

from cpdata.layout.maps import thd_slot_lens
from cpdata.nodes.collate import Collate
from cpdata.worker.collate import CollatedPack
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream import Stream, build_streams
from cpdata.worker.stream_slots import pack_metadata, slot_block


def expected_columns(plans: list[PackPlan]) -> dict[str, list[int]]:
    """Per-slot columns of one batch's stream, one slot at a time (an empty plan: one pad slot)."""
    cols: dict[str, list[int]] = {"slot_starts": [], "slot_lens": [], "real_lens": [], "pos_shift": []}
    at = 0
    for plan in plans:
        slots = thd_slot_lens(plan.slot_lens, plan.capacity) if plan.pieces else [plan.capacity]
        pieces = plan.pieces or [None]
        for piece, slot in zip(pieces, slots, strict=True):
            cols["slot_starts"].append(at)
            cols["slot_lens"].append(int(slot))
            cols["real_lens"].append(piece.length if piece else 0)
            cols["pos_shift"].append((piece.start if piece else 0) - at)
            at += int(slot)
    return cols


def expected_metadata(plans: list[PackPlan]) -> dict[str, np.ndarray]:
    cols = expected_columns(plans)
    real, slot = cols["real_lens"], cols["slot_lens"]
    return {
        "cu_seqlens": np.asarray([0, *np.cumsum(real)], dtype=np.int32),
        "cu_seqlens_padded": np.asarray([0, *np.cumsum(slot)], dtype=np.int32),
        "seq_lens": np.asarray(real, dtype=np.int32),
        "seq_lens_padded": np.asarray(slot, dtype=np.int32),
        "max_seqlen": np.asarray(max(real), dtype=np.int32),
    }


def assert_same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        np.testing.assert_array_equal(got[key], want[key], key)


def src_starts(stream: Stream) -> np.ndarray:
    """int64 ``[K]``: the buffer index of each slot's first token, from the segment table."""
    k = stream.slot_lens.shape[0]
    return stream.segments[2 * k + 1 : 4 * k + 1 : 2] + stream.slot_starts


def assert_stream(stream: Stream, plans: list[PackPlan]) -> None:
    """Every column of ``stream`` from the definitions; its segment table is the one built from its columns."""
    cols = expected_columns(plans)
    for key in ("slot_starts", "slot_lens"):
        np.testing.assert_array_equal(getattr(stream, key), cols[key], key)
    np.testing.assert_array_equal(stream.real_ends, np.add(cols["slot_starts"], cols["real_lens"]))
    assert stream.pads_pass_end == any(
        s + p + n > plans[0].capacity
        for s, p, n in zip(cols["slot_starts"], cols["pos_shift"], cols["slot_lens"], strict=True)
    )
    starts = src_starts(stream)
    for slot, piece in enumerate(q for p in plans for q in p.pieces or [None]):
        if piece is not None:  # the slot's real tokens read the piece's ids from the buffer
            at = int(starts[slot])
            np.testing.assert_array_equal(stream.buffer.ids[at : at + piece.length], piece.arrays["input_ids"])
    k = len(cols["slot_starts"])
    segments = np.empty(6 * k + 1, dtype=np.int64)  # each slot's real tokens then its pads, a bound past them
    segments[0 : 2 * k : 2] = cols["slot_starts"]
    segments[1 : 2 * k : 2] = np.add(cols["slot_starts"], cols["real_lens"])
    segments[2 * k] = np.iinfo(np.int64).max
    segments[2 * k + 1 : 4 * k + 1 : 2] = starts - cols["slot_starts"]
    segments[2 * k + 2 : 4 * k + 1 : 2] = stream.buffer.total
    segments[4 * k + 1 :: 2] = segments[4 * k + 2 :: 2] = cols["pos_shift"]
    np.testing.assert_array_equal(stream.segments, segments)
    assert stream.metadata is not None
    assert_same_arrays(stream.metadata, expected_metadata(plans))


@pytest.mark.parametrize("seed", range(4))
def test_a_block_of_streams_equals_each_batch_from_the_definitions(seed):
    """Batches of 1-4 plans (empty plans included, some batches a single empty plan), built as one block,
    as blocks of one, and each batch alone: the same columns, segment tables and metadata."""
    rng = np.random.default_rng(seed)
    batches = []
    for b in range(int(rng.integers(2, 7))):
        plans, _ = make_plans(rng, n_plans=int(rng.integers(1, 5)), capacity=64, max_docs=4,
                              extras=b % 2 == 1, given_labels=0.3)  # fmt: skip
        batches.append((plans, b))
    block = build_streams(batches)
    assert len(block.streams) == len(batches)
    for b, (stream, (plans, pad)) in enumerate(zip(block.streams, batches, strict=True)):
        assert stream.padding_token_id == pad and stream.rows == len(plans)
        assert_stream(stream, plans)
        assert_stream(build_streams([(plans, pad)]).streams[0], plans)  # a block of one
        cols = expected_columns(plans)
        meta = stream.metadata
        assert int(meta["cu_seqlens"][-1]) == sum(cols["real_lens"])
        assert int(meta["seq_lens_padded"].max()) == max(cols["slot_lens"])
        assert int(meta["max_seqlen"]) == max(cols["real_lens"])
        np.testing.assert_array_equal(block.slots.layout_lens_of(b), slot_block([plans]).layout_lens_of(0))
        slot = slice(block.slots.first[b], block.slots.first[b + 1])
        np.testing.assert_array_equal(block.src_starts[slot], src_starts(stream))
        before = sum(64 * len(p) for p, _ in batches[:b])  # the streams of the batches before it
        np.testing.assert_array_equal(block.offsets[slot], stream.slot_starts + before)


def test_collated_pack_metadata_is_computed_when_read():
    """The Collate node leaves the metadata to the first read: the same values as pack_metadata; the
    record stays immutable and pickles with its metadata."""
    rng = np.random.default_rng(5)
    plans, _ = make_plans(rng, n_plans=6, capacity=64)
    node = Collate(IterableWrapper(plans), batch_size=3, qkv_format="thd")
    for batch in (next(node), next(node)):
        assert "metadata" not in vars(batch)  # not computed by the node
        assert_same_arrays(batch.metadata, pack_metadata(list(batch.plans)))
        assert batch.metadata is batch.metadata  # computed once
        with pytest.raises(AttributeError, match="cannot assign"):
            batch.pack_len = 3  # type: ignore[misc]
        copy = pickle.loads(pickle.dumps(batch))
        assert copy.row_shape == batch.row_shape and copy.qkv_format == "thd"
        assert_same_arrays(copy.metadata, batch.metadata)
    assert_same_arrays(CollatedPack(plans=tuple(plans[:2]), pack_len=64, qkv_format="bshd",
                                    padding_token_id=0).metadata, pack_metadata(plans[:2]))  # fmt: skip
