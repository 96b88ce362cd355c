"""Worker batches bit for bit against a brute-force reference, at the sizes training uses.

Every tensor of every rank's :class:`~cpdata.worker.batch.ShardedBatch` (keys, order,
dtypes, shapes, values), both layout maps, the layout record and the ``info``
dict are compared with a reference computed here from the definitions, one
piece and one document at a time: the full pack slot by slot, each layout's
rows document by document, the inverse by ``argsort``, the causal work by
summing a per-token cost, the digest by hashing one piece at a time. Covered:
every layout, cp 1-8, capacities 8K-128K, pieces of split documents (non-zero
starts, continuing targets), given labels on some pieces, extra per-token
arrays and loss masks, empty packs, bshd rows and thd streams of several packs.
"""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_collate import make_plans
from torchdata.nodes import IterableWrapper

from cpdata.layout.maps import (
    LAYOUTS,
    alignment,
    causal_work,
    layout_run_block,
    layout_runs,
    layout_tile,
    node_size_of,
)
from cpdata.layout.tiled import tiled_owners
from cpdata.layout.world_deal import world_runs
from cpdata.nodes.collate import Collate
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.shard import ShardForRank, layout_depends_on_documents
from cpdata.worker.keys import IGNORE_INDEX, METADATA_KEYS
from cpdata.worker.plan import DocPiece, PackPlan
from cpdata.worker.shard_block import DIGEST_SAMPLES

TOKEN_KEYS = ("input_ids", "labels", "position_ids", "padding_mask", "document_ids")


