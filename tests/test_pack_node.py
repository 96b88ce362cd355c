"""Pack node: plans match the offline planner, pieces match the documents, exact resume."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from state_contract import assert_items_equal, run_save_load_contract
from torchdata.nodes import IterableWrapper

from cpdata.nodes.pack import Pack
from cpdata.nodes.source import Documents
from cpdata.packing import ALGORITHMS, WINDOW_PACKS, plan_lengths
from cpdata.packing.planner import window_ends
from cpdata.worker.plan import PackPlan


def _docs(n: int, max_len: int = 90, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(0, max_len))
        ids = rng.integers(0, 1000, k)
        out.append({"input_ids": ids, "labels": np.roll(ids, -1), "weight": rng.random(k).astype(np.float32)})
    return out


CONFIG = dict(capacity=64, layout="thd", cp_size=2, overflow="split", window=12)


def _pack(docs, dp=(0, 1), **overrides) -> Pack:
    return Pack(Documents(docs, dp_rank=dp[0], dp_size=dp[1], labels_alignment="targets"), **{**CONFIG, **overrides})


class Unfingerprinted:
    """A plain sequence, not a list: fingerprinted by its type only, so a changed document goes unseen there."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dp", [(0, 1), (1, 2)])
def test_online_equals_offline(algorithm, dp):
    docs = _docs(150)
    plans = list(_pack(docs, dp, algorithm=algorithm))
    mine = list(range(dp[0], len(docs), dp[1]))
    offline = plan_lengths([len(docs[i]["input_ids"]) for i in mine], algorithm=algorithm, **CONFIG)
    assert len(plans) == offline.n_packs > 0
    for p, plan in enumerate(plans):
        doc_index, doc_start, doc_len, slot_len = offline.pack(p)
        assert [x.index for x in plan.pieces] == [mine[i] for i in doc_index.tolist()]
        assert [x.start for x in plan.pieces] == doc_start.tolist()
        assert plan.seq_lens.tolist() == doc_len.tolist()
        assert plan.slot_lens.tolist() == slot_len.tolist() and plan.slot_lens.dtype == np.int64
    assert _pack(docs, dp, algorithm=algorithm).stats.packs == 0
    node = _pack(docs, dp, algorithm=algorithm)
    list(node)
    assert node.stats == offline.stats


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pieces_are_slices_of_the_documents(algorithm):
    docs = _docs(120, max_len=150)
    plans = list(_pack(docs, algorithm=algorithm))
    split_pieces = 0
    for i, plan in enumerate(plans):
        assert isinstance(plan, PackPlan) and plan.index == i and plan.capacity == 64
        assert int(plan.slot_lens.sum()) <= 64 and (plan.slot_lens % 4 == 0).all()
        for piece in plan.pieces:
            doc = docs[piece.index]
            end = piece.start + piece.length
            for key in ("input_ids", "labels", "weight"):
                np.testing.assert_array_equal(piece.arrays[key], np.asarray(doc[key])[piece.start : end])
            assert piece.arrays["weight"].dtype == np.float32
            if end < len(doc["input_ids"]):
                split_pieces += 1
                assert piece.next_label == int(doc["input_ids"][end])
            else:
                assert piece.next_label == -100
    assert split_pieces > 0, "documents longer than the capacity were split"
    covered = sum(p.length for plan in plans for p in plan.pieces)
    assert covered == sum(len(d["input_ids"]) for d in docs)


