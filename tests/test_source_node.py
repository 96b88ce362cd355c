"""Documents node: validation, DP sharding, source kinds and exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from state_contract import run_save_load_contract
from torchdata.nodes import IterableWrapper

from cpdata.nodes.source import Documents, to_document
from cpdata.nodes.validate import plain_ids
from cpdata.worker.plan import Document


def _docs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(0, 9))
        out.append({"input_ids": rng.integers(0, 100, k).tolist(), "weight": rng.random(k) > 0.5,
                    "id": f"doc-{i}"})
    return out


class _Reiterable:
    """Re-iterable but not a sequence (like an IterableDataset)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(list(self.items))


class _Recording(list):
    """A list that records which indices were read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads: list[int] = []

    def __getitem__(self, i):
        self.reads.append(i)
        return super().__getitem__(i)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "item,exc,pattern",
    [
        ([1, 2, 3], TypeError, r"document 7: expected a dict.*got list"),
        ({"ids": [1]}, ValueError, r"document 7 has no 'input_ids'; its keys are \['ids'\]"),
        ({"input_ids": [[1, 2], [3, 4]]}, ValueError, r"document 7: 'input_ids' must be 1-D, got shape \(2, 2\)"),
        ({"input_ids": [1.0, 2.5]}, TypeError, r"document 7: 'input_ids' must hold integers, got dtype float64"),
        ({"input_ids": torch.tensor([1.0])}, TypeError, r"document 7: 'input_ids' must hold integers.*float32"),
        ({"input_ids": "hello"}, TypeError, r"document 7: 'input_ids' must be a 1-D list.*got str"),
        ({"input_ids": [4, -3, 2]}, ValueError, r"document 7: 'input_ids' must be >= 0, got -3 at position 1"),
        ({"input_ids": [4, 50, 2]}, ValueError, r"document 7: input_ids\[1\]=50 is >= vocab_size=50"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, ValueError,
         r"document 7: 'labels' has 2 entries but 'input_ids' has 3"),
        ({"input_ids": [1, 2, 3], "loss_mask": np.ones(4)}, ValueError,
         r"document 7: 'loss_mask' has 4 entries but 'input_ids' has 3"),
        ({"input_ids": [1, 2], "pixel_weight": torch.ones(5)}, ValueError,
         r"document 7: 'pixel_weight' has 5 entries but 'input_ids' has 2"),
        ({"input_ids": [1, 2], "labels": [0.5, 1.0]}, TypeError, r"document 7: 'labels' must hold integers"),
    ],
)
def test_validation_errors_name_the_values(item, exc, pattern):
    with pytest.raises(exc, match=pattern):
        to_document(item, 7, vocab_size=50)


def test_conversion_and_dtypes():
    doc = to_document(
        {
            "input_ids": torch.tensor([3, 4, 5], dtype=torch.int32),
            "labels": [4, 5, -100],
            "loss_mask": np.array([1, 1, 0], dtype=np.float32),
            "weights": torch.tensor([True, False, True]),
            "text": "hello world",
            "messages": [{"role": "user"}],
            "n_turns": 3,
        },
        index=11,
        labels_alignment="targets",
    )
    assert isinstance(doc, Document) and doc.index == 11 and doc.length == 3
    assert doc.arrays["input_ids"].dtype == np.int64 and doc.arrays["labels"].dtype == np.int64
    assert doc.arrays["loss_mask"].dtype == np.float32, "per-token extras keep their dtype"
    assert doc.arrays["weights"].dtype == np.bool_
    assert sorted(doc.arrays) == ["input_ids", "labels", "loss_mask", "weights"], "metadata is not carried"
    empty = to_document({"input_ids": []}, index=0)
    assert empty.length == 0 and empty.arrays["input_ids"].dtype == np.int64


def test_node_validates_with_the_source_index():
    docs = _docs(6)
    docs[4] = {"input_ids": [1, 2, 3], "labels": [1]}
    node = Documents(docs, dp_rank=0, dp_size=2, labels_alignment="targets")
    assert [d.index for d in (next(node), next(node))] == [0, 2]
    with pytest.raises(ValueError, match=r"document 4: 'labels' has 1 entries but 'input_ids' has 3"):
        next(node)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"dp_rank=2, dp_size=2"):
        Documents([], dp_rank=2, dp_size=2)
    with pytest.raises(TypeError, match="one-shot iterator"):
        Documents(d for d in _docs(3))
    with pytest.raises(TypeError, match="got dict"):
        Documents({"input_ids": [1]})
    with pytest.raises(ValueError, match="vocab_size"):
        Documents([], vocab_size=0)


# ----------------------------------------------------------------------------- sources and sharding


def _make_source(kind: str, docs: list[dict]):
    if kind == "sequence":
        return docs
    if kind == "iterable":
        return _Reiterable(docs)
    return IterableWrapper(docs)


@pytest.mark.parametrize("kind", ["sequence", "iterable", "node"])
def test_dp_sharding_partitions_the_documents(kind):
    docs = _docs(23)
    seen = []
    for rank in range(3):
        got = list(Documents(_make_source(kind, docs), dp_rank=rank, dp_size=3))
        assert [d.index for d in got] == list(range(rank, 23, 3))
        for d in got:
            assert d.arrays["input_ids"].tolist() == docs[d.index]["input_ids"]
        seen += [d.index for d in got]
    assert sorted(seen) == list(range(23))


def test_sequence_seeks_instead_of_reading():
    docs = _Recording(_docs(40))
    node = Documents(docs, dp_rank=1, dp_size=4)
    for _ in range(5):
        next(node)
    state = node.state_dict()
    docs.reads.clear()
    restored = Documents(docs, dp_rank=1, dp_size=4)
    restored.reset(state)
    assert docs.reads == [], "restoring a sequence source reads nothing"
    assert next(restored).index == 21
    assert docs.reads == [21], "only this rank's next item is read"


def test_source_errors_carry_the_document_index():
    class Broken(list):
        def __getitem__(self, i):
            if i == 5:
                raise OSError("disk on fire")
            return super().__getitem__(i)

    node = Documents(Broken(_docs(8)))
    for _ in range(5):
        next(node)
    with pytest.raises(OSError, match=r"reading document 5 from the source failed: OSError: disk on fire") as info:
        next(node)
    assert isinstance(info.value.__cause__, OSError) and str(info.value.__cause__) == "disk on fire"

    class BrokenIterable:
        def __iter__(self):
            yield {"input_ids": [1]}
            yield {"input_ids": [2]}
            raise KeyError("shard-3")

    node = Documents(BrokenIterable())
    next(node), next(node)
    with pytest.raises(KeyError, match="reading document 2") as info:
        next(node)
    assert isinstance(info.value.__cause__, KeyError)


# ----------------------------------------------------------------------------- state


def _compare_documents(a: Document, e: Document) -> None:
    assert a.index == e.index and list(a.arrays) == list(e.arrays)
    for k in e.arrays:
        assert a.arrays[k].dtype == e.arrays[k].dtype and np.array_equal(a.arrays[k], e.arrays[k])


@pytest.mark.parametrize("kind", ["sequence", "iterable", "node"])
@pytest.mark.parametrize("dp", [(0, 1), (2, 3)])
def test_save_load_contract(kind, dp):
    docs = _docs(17)
    n = len(range(dp[0], 17, dp[1]))
    reference = run_save_load_contract(
        lambda: Documents(_make_source(kind, docs), dp_rank=dp[0], dp_size=dp[1]),
        midpoints=[0, 1, n // 2, n, n + 1, 2 * n],
        epochs=2,
    )
    assert len(reference) == 2 * n and [d.index for d in reference[:n]] == [d.index for d in reference[n:]]


def test_state_is_small_and_versioned():
    node = Documents(_docs(50), dp_rank=1, dp_size=2)
    for _ in range(4):
        next(node)
    state = node.state_dict()
    fingerprint = state.pop("fingerprint")
    assert state == {"version": 2, "consumed": 4, "position": 8, "shard": (1, 2), "length": 50, "epoch": 0,
                     "first_epoch": 0, "order": [False, 0, None]}
    assert fingerprint.startswith("list:50:") and len(fingerprint) < 64


def test_refuses_a_state_from_another_configuration():
    node = Documents(_docs(10), dp_rank=0, dp_size=2)
    next(node)
    state = node.state_dict()
    with pytest.raises(ValueError, match=r"saved for \(dp_rank, dp_size\)=\(0, 2\), this node has \(1, 2\)"):
        Documents(_docs(10), dp_rank=1, dp_size=2).reset(state)
    with pytest.raises(ValueError, match=r"source of length 10, this source has length 12"):
        Documents(_docs(12), dp_rank=0, dp_size=2).reset(state)
    with pytest.raises(ValueError, match="version"):
        Documents(_docs(10), dp_rank=0, dp_size=2).reset(dict(state, version=99))
    assert (state["epoch"], state["first_epoch"]) == (0, 0)
    with pytest.raises(ValueError, match="first_epoch=1 > epoch=0; it is not a state of this node"):
        Documents(_docs(10), dp_rank=0, dp_size=2).reset(dict(state, first_epoch=1))  # would run an extra epoch
    short = Documents(_Reiterable(_docs(10)))
    short.reset(dict(state, shard=(0, 1), length=None, position=8))
    with pytest.raises(ValueError, match="read 8 documents but the source ends after 3"):
        Documents(_Reiterable(_docs(3))).reset(dict(state, shard=(0, 1), length=None, position=8))


# ----------------------------------------------------------------------------- windows


def _one_by_one(node: Documents, limit: int, floor: int, capacity: int) -> tuple[list[Document], bool]:
    """The window rule applied to ``next()``: what ``next_window`` must return."""
    docs, tokens = [], 0
    while len(docs) < limit or tokens < floor:
        try:
            doc = next(node)
        except StopIteration:
            return docs, True
        docs.append(doc)
        tokens += min(max(doc.length, 1), capacity)
    return docs, False



def _window_as_next(a: Documents, b: Documents, limit: int, floor: int, capacity: int):
    """``a.next_window`` against the window rule over ``b``'s ``next()``: the same documents, lengths and
    exhaustion flag; returns ``(window, documents, ended)`` for the caller's further checks."""
    got, ended = a.next_window(limit, floor, capacity)
    want, want_ended = _one_by_one(b, limit, floor, capacity)
    assert ended == want_ended and got.indices.tolist() == [d.index for d in want]
    assert got.lengths.tolist() == [d.length for d in want]
    return got, want, ended


