"""Collate against a per-token brute-force reference; collate_rank against the full pack."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpdata.layout.maps import LAYOUTS, alignment, rank_indices, thd_slot_lens
from cpdata.nodes.loader import shard_graph
from cpdata.worker.collate import collate_pack, collate_rank, fill_rank, rank_specs
from cpdata.worker.keys import METADATA_KEYS
from cpdata.worker.plan import DocPiece, PackPlan
from cpdata.worker.stream import build_streams
from cpdata.worker.stream_slots import pack_metadata, slot_block
from tests.flat_options import graph_options


def make_plans(
    rng: np.random.Generator,
    *,
    n_plans: int,
    capacity: int,
    doc_multiple: int = 1,
    max_docs: int = 5,
    extras: bool = False,
    given_labels: float = 0.0,
    vocab: int = 1000,
) -> tuple[list[PackPlan], dict[int, np.ndarray]]:
    """Random plans cut from random documents, plus the documents (by index) for reference checks.

    Pieces start mid-document and continue into the next document with
    probability 1/3 each, so next_label and non-zero starts both occur.
    """
    plans, docs = [], {}
    index = 0
    for b in range(n_plans):
        pieces, slots, used = [], [], 0
        for _ in range(int(rng.integers(0, max_docs + 1))):
            room = capacity - used
            n = int(rng.integers(1, 40))
            slot = -(-n // doc_multiple) * doc_multiple
            if slot > room:
                break
            start = int(rng.integers(1, 20)) if rng.random() < 1 / 3 else 0
            more = int(rng.integers(1, 20)) if rng.random() < 1 / 3 else 0
            doc = rng.integers(0, vocab, size=start + n + more, dtype=np.int64)
            docs[index] = doc
            arrays = {"input_ids": doc[start : start + n]}
            if extras:
                arrays["loss_mask"] = (rng.random(n) < 0.8).astype(np.float32)
                arrays["token_type"] = rng.integers(1, 5, size=n).astype(np.int32)
            if rng.random() < given_labels:
                arrays["labels"] = rng.integers(0, vocab, size=n, dtype=np.int64)
            next_label = int(doc[start + n]) if more else -100
            pieces.append(DocPiece(index=index, start=start, arrays=arrays, next_label=next_label))
            slots.append(slot)
            used += slot
            index += 1
        plans.append(
            PackPlan(pieces=tuple(pieces), slot_lens=np.asarray(slots, dtype=np.int64), capacity=capacity, index=b)
        )
    return plans, docs


def reference(plans: list[PackPlan], pad: int, qkv_format: str) -> dict[str, np.ndarray]:
    """One token at a time, straight from the definitions."""
    capacity = plans[0].capacity
    extra_keys = sorted({k for p in plans for q in p.pieces for k in q.arrays} - {"input_ids", "labels"})
    cols = {k: [] for k in ["input_ids", "labels", "position_ids", "padding_mask", "document_ids", *extra_keys]}
    seq_lens, seq_lens_padded = [], []
    doc = 0
    for plan in plans:
        slots = thd_slot_lens(plan.slot_lens, capacity)
        pieces = plan.pieces if plan.pieces else [None] * len(slots)
        for piece, slot in zip(pieces, slots, strict=True):
            n = piece.length if piece else 0
            seq_lens.append(n)
            seq_lens_padded.append(int(slot))
            for off in range(int(slot)):
                real = off < n
                ids = piece.arrays["input_ids"] if piece else None
                if real and "labels" in piece.arrays:
                    label = int(piece.arrays["labels"][off])
                elif real:
                    label = int(ids[off + 1]) if off + 1 < n else piece.next_label
                else:
                    label = -100
                cols["input_ids"].append(int(ids[off]) if real else pad)
                cols["labels"].append(label)
                cols["position_ids"].append((piece.start if piece else 0) + off)
                cols["padding_mask"].append(not real)
                cols["document_ids"].append(doc)
                for k in extra_keys:
                    cols[k].append(piece.arrays[k][off] if real else 0)
            doc += 1
    shape = (len(plans), capacity) if qkv_format == "bshd" else (len(plans) * capacity,)
    out = {k: np.asarray(v).reshape(shape) for k, v in cols.items()}
    cu = np.concatenate([[0], np.cumsum(seq_lens)])
    cu_p = np.concatenate([[0], np.cumsum(seq_lens_padded)])
    out.update(
        cu_seqlens=cu, cu_seqlens_padded=cu_p, seq_lens=np.asarray(seq_lens),
        seq_lens_padded=np.asarray(seq_lens_padded), max_seqlen=np.asarray(max(seq_lens, default=0)),
    )  # fmt: skip
    return out


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert got[k].shape == np.asarray(want[k]).shape, k


EXPECTED_DTYPES = {
    "input_ids": np.int64, "labels": np.int64, "position_ids": np.int64, "padding_mask": np.bool_,
    "document_ids": np.int64, "cu_seqlens": np.int32, "cu_seqlens_padded": np.int32, "seq_lens": np.int32,
    "seq_lens_padded": np.int32, "max_seqlen": np.int32, "loss_mask": np.float32, "token_type": np.int32,
}  # fmt: skip


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
@pytest.mark.parametrize("seed", range(6))
def test_collate_pack_matches_reference(seed, qkv_format):
    rng = np.random.default_rng(seed)
    plans, _ = make_plans(rng, n_plans=1 + seed % 3, capacity=96, doc_multiple=1 + seed % 4, extras=seed % 2 == 1,
                          given_labels=0.3)  # fmt: skip
    got = collate_pack(plans, padding_token_id=7, qkv_format=qkv_format)
    assert_same(got, reference(plans, 7, qkv_format))
    for k, v in got.items():
        assert v.dtype == EXPECTED_DTYPES[k], (k, v.dtype)
    assert_same(pack_metadata(plans), {k: got[k] for k in METADATA_KEYS})
    assert got["cu_seqlens_padded"][-1] == len(plans) * 96  # the tail is absorbed


def test_worked_example():
    ids = [np.array([11, 12, 13]), np.array([21, 22])]
    plan = PackPlan(
        pieces=(DocPiece(index=0, start=0, arrays={"input_ids": ids[0]}),
                DocPiece(index=1, start=4, arrays={"input_ids": ids[1]}, next_label=23)),
        slot_lens=np.array([4, 2]), capacity=8,
    )  # fmt: skip
    out = collate_pack([plan], padding_token_id=0)
    np.testing.assert_array_equal(out["input_ids"], [[11, 12, 13, 0, 21, 22, 0, 0]])
    np.testing.assert_array_equal(out["labels"], [[12, 13, -100, -100, 22, 23, -100, -100]])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(out["document_ids"], [[0, 0, 0, 0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(out["padding_mask"], [[0, 0, 0, 1, 0, 0, 1, 1]])
    np.testing.assert_array_equal(out["cu_seqlens"], [0, 3, 5])
    np.testing.assert_array_equal(out["cu_seqlens_padded"], [0, 4, 8])
    assert out["max_seqlen"] == 3 and out["max_seqlen"].shape == ()


def test_labels_never_cross_documents_and_positions_restart():
    rng = np.random.default_rng(1)
    plans, docs = make_plans(rng, n_plans=40, capacity=64, max_docs=4)
    out = collate_pack(plans, qkv_format="thd")
    real = ~out["padding_mask"]
    doc_index = np.repeat([p.index for plan in plans for p in plan.pieces],
                          [p.length for plan in plans for p in plan.pieces])  # fmt: skip
    positions = out["position_ids"][real]
    labels = out["labels"][real]
    ends = continues = 0
    for d, pos, label in zip(doc_index.tolist(), positions.tolist(), labels.tolist(), strict=True):
        doc = docs[d]
        if pos + 1 < len(doc):
            assert label == doc[pos + 1]
            continues += 1
        else:
            assert label == -100, "a target crossed a document end"
            ends += 1
    slot_starts = [p.start if p else 0 for plan in plans for p in (plan.pieces or [None])]
    pos_at_slot_start = out["position_ids"][out["cu_seqlens_padded"][:-1]]
    np.testing.assert_array_equal(pos_at_slot_start, slot_starts)
    fresh = np.array(slot_starts) == 0
    assert fresh.sum() > 0 and (~fresh).sum() > 0 and ends > 0 and continues > 0  # not vacuous
    assert (out["position_ids"][out["cu_seqlens_padded"][:-1][fresh]] == 0).all()  # restart at every new document


def _aligned_plans(data, layout: str, cp: int, n_plans: int):
    doc_multiple, pack_multiple = alignment(layout, cp)
    capacity = pack_multiple * data.draw(st.integers(1, 64 // pack_multiple + 2))
    seed = data.draw(st.integers(0, 2**32 - 1))
    plans, _ = make_plans(np.random.default_rng(seed), n_plans=n_plans, capacity=capacity,
                          doc_multiple=doc_multiple, extras=data.draw(st.booleans()), given_labels=0.2)  # fmt: skip
    return plans


def _rows(layout, cp, plans, qkv_format):
    if qkv_format == "thd":
        return rank_indices(layout, cp, slot_block([plans]).layout_lens_of(0), len(plans) * plans[0].capacity)
    return rank_indices(layout, cp, plans[0].slot_lens, plans[0].capacity)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), layout=st.sampled_from(LAYOUTS), cp=st.integers(1, 8), qkv_format=st.sampled_from(["bshd", "thd"]))
def test_collate_rank_equals_full_pack_columns(data, layout, cp, qkv_format):
    if layout == "identity":
        cp = 1
    plans = _aligned_plans(data, layout, cp, n_plans=data.draw(st.integers(1, 3)))
    full = collate_pack(plans, padding_token_id=3, qkv_format=qkv_format)
    rows = _rows(layout, cp, plans, qkv_format)
    shards = [collate_rank(plans, rows[r], padding_token_id=3, qkv_format=qkv_format) for r in range(cp)]
    for r in range(cp):
        for k, v in full.items():
            want = v if k in METADATA_KEYS else v[..., rows[r]]
            got = shards[r][k]
            assert got.dtype == want.dtype and got.shape == want.shape, k
            assert np.array_equal(got, want), k
    # Every real token lands on exactly one rank.
    tokens = []
    for r in range(cp):
        s = shards[r]
        real = ~s["padding_mask"]
        tokens += list(zip(s["document_ids"][real].tolist(), s["position_ids"][real].tolist(), strict=True))
    want_tokens = [(d, p) for d, p in zip(full["document_ids"][~full["padding_mask"]].tolist(),
                                          full["position_ids"][~full["padding_mask"]].tolist(), strict=True)]  # fmt: skip
    assert sorted(tokens) == sorted(want_tokens)
    assert len(set(tokens)) == len(tokens)


def test_collate_rank_arbitrary_positions():
    rng = np.random.default_rng(5)
    plans, _ = make_plans(rng, n_plans=2, capacity=50, extras=True)
    full = collate_pack(plans, qkv_format="thd")
    picks = rng.permutation(100)[:37]
    got = collate_rank(plans, picks, qkv_format="thd")
    for k in ("input_ids", "labels", "position_ids", "padding_mask", "document_ids", "loss_mask", "token_type"):
        np.testing.assert_array_equal(got[k], full[k][picks])


def test_empty_pack_is_one_padding_slot():
    empty = PackPlan(pieces=(), slot_lens=np.zeros(0, dtype=np.int64), capacity=8, index=0)
    out = collate_pack([empty], padding_token_id=9)
    assert (out["input_ids"] == 9).all() and out["padding_mask"].all() and (out["labels"] == -100).all()
    np.testing.assert_array_equal(out["cu_seqlens_padded"], [0, 8])
    np.testing.assert_array_equal(out["cu_seqlens"], [0, 0])


def test_errors():
    rng = np.random.default_rng(0)
    plans, _ = make_plans(rng, n_plans=2, capacity=64, max_docs=3)
    with pytest.raises(ValueError, match="qkv_format"):
        collate_pack(plans, qkv_format="sbhd")
    other = PackPlan(pieces=(), slot_lens=np.zeros(0, dtype=np.int64), capacity=32)
    with pytest.raises(ValueError, match="same capacity"):
        collate_pack([plans[0], other])
    with pytest.raises(TypeError, match="single PackPlan"):
        collate_pack(plans[0])
    with pytest.raises(ValueError, match="rows_r must lie in"):
        collate_rank(plans, np.array([0, 64]), qkv_format="bshd")
    piece = DocPiece(index=0, start=0, arrays={"input_ids": np.arange(5)})
    with pytest.raises(ValueError, match="slot only"):
        collate_pack([PackPlan(pieces=(piece,), slot_lens=np.array([4]), capacity=8)])
    odd = DocPiece(index=1, start=0, arrays={"input_ids": np.arange(2), "token_type": np.ones(2)})
    with pytest.raises(ValueError, match="token_type"):
        collate_pack([PackPlan(pieces=(piece, odd), slot_lens=np.array([5, 2]), capacity=8)])


def test_batch_checks_name_the_plan_and_piece():
    """The slot checks run over the whole batch at once and still name the first bad plan and piece."""
    five = DocPiece(index=0, start=0, arrays={"input_ids": np.arange(5)})
    good = PackPlan(pieces=(five,), slot_lens=np.array([6]), capacity=8, index=3)
    empty = PackPlan(pieces=(), slot_lens=np.zeros(0, dtype=np.int64), capacity=8, index=4)
    short = PackPlan(pieces=(five, five), slot_lens=np.array([5, 4]), capacity=16, index=7)
    with pytest.raises(ValueError, match="plan 7: piece 1 has 5 tokens but its slot only 4"):
        pack_metadata([dataclasses.replace(good, capacity=16), dataclasses.replace(empty, capacity=16), short])
    over = PackPlan(pieces=(five, five), slot_lens=np.array([5, 5]), capacity=8, index=2)
    with pytest.raises(ValueError, match="sum to 10 tokens, more than pack_len=8"):
        collate_pack([good, over])
    by_one = dataclasses.replace(over, capacity=9, index=5)  # one token over: refused as well
    with pytest.raises(ValueError, match="sum to 10 tokens, more than pack_len=9"):
        collate_pack([dataclasses.replace(good, capacity=9), by_one])
    with pytest.raises(ValueError, match=r"plan 3: slot_lens has shape \(2,\), expected \(1,\)"):
        pack_metadata([dataclasses.replace(good, slot_lens=np.array([6, 2]))])
    meta = pack_metadata([good, empty, good])  # an empty pack inside a batch: one padding slot
    np.testing.assert_array_equal(meta["seq_lens_padded"], [8, 8, 8])
    np.testing.assert_array_equal(meta["seq_lens"], [5, 0, 5])
    np.testing.assert_array_equal(slot_block([[good, empty, good]]).layout_lens_of(0), [8, 8, 6])
    np.testing.assert_array_equal(slot_block([[good, empty]]).layout_lens_of(0), [8])


def test_a_missing_loss_mask_is_derived_from_the_labels():
    """Pieces from a source without masks mix with masked ones: their loss_mask is labels != -100."""
    plain = DocPiece(index=0, start=0, arrays={"input_ids": np.array([5, 6, 7])})
    masked = DocPiece(index=1, start=0, arrays={"input_ids": np.array([8, 9]), "labels": np.array([9, -100]),
                                                "loss_mask": np.array([1, 0], dtype=np.int8)})
    plan = PackPlan(pieces=(plain, masked), slot_lens=np.array([3, 2]), capacity=8)
    full = collate_pack([plan])
    assert full["labels"][0].tolist() == [6, 7, -100, 9, -100, -100, -100, -100]
    assert full["loss_mask"][0].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert full["loss_mask"].dtype == np.int8
    rank = collate_rank([plan], np.array([7, 2, 0, 3]))
    assert rank["loss_mask"][0].tolist() == [0, 0, 1, 1]


def test_pad_positions_stay_below_the_capacity():
    """A pack whose piece continues a document (start 7) has pads clamped to capacity - 1, as torchtune does."""
    piece = DocPiece(index=0, start=3, arrays={"input_ids": np.arange(7)})
    plan = PackPlan(pieces=(piece,), slot_lens=np.array([8]), capacity=10)
    full = collate_pack([plan])
    assert full["position_ids"][0].tolist() == [3, 4, 5, 6, 7, 8, 9, 9, 9, 9]
    assert full["padding_mask"][0].tolist() == [False] * 7 + [True] * 3
    rank = collate_rank([plan], np.array([9, 6, 7]))
    assert rank["position_ids"][0].tolist() == [9, 9, 9]
    thd = collate_pack([plan, plan], qkv_format="thd")
    assert thd["position_ids"].max() == 9


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_fill_rank_takes_rows_in_any_order(qkv_format):
    """Increasing rows (a layout's) take the segment path; any other order is sorted first and put back:
    both equal the full pack's columns, with and without the clamp of pad position ids."""
    rng = np.random.default_rng(11)
    plans, _ = make_plans(rng, n_plans=3, capacity=48, extras=True, given_labels=0.3)
    full = collate_pack(plans, padding_token_id=7, qkv_format=qkv_format)
    stream = build_streams([(plans, 7)]).streams[0]
    bare = dataclasses.replace(stream, pads_pass_end=True)  # clamping when no pad passes S - 1 changes nothing
    n = 48 if qkv_format == "bshd" else 3 * 48
    increasing = np.sort(rng.choice(n, 20, replace=False)).astype(np.int64)
    for rows, flag in ((increasing, True), (increasing, None), (rng.permutation(n)[:20], None),
                       (np.repeat(increasing[:5], 2), None)):  # fmt: skip
        for s in (stream, bare):
            specs = rank_specs(s, rows.shape[0], qkv_format)
            out = {key: np.empty(shape, dtype=dt) for key, (shape, dt) in specs.items()}
            fill_rank(s, rows, qkv_format, out, increasing=flag)
            for key, want in full.items():
                np.testing.assert_array_equal(out[key], want if key in METADATA_KEYS else want[..., rows], key)


def test_rank_outputs_may_be_strided_views():
    rng = np.random.default_rng(12)
    plans, _ = make_plans(rng, n_plans=2, capacity=40, extras=True)
    full = collate_pack(plans, qkv_format="thd")
    stream = build_streams([(plans, 0)]).streams[0]
    rows = np.arange(3, 80, 3, dtype=np.int64)
    specs = rank_specs(stream, rows.shape[0], "thd")
    out = {key: np.zeros((2 * shape[0],) if shape else (), dtype=dt)[::2] if shape else np.zeros((), dtype=dt)
           for key, (shape, dt) in specs.items()}  # fmt: skip
    fill_rank(stream, rows, "thd", out)
    for key, want in full.items():
        np.testing.assert_array_equal(out[key], want if key in METADATA_KEYS else want[rows], key)


def test_only_pad_positions_are_clamped():
    """A piece continuing a long document has real position ids past the capacity (kept) and pads after
    them (clamped to capacity - 1); the other pack of the stream needs no clamp."""
    long = DocPiece(index=0, start=20, arrays={"input_ids": np.arange(5)})
    short = DocPiece(index=1, start=0, arrays={"input_ids": np.arange(3)})
    plans = [PackPlan(pieces=(long,), slot_lens=np.array([8]), capacity=10),
             PackPlan(pieces=(short,), slot_lens=np.array([4]), capacity=10)]  # fmt: skip
    assert build_streams([(plans, 0)]).streams[0].pads_pass_end
    assert not build_streams([(plans[1:], 0)]).streams[0].pads_pass_end
    full = collate_pack(plans, qkv_format="thd")
    assert full["position_ids"].tolist() == [20, 21, 22, 23, 24, 9, 9, 9, 9, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    rank = collate_rank(plans, np.array([3, 4, 5, 12, 19]), qkv_format="thd")
    assert rank["position_ids"].tolist() == [23, 24, 9, 2, 9]
    assert rank["padding_mask"].tolist() == [False, False, True, False, True]


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_pad_position_ids_are_clamped_from_the_first_one_past_the_capacity(qkv_format):
    """A piece continuing its document at ``start`` counts on from there: its pads reach ``start + S - 1``,
    clamped to ``S - 1`` from the first that would pass it (start 1: only the last pad), never before."""
    capacity, n = 10, 7
    for start in range(4):
        piece = DocPiece(index=0, start=start, arrays={"input_ids": np.arange(n)})
        plan = PackPlan(pieces=(piece,), slot_lens=np.array([n]), capacity=capacity)
        want = [start + off if off < n else min(start + off, capacity - 1) for off in range(capacity)]
        full = collate_pack([plan, plan], qkv_format=qkv_format)
        assert full["position_ids"].reshape(-1).tolist() == want * 2, start
        pads = np.arange(n, capacity if qkv_format == "bshd" else 2 * capacity)
        rank = collate_rank([plan, plan], pads, qkv_format=qkv_format)
        np.testing.assert_array_equal(rank["position_ids"], full["position_ids"][..., pads])


def test_a_batch_keeps_the_dtypes_of_its_own_pieces_whatever_its_window_holds():
    """One packing window holds int8 and float32 ``token_type`` documents (its buffer holds them promoted, as
    float32); a batch of int8 documents alone is int8 still, a batch with a float32 one float32: each equals
    its documents' values in their promoted dtype, as collated from the pieces alone."""
    rng = np.random.default_rng(5)
    dtypes = [np.int8, np.int8, np.float32, np.int8]
    docs = [{"input_ids": rng.integers(1, 50, 6), "token_type": rng.integers(0, 3, 6).astype(dt)} for dt in dtypes]
    node = shard_graph(docs, graph_options(capacity=8, cp_size=1, layout="identity", algorithm="next_fit"))
    node.reset()
    batches = list(node)
    assert len(batches) == len(docs), "one document per batch, all read in one window"
    for batch in batches:
        (plan,) = batch.plans
        (piece,) = plan.pieces
        doc = docs[piece.index]
        alone = PackPlan(pieces=(DocPiece(index=0, start=0, arrays=dict(doc)),), slot_lens=plan.slot_lens, capacity=8)
        want = collate_pack([alone])["token_type"]
        got = batch.tensors()["token_type"]
        assert got.dtype == want.dtype == doc["token_type"].dtype
        np.testing.assert_array_equal(got, want)
    assert {batch.tensors()["token_type"].dtype for batch in batches} == {np.dtype(np.int8), np.dtype(np.float32)}