def _compare_plans(actual: PackPlan, expected: PackPlan) -> None:
    # assert_items_equal handles this too; spelled out to show what "bit-identical" covers.
    assert actual.index == expected.index and actual.capacity == expected.capacity
    assert actual.slot_lens.dtype == expected.slot_lens.dtype
    assert np.array_equal(actual.slot_lens, expected.slot_lens)
    assert len(actual.pieces) == len(expected.pieces)
    for a, e in zip(actual.pieces, expected.pieces, strict=True):
        assert (a.index, a.start, a.next_label) == (e.index, e.start, e.next_label)
        assert list(a.arrays) == list(e.arrays)
        for key in e.arrays:
            assert a.arrays[key].dtype == e.arrays[key].dtype
            assert np.array_equal(a.arrays[key], e.arrays[key])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_save_load_contract(algorithm):
    docs = _docs(90, max_len=150)
    n = len(list(_pack(docs, algorithm=algorithm)))
    midpoints = sorted({0, 1, 2, 3, n // 3, n // 2, n - 1, n, n + 1, n + n // 2, 2 * n})
    run_save_load_contract(lambda: _pack(docs, algorithm=algorithm), midpoints, epochs=2)
    run_save_load_contract(lambda: _pack(docs, (1, 3), algorithm=algorithm), [1, 5], _compare_plans,
                           round_trips=("torch",))


def test_contract_mid_window_with_carried_bins():
    docs = _docs(200, max_len=60)
    node = _pack(docs)
    # Find midpoints where a window is half emitted and bins are carried (the interesting case).
    interesting = []
    for i, _ in enumerate(node, start=1):
        state = node.state_dict()
        if state["emitted"] > 0 and state["carry"]["key"].size and len(interesting) < 4 and i % 3 == 0:
            interesting.append(i)
    assert len(interesting) == 4
    run_save_load_contract(lambda: _pack(docs), interesting, epochs=2)


@pytest.mark.parametrize("seekable", [True, False])
def test_short_documents_widen_the_window_online_as_offline(seekable):
    # ~6-token documents at capacity 256: 16 documents are far less than WINDOW_PACKS packs of tokens.
    docs = _docs(600, max_len=12, seed=3)
    kw = dict(capacity=256, layout="identity", cp_size=1, window=16)

    def make():
        return Pack(Documents(docs if seekable else IterableWrapper(docs), labels_alignment="targets"), **kw)

    lengths = np.array([len(d["input_ids"]) for d in docs])
    offline = plan_lengths(lengths, **kw)
    ends, counted = window_ends(lengths, offline.config), np.maximum(lengths, 1)
    assert ends[0] > 16 and counted[: ends[0]].sum() >= WINDOW_PACKS * 256 > counted[: ends[0] - 1].sum()
    node = make()
    plans = list(node)
    assert [[p.index for p in plan.pieces] for plan in plans] == [
        offline.pack(p)[0].tolist() for p in range(offline.n_packs)
    ]
    assert node.stats == offline.stats and offline.stats.excess_pct < 1.0
    run_save_load_contract(make, [1, len(plans) // 2, len(plans) - 1], epochs=1, round_trips=("pickle",))


def test_contract_with_a_node_source_and_truncation():
    docs = _docs(60, max_len=150)

    def make():
        return Pack(Documents(IterableWrapper(docs), labels_alignment="targets"), capacity=48, layout="round_robin", cp_size=4,
                    overflow="truncate", window=7)

    reference = run_save_load_contract(make, [0, 4, 9, 15], epochs=2)
    assert any(p.length == 48 for plan in reference for p in plan.pieces), "some documents were truncated"


@pytest.mark.parametrize(
    "change", [dict(capacity=128), dict(layout="round_robin"), dict(cp_size=4, capacity=64),
               dict(algorithm="ffd"), dict(overflow="truncate"), dict(window=13)],
    ids=lambda c: next(iter(c)),
)
def test_refuses_a_state_from_another_configuration(change):
    docs = _docs(40)
    node = _pack(docs)
    next(node)
    state = node.state_dict()
    other = _pack(docs, **change)
    name = next(iter(change))
    saved = CONFIG.get(name, "bfd")
    with pytest.raises(ValueError, match=rf"saved with {name}={saved!r} into a Pack with {name}={change[name]!r}"):
        other.reset(state)


def test_refuses_a_changed_source_and_other_versions():
    docs = _docs(60)
    node = _pack(docs)
    for _ in range(3):
        next(node)
    state = node.state_dict()
    assert state["emitted"] > 0
    changed = [dict(d) for d in docs]
    for d in changed:
        d["input_ids"] = d["input_ids"][: max(len(d["input_ids"]) - 5, 0)]
        d["labels"], d["weight"] = d["labels"][: len(d["input_ids"])], d["weight"][: len(d["input_ids"])]
    with pytest.raises(ValueError, match="fingerprint .* other content"):  # a list: its fingerprint differs
        _pack(changed).reset(state)

    state = _pack(Unfingerprinted(docs))
    for _ in range(3):
        next(state)
    state = state.state_dict()
    with pytest.raises(ValueError, match="source changed"):  # no fingerprint: the packer's own re-read check
        _pack(Unfingerprinted(changed)).reset(state)
    with pytest.raises(ValueError, match="version"):
        _pack(docs).reset(dict(state, version=0))


@pytest.mark.parametrize("seekable", [True, False])
def test_state_is_compact_and_stats_are_inside(seekable):
    docs = _docs(200)
    source = Documents(docs if seekable else IterableWrapper(docs), labels_alignment="targets")
    node = Pack(source, **{**CONFIG, "window": 50})
    emitted = 0
    while node.state_dict()["source"]["position"] < 100:  # the snapshot of the third window
        next(node)
        emitted += 1
    state = node.state_dict()
    assert set(state) == {"version", "config", "source", "planner", "carry", "emitted", "stats"}
    assert state["stats"]["packs"] == emitted == node.stats.packs
    carry = state["carry"]  # columns as tensors: the state loads with torch.load's weights_only=True
    assert all(type(carry[name]) is torch.Tensor for name in ("key", "index", "start", "length"))
    assert 0 < carry["key"].numel() and int(carry["length"].sum()) <= sum(len(d["input_ids"]) for d in docs[:100])
    if seekable:
        assert carry["arrays"] is None, "a seekable source keeps references only"
        assert len(pickle.dumps(state)) < 6144  # (~4.7 KB: nine small tensors of ~100 bytes of pickle framing each)
    else:
        arrays = carry["arrays"]  # a few columns however many pieces, int64 ids stored as int32
        assert arrays["mask"].shape == (carry["key"].numel(), len(arrays["names"])) and bool(arrays["mask"].all())
        stored = dict(zip(arrays["names"], arrays["stored"], strict=True))
        assert np.dtype(stored["input_ids"]) == np.int32
        assert all(type(t) is torch.Tensor and t.dtype == torch.uint8 for t in arrays["data"])
    restored = Pack(Documents(docs if seekable else IterableWrapper(docs), labels_alignment="targets"), **{**CONFIG, "window": 50})
    restored.reset(state)
    assert_items_equal(list(restored), list(node))


def test_rejects_non_document_items():
    with pytest.raises(TypeError, match="expects cpdata.worker.plan.Document items, got dict"):
        next(Pack(IterableWrapper([{"input_ids": [1, 2]}]), capacity=8, layout="identity", cp_size=1))
    with pytest.raises(TypeError, match="source_node must be a torchdata BaseNode"):
        Pack([{"input_ids": [1]}], capacity=8, layout="identity", cp_size=1)
    with pytest.raises(ValueError, match=r"capacity=66 .*'thd'.*cp_size=2.*use capacity 64 or 68"):
        _pack(_docs(3), capacity=66)


def test_overflow_error_surfaces_from_the_node():
    docs = [{"input_ids": np.arange(5)}, {"input_ids": np.arange(100)}]
    with pytest.raises(ValueError, match=r"document 1 has 100 tokens.*capacity=64.*1 of 2 documents"):
        Pack(Documents(docs, labels_alignment="targets"), capacity=64, layout="identity", cp_size=1)  # a list: built

    class Stream:  # lengths unknown until read
        def __iter__(self):
            return iter(docs)

    node = Pack(Documents(Stream(), labels_alignment="targets"), capacity=64, layout="identity", cp_size=1)
    with pytest.raises(ValueError, match=r"document 1 has 100 tokens.*capacity=64.*checked when it is read.*"
                                         r"to name every overlong document at once"):  # fmt: skip
        next(node)


def test_ffd_over_the_whole_stream_resumes_and_matches_offline():
    docs = _docs(80)
    make = lambda: _pack(docs, algorithm="ffd", window=None)  # noqa: E731
    reference = run_save_load_contract(make, [0, 3, 20], epochs=2, round_trips=("pickle",))
    offline = plan_lengths([len(d["input_ids"]) for d in docs], **{**CONFIG, "algorithm": "ffd", "window": None})
    assert [[p.index for p in plan.pieces] for plan in reference[: offline.n_packs]] == [
        offline.pack(p)[0].tolist() for p in range(offline.n_packs)
    ]


@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_column_pieces_are_the_documents_pieces(overflow):
    """Plans keep their pieces as columns (no object per piece); read as DocPieces they are each
    document's tokens ``start:start + length``, a cut-off piece's last target -100, and equal to plans
    built from DocPiece objects (collate and the digest see the same)."""
    from cpdata.worker.collate import collate_pack
    from cpdata.worker.plan import DocPiece, PieceColumns
    from cpdata.worker.shard_block import plan_digest
    from cpdata.worker.targets import piece_arrays

    docs = _docs(120, max_len=150, seed=4)
    source = Documents(docs, labels_alignment="targets")
    source.reset()
    full = {d.index: d.arrays for d in source}
    plans = list(_pack(docs, overflow=overflow))
    cut = 0
    for plan in plans:
        assert isinstance(plan.pieces, PieceColumns) and len(plan.pieces) == len(plan.slot_lens)
        objects = []
        for piece in plan.pieces:
            arrays = full[piece.index]
            n = arrays["input_ids"].shape[0]
            continues = piece.next_label != -100
            want = piece_arrays(arrays, piece.start, piece.length, continues)
            assert want.keys() == piece.arrays.keys()
            assert all(np.array_equal(want[k], piece.arrays[k]) and want[k].dtype == piece.arrays[k].dtype
                       for k in want)  # fmt: skip
            if continues:
                assert piece.next_label == arrays["input_ids"][piece.start + piece.length]
            cut += int(continues if overflow == "split" else piece.start + piece.length < n)
            objects.append(DocPiece(index=piece.index, start=piece.start, arrays=want, next_label=piece.next_label))
        rebuilt = PackPlan(pieces=tuple(objects), slot_lens=plan.slot_lens, capacity=plan.capacity, index=plan.index)
        assert rebuilt.piece_columns == plan.piece_columns
        assert plan_digest(rebuilt, "thd", 2) == plan_digest(plan, "thd", 2)
        a, b = collate_pack([rebuilt]), collate_pack([plan])
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert cut > 0, f"documents longer than the capacity were {overflow}"


def test_state_at_reset_is_the_first_windows_snapshot_and_config_fields_are_asdicts():
    """The state read right after ``reset()`` (what ``ShardForRank`` reads at each block start) is the state
    before the first window: once that window is read and packs emitted, the state differs only in what was
    emitted, and restoring either reproduces the stream; ``config`` holds ``asdict``'s fields but two."""
    import dataclasses

    docs = _docs(90, max_len=150)
    node = _pack(docs)
    assert len(list(node)) > 6  # a whole pass first: the reset below rewinds a source read to its end
    node.reset()
    at_reset = node.state_dict()
    plans = [next(node) for _ in range(3)]
    after = node.state_dict()
    assert after["emitted"] == 3 and at_reset["emitted"] == 0  # one window read, three of its packs out
    assert after["source"]["position"] == at_reset["source"]["position"] == 0  # the snapshot before the window
    for key in ("version", "config", "source", "planner", "carry"):
        assert_items_equal(after[key], at_reset[key], key)
    expected = {k: v for k, v in dataclasses.asdict(node.config).items()
                if k not in ("doc_multiple", "seed", "world_step")}  # (world_step: in the state only when > 1)
    assert at_reset["config"] == expected and list(at_reset["config"]) == list(expected)
    rest = list(node)
    for state, tail in ((at_reset, [*plans, *rest]), (after, rest)):
        restored = _pack(docs)
        restored.reset(state)
        assert_items_equal(list(restored), tail)
    assert len(rest) > 3


def test_plans_differing_in_one_column_a_dtype_or_a_key_are_unequal():
    """Plan equality (what the resume tests compare) sees every column, each array's dtype and its keys:
    one piece changed in any of them makes the pieces unequal; rebuilt unchanged, they are equal."""
    from cpdata.worker.plan import DocPiece

    (plan, *_) = _pack(_docs(12, max_len=40, seed=2))
    pieces = list(plan.pieces)
    assert len(pieces) > 1

    def with_first(**change) -> PackPlan:
        first = pieces[0]
        fields = dict(index=first.index, start=first.start, arrays=first.arrays, next_label=first.next_label)
        objects = (DocPiece(**{**fields, **change}), *pieces[1:])
        return PackPlan(pieces=objects, slot_lens=plan.slot_lens, capacity=plan.capacity, index=plan.index)

    ids = pieces[0].arrays["input_ids"]
    assert with_first().piece_columns == plan.piece_columns
    for change in (dict(next_label=int(ids[0])), dict(start=pieces[0].start + 1),
                   dict(arrays={**pieces[0].arrays, "input_ids": ids.astype(np.int32)}),
                   dict(arrays={**pieces[0].arrays, "token_type": np.zeros_like(ids)})):  # fmt: skip
        other = with_first(**change)
        assert other.piece_columns != plan.piece_columns, change
        assert plan.piece_columns != other.piece_columns, change


def test_a_carried_piece_past_its_shrunken_document_is_refused():
    """A state whose carry holds tokens ``start:start + length`` of a document that now ends one token
    earlier is refused naming it, on a source without a fingerprint, before any replay could mask it."""

    docs = _docs(60)
    node = _pack(Unfingerprinted(docs))
    node.reset()
    state = node.state_dict()
    while not len(state["carry"]["index"]):  # the first state whose window starts with carried pieces
        next(node)
        state = node.state_dict()
    carry = state["carry"]
    index, end = int(carry["index"][-1]), int(carry["start"][-1] + carry["length"][-1])
    assert len(docs[index]["input_ids"]) >= end
    shrunk = [dict(d) for d in docs]
    shrunk[index] = {k: a[: end - 1] for k, a in docs[index].items()}
    with pytest.raises(ValueError, match=f"tokens {end - carry['length'][-1]}..{end} of document {index}, which now "
                       f"has {end - 1}"):  # fmt: skip
        _pack(Unfingerprinted(shrunk)).reset(state)