@pytest.mark.parametrize("limit,floor", [(3, 0), (1, 20), (4, 1000)])
def test_next_window_is_next_one_by_one(limit, floor):
    """Same documents, same exhaustion flag and same state as ``next()`` under the window rule."""
    source = [{**d, "labels": d["input_ids"]} for d in _docs(30, seed=3)]
    a = Documents(source, dp_rank=1, dp_size=2, labels_alignment="inputs", vocab_size=100)
    b = Documents(source, dp_rank=1, dp_size=2, labels_alignment="inputs", vocab_size=100)
    a.reset()
    b.reset()
    while True:
        got, want, ended = _window_as_next(a, b, limit, floor, 6)
        for g, w in zip(got.arrays, want, strict=True):
            assert g.keys() == w.arrays.keys() and all(np.array_equal(g[k], w.arrays[k]) for k in g)
        assert a.state_dict() == b.state_dict()
        if ended:
            break


@pytest.mark.parametrize("shuffle,dp_size,epochs", [(False, 1, 1), (True, 3, 2), (False, 2, 3)])
@pytest.mark.parametrize("limit,floor", [(2, 0), (1, 40), (5, 300), (100, 0)])
def test_next_window_reads_ahead_like_next(shuffle, dp_size, epochs, limit, floor):
    """A sequence of int64 ids alone is read by slices: same documents, epochs and state as ``next()``."""
    rng = np.random.default_rng(4)
    source = [{"input_ids": rng.integers(0, 50, int(rng.integers(0, 30)))} for _ in range(41)]
    kw = dict(dp_rank=dp_size - 1, dp_size=dp_size, shuffle=shuffle, seed=2, num_epochs=epochs)
    a, b = Documents(source, **kw), Documents(source, **kw)
    a.reset()
    b.reset()
    while True:
        got, _, ended = _window_as_next(a, b, limit, floor, 16)
        assert (got.firsts == -2).all()
        assert all(g.keys() == {"input_ids"} and g["input_ids"] is source[i]["input_ids"]
                   for g, i in zip(got.arrays, got.indices.tolist(), strict=True))  # fmt: skip
        assert a.state_dict() == b.state_dict() and a.epoch == b.epoch
        if ended:
            break