# ---------------------------------------------------------------------------------------------------- reference
def reference_rows(layout: str, cp: int, lens: list[int], pack_len: int) -> np.ndarray:
    """``[cp, pack_len // cp]`` rows, straight from the layout table (one document at a time)."""
    rows: list[list[int]] = [[] for _ in range(cp)]
    two = 2 * cp
    if layout in ("identity", "contiguous"):
        local = pack_len // cp
        rows = [list(range(r * local, (r + 1) * local)) for r in range(cp)]
    elif layout == "round_robin":
        c = pack_len // two
        rows = [[*range(r * c, (r + 1) * c), *range((two - 1 - r) * c, (two - r) * c)] for r in range(cp)]
    elif layout == "thd":
        slots = list(lens) or ([pack_len] if pack_len else [])
        if slots:
            slots[-1] += pack_len - sum(slots)
        start = 0
        for n in slots:
            c = n // two
            for r in range(cp):
                rows[r] += [*range(start + r * c, start + (r + 1) * c),
                            *range(start + (two - 1 - r) * c, start + (two - r) * c)]  # fmt: skip
            start += n
    elif layout_tile(layout) is not None:  # tiled: the deal's owners, block by block in global order
        tile = layout_tile(layout)
        for b, r in enumerate(tiled_owners(np.asarray(lens, dtype=np.int64), pack_len, cp, tile).tolist()):
            rows[r] += range(b * tile, (b + 1) * tile)
    elif node_size_of(layout, cp) is not None:  # world: the deal's runs, in global order
        starts, lengths, owners = world_runs(np.asarray(lens, dtype=np.int64), pack_len, cp, node_size_of(layout, cp))
        for start, n, r in zip(starts.tolist(), lengths.tolist(), owners.tolist(), strict=True):
            rows[r] += range(start, start + n)
    else:  # balanced
        ptr = start = 0
        for n in lens:
            q, m = divmod(n, two)
            middle = start + cp * q
            owner = [(ptr + j) % cp for j in range(m)]
            for r in range(cp):
                rows[r] += range(start + r * q, start + (r + 1) * q)
                rows[r] += [middle + j for j in range(m) if owner[j] == r]
                rows[r] += range(middle + m + (cp - 1 - r) * q, middle + m + (cp - r) * q)
            ptr += m
            start += n
        for j, g in enumerate(range(start, pack_len)):
            rows[(ptr + j) % cp].append(g)
    return np.asarray(rows, dtype=np.int64).reshape(cp, pack_len // cp)


def _slots(plan: PackPlan, absorb: bool) -> list[int]:
    slots = [int(s) for s in plan.slot_lens] or ([plan.capacity] if absorb else [])
    if absorb and plan.pieces:
        slots[-1] += plan.capacity - sum(slots)
    return slots


def reference_full(plans: list[PackPlan], pad: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Token tensors ``[B, S]`` and metadata, slot by slot; plus the causal cost per token ``[B, S]``."""
    b_rows, cap = len(plans), plans[0].capacity
    pieces = [q for p in plans for q in p.pieces]
    extra_keys = sorted({k for q in pieces for k in q.arrays} - {"input_ids", "labels", "loss_mask"})
    masks = [q.arrays["loss_mask"] for q in pieces if "loss_mask" in q.arrays]
    out = {
        "input_ids": np.full((b_rows, cap), pad, dtype=np.int64),
        "labels": np.full((b_rows, cap), IGNORE_INDEX, dtype=np.int64),
        "position_ids": np.zeros((b_rows, cap), dtype=np.int64),
        "padding_mask": np.ones((b_rows, cap), dtype=bool),
        "document_ids": np.zeros((b_rows, cap), dtype=np.int64),
    }
    for k in extra_keys:
        out[k] = np.zeros((b_rows, cap), dtype=np.result_type(*[q.arrays[k] for q in pieces]))
    if masks:  # last of the extras: a piece's own mask, else its labels != -100
        out["loss_mask"] = np.zeros((b_rows, cap), dtype=np.result_type(*masks))
    cost = np.zeros((b_rows, cap), dtype=np.int64)
    seq_lens, seq_lens_padded = [], []
    doc = 0
    for b, plan in enumerate(plans):
        off = 0
        for i, slot in enumerate(_slots(plan, absorb=True)):
            piece = plan.pieces[i] if plan.pieces else None
            n = piece.length if piece is not None else 0
            start = piece.start if piece is not None else 0
            if piece is not None:
                ids = np.asarray(piece.arrays["input_ids"])
                out["input_ids"][b, off : off + n] = ids
                if "labels" in piece.arrays:
                    out["labels"][b, off : off + n] = piece.arrays["labels"]
                elif n:
                    out["labels"][b, off : off + n - 1] = ids[1:]
                    out["labels"][b, off + n - 1] = piece.next_label
                for k in extra_keys:
                    out[k][b, off : off + n] = piece.arrays[k]
                if masks:
                    own = piece.arrays.get("loss_mask")
                    out["loss_mask"][b, off : off + n] = (
                        own if own is not None else out["labels"][b, off : off + n] != IGNORE_INDEX)  # fmt: skip
            out["padding_mask"][b, off : off + n] = False
            positions = start + np.arange(slot)
            positions[n:] = np.minimum(positions[n:], cap - 1)  # pads: continue the document, clamped to S - 1
            out["position_ids"][b, off : off + slot] = positions
            out["document_ids"][b, off : off + slot] = doc
            cost[b, off : off + n] = np.arange(1, n + 1)
            seq_lens.append(n)
            seq_lens_padded.append(slot)
            doc += 1
            off += slot
    out["cu_seqlens"] = np.cumsum([0, *seq_lens]).astype(np.int32)
    out["cu_seqlens_padded"] = np.cumsum([0, *seq_lens_padded]).astype(np.int32)
    out["seq_lens"] = np.asarray(seq_lens, dtype=np.int32)
    out["seq_lens_padded"] = np.asarray(seq_lens_padded, dtype=np.int32)
    out["max_seqlen"] = np.asarray(max(seq_lens, default=0), dtype=np.int32)
    return out, cost


def reference_digest(plans: list[PackPlan], layout: str, cp: int) -> int:
    """The plan digest, one piece at a time (provenance and evenly spaced sampled ids); several plans:
    blake2b over their digests."""
    digests = []
    for plan in plans:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{layout}|{cp}|{plan.capacity}|{plan.index}".encode())
        h.update(np.asarray(plan.slot_lens, dtype=np.int64).tobytes())
        meta = []
        for q in plan.pieces:
            ids = np.asarray(q.arrays["input_ids"])
            k = ids.size
            samples = [int(ids[j * (k - 1) // (DIGEST_SAMPLES - 1)]) if k else -1 for j in range(DIGEST_SAMPLES)]
            meta.append((q.index, q.start, k, q.next_label, *samples))
        h.update(np.asarray(meta, dtype=np.int64).reshape(-1, 4 + DIGEST_SAMPLES).tobytes())
        digests.append(int.from_bytes(h.digest(), "little") & ((1 << 63) - 1))
    if len(digests) == 1:
        return digests[0]
    h = hashlib.blake2b(np.asarray(digests, dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def reference_batches(plans: list[PackPlan], layout: str, cp: int, qkv_format: str, pad: int) -> list[dict]:
    """Per rank: ``tensors`` (ordered), ``rows``, ``inverse``, layout fields and ``info``."""
    full, cost = reference_full(plans, pad)
    b_rows, cap = len(plans), plans[0].capacity
    if qkv_format == "thd":
        lens = [s for p in plans[:-1] for s in _slots(p, absorb=True)] + _slots(plans[-1], absorb=False)
        stream_len = b_rows * cap
    else:
        lens, stream_len = _slots(plans[0], absorb=False), cap
    rows = reference_rows(layout, cp, lens, stream_len)
    inverse = np.argsort(rows.reshape(-1), kind="stable")
    flat_cost = cost.reshape(-1) if qkv_format == "thd" else cost
    info = {
        "pack_indices": [p.index for p in plans],
        "real_tokens": int(full["seq_lens"].sum()),
        "pack_tokens": b_rows * cap,
        "n_targets": int((full["labels"] != IGNORE_INDEX).sum()),
        "n_documents": sum(len(p.pieces) for p in plans),
        "causal_work": [float(flat_cost[..., rows[r]].sum()) for r in range(cp)],
        "digest": reference_digest(plans, layout, cp),
    }
    out = []
    for r in range(cp):
        tensors = {}
        for k, v in full.items():
            if k in METADATA_KEYS:
                tensors[k] = v
            else:
                tensors[k] = v.reshape(-1)[rows[r]] if qkv_format == "thd" else v[:, rows[r]]
        out.append({"tensors": tensors, "rows": rows[r], "inverse": inverse, "stream_len": stream_len,
                    "row_shape": (b_rows, cap) if qkv_format == "thd" else None, "info": info})  # fmt: skip
    return out


def assert_bit_identical(shards, expected: list[dict]) -> None:
    assert len(shards) == len(expected)
    for r, (batch, want) in enumerate(zip(shards, expected, strict=True)):
        assert list(batch.keys()) == list(want["tensors"]), (list(batch.keys()), list(want["tensors"]))
        for k, v in want["tensors"].items():
            got = batch[k].numpy()
            assert got.dtype == v.dtype and got.shape == v.shape, (r, k, got.dtype, v.dtype, got.shape, v.shape)
            np.testing.assert_array_equal(got, v, err_msg=f"rank {r} key {k}")
        lay = batch.layout
        assert lay.local_token_global_indices.dtype == torch.int64 and lay.gather_index.dtype == torch.int64
        np.testing.assert_array_equal(lay.local_token_global_indices.numpy(), want["rows"], err_msg=f"rows {r}")
        np.testing.assert_array_equal(lay.gather_index.numpy(), want["inverse"], err_msg="inverse")
        assert (lay.cp_size, lay.cp_rank, lay.padded_seq_len, lay.input_row_shape) == (
            len(expected), r, want["stream_len"], want["row_shape"])  # fmt: skip
        assert lay.original_seq_len is None and lay.input_token_stream_positions is None
        assert lay.digest == want["info"]["digest"]
        assert {k: batch.info[k] for k in want["info"]} == want["info"]


def shard_all(plans: list[PackPlan], layout: str, cp: int, qkv_format: str, batch_size: int, pad: int):
    node = ShardForRank(
        Collate(IterableWrapper(plans), batch_size=batch_size, qkv_format=qkv_format, padding_token_id=pad),
        cp_size=cp, cp_rank=0, layout=layout, all_ranks=True,
    )  # fmt: skip
    node.reset()
    return list(node)


def check_stream(plans, layout, cp, qkv_format, batch_size, pad=0) -> None:
    batches = shard_all(plans, layout, cp, qkv_format, batch_size, pad)
    assert len(batches) == -(-len(plans) // batch_size)
    for i, shards in enumerate(batches):
        group = plans[i * batch_size : (i + 1) * batch_size]
        assert_bit_identical(shards, reference_batches(group, layout, cp, qkv_format, pad))


# ---------------------------------------------------------------------------------------------------- inputs
def large_plans(
    rng: np.random.Generator, *, layout: str, cp: int, capacity: int, n_plans: int, extras: bool, labels: float
) -> list[PackPlan]:
    """Plans of SFT-like documents (median ~600 tokens, some longer than the pack) cut into pieces.

    A document that does not fit the pack's room is split: the piece fills the
    room (rounded down to the document multiple), the rest opens the next pack
    with a non-zero start and the cut piece's target continues into it. Some
    packs keep a tail of padding; the second pack is empty.
    """
    dm, _ = alignment(layout, cp)
    plans, index, rest = [], 0, None
    for b in range(n_plans):
        pieces, slots, used = [], [], 0
        tail = int(rng.integers(0, capacity // 16)) if b % 2 else 0
        while b != 1:
            if rest is None:
                n = int(min(rng.lognormal(6.3, 0.9), 3 * capacity)) + 1
                rest = (index, 0, rng.integers(0, 32000, size=n, dtype=np.int64))
                index += 1
            doc_index, start, doc = rest
            room = capacity - tail - used
            left = doc.size - start
            take = left if -(-left // dm) * dm <= room else room - room % dm
            if take <= 0:
                break
            piece_ids = doc[start : start + take]
            arrays = {"input_ids": piece_ids}
            if extras:
                arrays["token_type"] = (piece_ids % 5).astype(np.int32)
                arrays["weight"] = (piece_ids % 7 / 7).astype(np.float32)
                if rng.random() < 0.5:  # the other pieces' loss mask derives from their labels
                    arrays["loss_mask"] = (piece_ids % 4 != 0).astype(np.int8)
            if rng.random() < labels:
                arrays["labels"] = np.where(piece_ids % 3 == 0, IGNORE_INDEX, piece_ids)
            cont = start + take < doc.size
            pieces.append(DocPiece(index=doc_index, start=start, arrays=arrays,
                                   next_label=int(doc[start + take]) if cont else IGNORE_INDEX))  # fmt: skip
            slots.append(-(-take // dm) * dm)
            used += slots[-1]
            rest = (doc_index, start + take, doc) if cont else None
        plans.append(PackPlan(pieces=tuple(pieces), slot_lens=np.asarray(slots, dtype=np.int64),
                              capacity=capacity, index=b))  # fmt: skip
    assert any(q.start > 0 for p in plans for q in p.pieces), "no split document: the case would pass vacuously"
    return plans


def _capacity(capacity: int, layout: str, cp: int) -> int:
    pack_multiple = alignment(layout, cp)[1]
    return capacity - capacity % pack_multiple


SIZED = [("identity", 1, 8192, "thd", 2)]
SIZED += [(layout, cp, 8192, "thd", 2) for layout in ("contiguous", "round_robin", "thd", "balanced")
          for cp in range(1, 9)]  # fmt: skip
SIZED += [(layout, 4, 32768, "bshd", 1) for layout in ("contiguous", "round_robin", "thd", "balanced")]
SIZED += [("contiguous", 3, 32768, "bshd", 2), ("round_robin", 5, 32768, "bshd", 2)]
SIZED += [("thd", 8, 131072, "thd", 1), ("balanced", 3, 131072, "thd", 1), ("balanced", 8, 131072, "bshd", 1)]
SIZED += [("tiled", 4, 32768, "bshd", 1), ("tiled:256", 2, 8192, "thd", 2), ("tiled:64", 8, 131072, "thd", 1)]


@pytest.mark.parametrize(("layout", "cp", "capacity", "qkv_format", "batch_size"), SIZED)
def test_batches_equal_the_reference_at_training_sizes(layout, cp, capacity, qkv_format, batch_size):
    capacity = _capacity(capacity, layout, cp)
    rng = np.random.default_rng(capacity + cp)
    plans = large_plans(rng, layout=layout, cp=cp, capacity=capacity, n_plans=3,
                        extras=cp % 2 == 0, labels=0.3)  # fmt: skip
    check_stream(plans, layout, cp, qkv_format, batch_size, pad=cp)


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_small_random_plans_equal_the_reference(layout, qkv_format):
    for cp in (1,) if layout == "identity" else range(1, 9):
        doc_multiple, pack_multiple = alignment(layout, cp)
        for seed in range(2):
            rng = np.random.default_rng(seed * 10 + cp)
            capacity = pack_multiple * int(rng.integers(1, 5)) * (1 + 48 // pack_multiple)
            plans, _ = make_plans(rng, n_plans=5, capacity=capacity, doc_multiple=doc_multiple, max_docs=6,
                                  extras=seed == 1, given_labels=0.3)  # fmt: skip
            dynamic = layout_depends_on_documents(layout, cp)
            batch_size = 1 if qkv_format == "bshd" and dynamic else 1 + seed
            check_stream(plans, layout, cp, qkv_format, batch_size, pad=seed)


@pytest.mark.parametrize(("layout", "cp"), [("thd", 4), ("balanced", 3), ("round_robin", 2)])
def test_the_pipeline_from_documents_equals_the_reference(layout, cp):
    rng = np.random.default_rng(cp)
    lengths = [20000 if i % 40 == 7 else int(rng.lognormal(6.3, 1.0)) + 1 for i in range(160)]  # some split
    docs = []
    for n in lengths:
        ids = rng.integers(0, 32000, size=n, dtype=np.int64)
        docs.append({"input_ids": ids, "token_type": (ids % 4).astype(np.int16)})
    capacity = _capacity(16384, layout, cp)
    collate = shard_graph(docs, GraphOptions(capacity=capacity, cp_size=cp, layout=layout, qkv_format="thd", batch_size=2, plan=StreamPlan(overflow="split")))  # fmt: skip
    collate.reset()
    collated = list(collate)
    plans = [p for c in collated for p in c.plans]
    assert any(q.start > 0 for p in plans for q in p.pieces)
    check_stream(plans, layout, cp, "thd", 2, pad=0)


@settings(max_examples=150, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS), cp=st.integers(1, 8), units=st.lists(st.integers(0, 40), max_size=9),
    tail=st.integers(0, 50), short=st.lists(st.integers(0, 3), min_size=9, max_size=9),
)  # fmt: skip
def test_run_tables_equal_the_reference(layout, cp, units, tail, short):
    cp = 1 if layout == "identity" else cp
    doc_multiple, pack_multiple = alignment(layout, cp)
    lens = [u * doc_multiple for u in units]
    pack_len = sum(lens) + tail * pack_multiple
    pack_len += (-pack_len) % pack_multiple
    table = layout_runs(layout, cp, lens, pack_len)
    want = reference_rows(layout, cp, lens, pack_len)
    np.testing.assert_array_equal(table.rows(), want)
    for r in range(cp):
        np.testing.assert_array_equal(table.row(r), want[r])
    np.testing.assert_array_equal(table.inverse(), np.argsort(want.reshape(-1), kind="stable"))
    if table.lens is None:
        return
    slots = np.diff(np.append(table.doc_starts, sum(lens) if layout == "balanced" else pack_len))
    real = np.maximum(slots - np.asarray(short[: slots.size], dtype=np.int64), 0)
    positions = np.full(pack_len, -1)
    for start, n in zip(table.doc_starts.tolist(), real.tolist(), strict=True):
        positions[start : start + n] = np.arange(n)
    block = layout_run_block(layout, cp, [np.asarray(lens, dtype=np.int64)], pack_len)
    np.testing.assert_array_equal(block.causal_work(real), causal_work(want, positions)[None])


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(["tiled", "tiled:64", "world", "world:2"]), cp=st.sampled_from([2, 4]),
    packs=st.lists(st.lists(st.integers(0, 300), max_size=6), min_size=1, max_size=4), short=st.integers(0, 5),
)  # fmt: skip
def test_span_blocks_of_several_packs_equal_the_reference_pack_by_pack(layout, cp, packs, short):
    """``tiled`` and ``world`` blocks of several packs (empty ones included): every pack's rows, inverse and
    causal work equal the reference of that pack alone."""
    multiple = alignment(layout, cp)[1]
    pack_len = -(-max(1, *(sum(p) for p in packs)) // multiple) * multiple
    arrays = [np.asarray(p, dtype=np.int64) for p in packs]
    block = layout_run_block(layout, cp, arrays, pack_len)
    real = [np.maximum(a - short, 0) for a in arrays]
    work = block.causal_work(np.concatenate(real))
    assert block.doc_counts() == [len(p) for p in packs] and work.shape == (len(packs), cp)
    for lens, r, table, w in zip(packs, real, block.tables(), work, strict=True):
        want = reference_rows(layout, cp, lens, pack_len)
        np.testing.assert_array_equal(table.rows(), want)
        np.testing.assert_array_equal(table.inverse(), np.argsort(want.reshape(-1), kind="stable"))
        positions = np.full(pack_len, -1)
        for start, n in zip(np.cumsum([0, *lens])[:-1].tolist(), r.tolist(), strict=True):
            positions[start : start + n] = np.arange(n)
        np.testing.assert_array_equal(w, causal_work(want, positions))
    if any(r.sum() for r in real):
        assert work.sum() > 0


@pytest.mark.parametrize(("layout", "cp", "algorithm", "overflow"),
                         [("thd", 4, "bfd", "split"), ("balanced", 3, "next_fit", "truncate"),
                          ("round_robin", 2, "first_fit", "split")])  # fmt: skip
def test_the_pipeline_with_labels_masks_and_small_windows_equals_the_reference(layout, cp, algorithm, overflow):
    """Packs gathered from their window's token buffer (many small windows, so buffers are handed out
    again while earlier packs are still held; pieces carried across windows copied to the one emitting them),
    labels and masks on some documents, truncated pieces (their packs concatenate their own buffer), and
    the same plans unpickled, without buffers."""
    rng = np.random.default_rng(cp + 10)
    docs = []
    for i in range(240):
        n = 9000 if i % 37 == 5 else int(rng.lognormal(5.5, 1.0)) + 1
        ids = rng.integers(0, 32000, size=n, dtype=np.int64)
        doc = {"input_ids": ids, "token_type": (ids % 4).astype(np.int16)}
        if i % 3 == 0:
            targets = np.append(ids[1:], IGNORE_INDEX)  # labels_alignment="targets": the next token, some masked
            doc["labels"] = np.where(targets % 5 == 0, IGNORE_INDEX, targets)
        if i % 4 == 1:
            doc["loss_mask"] = (ids % 3 != 0).astype(np.int8)
        docs.append(doc)
    capacity = _capacity(4096, layout, cp)
    collate = shard_graph(docs, GraphOptions(capacity=capacity, cp_size=cp, layout=layout, qkv_format="thd", batch_size=1, plan=StreamPlan(overflow=overflow, algorithm=algorithm, window=12), data=DataPolicy(labels_alignment="targets")))  # fmt: skip
    collate.reset()
    plans = [p for c in list(collate) for p in c.plans]  # every pack held while later windows are read
    in_buffer = [p.piece_columns.buffer is not None for p in plans]
    assert any(in_buffer) and len({id(p.piece_columns.buffer) for p in plans}) > 4, "no window buffer reused"
    assert all(in_buffer) == (overflow != "truncate")
    assert any("labels" in q.arrays for p in plans for q in p.pieces)
    check_stream(plans, layout, cp, "thd", 1, pad=5)
    check_stream(pickle.loads(pickle.dumps(plans)), layout, cp, "thd", 1, pad=5)  # no buffer: pieces concatenated