@pytest.mark.parametrize("shuffle,dp_size,epochs", [(False, 1, 1), (True, 2, 2)])
@pytest.mark.parametrize("interleave", [False, True])
def test_items_read_past_a_window_are_kept_for_the_next_one_not_read_again(shuffle, dp_size, epochs, interleave):
    """A window reads a few items past its end; the next window takes them from there, so windows alone read each
    item of a pass once; windows, a ``next()`` between them and the state stay those of ``next()`` alone."""
    rng = np.random.default_rng(5)
    items = [{"input_ids": rng.integers(0, 50, int(rng.integers(1, 30)))} for _ in range(300)]
    source = _Recording(items)
    kw = dict(dp_rank=dp_size - 1, dp_size=dp_size, shuffle=shuffle, seed=3, num_epochs=epochs)
    a, b = Documents(source, **kw), Documents(items, **kw)
    a.reset()
    b.reset()
    windows = 0
    for step in range(10_000):
        if interleave and step % 3 == 2:  # a next() between windows: the kept items start after its document
            got_one, want_one = next(a, None), next(b, None)
            assert (got_one is None) == (want_one is None)
            if got_one is None:
                break
            assert got_one.index == want_one.index
            continue
        _, _, ended = _window_as_next(a, b, 7, 120, 16)
        state, want_state = a.state_dict(), b.state_dict()
        assert {**state, "fingerprint": None} == {**want_state, "fingerprint": None}
        windows += 1
        if ended:
            break
    own = range(dp_size - 1, len(items), dp_size)
    assert windows > 10 and set(source.reads) == set(own) if not shuffle else set(source.reads) <= set(range(300))
    if not interleave:
        assert len(source.reads) == epochs * len(own)  # each item once per pass: nothing read twice


class _FailsAt(list):
    def __init__(self, items, bad):
        super().__init__(items)
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"no row {i}")
        return super().__getitem__(i)


def test_read_error_past_the_window_is_raised_by_the_window_that_reaches_it():
    source = _FailsAt([{"input_ids": np.arange(3)} for _ in range(30)], bad=10)
    node = Documents(source)
    node.reset()
    got, _ = node.next_window(4, 0, 16)  # reads ahead past item 10, which fails: not this window's
    assert got.indices.tolist() == [0, 1, 2, 3] and node.state_dict()["position"] == 4
    got, _ = node.next_window(6, 0, 16)
    assert got.indices.tolist() == [4, 5, 6, 7, 8, 9]
    with pytest.raises(KeyError, match="reading document 10 from the source failed: KeyError"):
        node.next_window(6, 0, 16)
    assert node.state_dict()["position"] == 10


@pytest.mark.parametrize(
    "bad",
    [
        {3: {"input_ids": [1, -2]}},  # values: found by the window's one min
        {5: {"input_ids": [1, 99]}},  # >= vocab_size
        {2: {"input_ids": [1, 2], "labels": [1, 2, 3]}},  # structure
        {4: {"input_ids": [1, -2]}, 2: {"input_ids": "x"}},  # structure first in source order
        {1: {"input_ids": [1, 2], "labels": [1, -5]}, 3: {"input_ids": [-1]}},  # targets first in source order
        {6: [1, 2]},  # not a dict
    ],
)
def test_window_errors_are_the_first_bad_documents_own(bad):
    """A window is validated at once, but raises what ``to_document`` raises for its first bad item."""
    source = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]} for _ in range(8)]
    for i, item in bad.items():
        source[i] = item
    first = min(bad)
    with pytest.raises((TypeError, ValueError)) as want:
        to_document(source[first], first, vocab_size=50, labels_alignment="inputs")
    node = Documents(source, vocab_size=50, labels_alignment="inputs")
    node.reset()
    with pytest.raises(type(want.value)) as got:
        node.next_window(8, 0, 16)
    assert str(got.value) == str(want.value)


def test_plain_ids_takes_only_dicts_of_one_d_int64_arrays():
    """``plain_ids`` accepts what ``document_ids`` returns as is (an int64 dtype that is equal but not the
    same object included) and refuses anything else."""
    ids = [np.arange(3), np.arange(0), np.array([7], dtype=np.dtype(np.int64, metadata={"m": 1}))]
    got = plain_ids([{"input_ids": a} for a in ids])
    assert got is not None and all(x is y for x, y in zip(got[0], ids, strict=True))
    assert got[1].tolist() == [3, 0, 1]
    assert plain_ids([]) is not None
    for bad in ({"input_ids": [1, 2]}, {"input_ids": np.arange(3, dtype=np.int32)}, {"input_ids": np.ones((1, 2), np.int64)},
                {"tokens": np.arange(3)}, [np.arange(3)], {"input_ids": torch.arange(3)}):  # fmt: skip
        assert plain_ids([{"input_ids": np.arange(2)}, bad]) is None


@pytest.mark.parametrize("kind", ["sequence", "iterable"])
def test_window_arrays_hold_the_checked_ids_whatever_the_source_does_to_its_items_later(kind):
    """A window's arrays are dicts of its own holding the arrays whose ids were checked: a source that
    changes or reuses an item dict after handing it over does not change what a carried piece copies later."""
    items = [{"input_ids": np.arange(i + 1)} for i in range(6)]
    originals = [item["input_ids"] for item in items]
    node = Documents(items if kind == "sequence" else _Reiterable(items))
    node.reset()
    window, _ = node.next_window(6, 0, 16)
    for item in items:
        item["input_ids"] = np.full(7, 10**9)  # out of any vocabulary, never checked
    assert all(a is not item for a, item in zip(window.arrays, items, strict=True))
    assert all(a["input_ids"] is o for a, o in zip(window.arrays, originals, strict=True))
