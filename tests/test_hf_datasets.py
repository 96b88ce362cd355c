"""Hugging Face ``datasets`` (Arrow, in-process, no network) as a first-class source."""

from __future__ import annotations

import pickle

import datasets
import numpy as np
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import Collate, CPDataset, PrecomputedPacks, ShardForRank, build_loader, precompute
from cpdata.nodes.loader import close_loader
from cpdata.sources.hf import HFDocuments
from tests.flat_options import precompute_records, records
from tests.test_precompute import assert_batches_equal

CAP = 64
KW = {"capacity": CAP, "cp_size": 2, "layout": "thd"}


def _rows(n: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, size=int(rng.integers(1, 50))).tolist() for _ in range(n)]


def _dataset(rows: list[list[int]], *, length: bool = True, **extra: list) -> datasets.Dataset:
    columns: dict[str, list] = {"input_ids": rows, "text": [f"row {i}" for i in range(len(rows))], **extra}
    if length:
        columns["length"] = [len(r) for r in rows]
    return datasets.Dataset.from_dict(columns)


def _batches(loader, n: int | None = None) -> list:
    out = []
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    close_loader(loader)
    return out


def _as_list(rows):
    return [{"input_ids": np.asarray(r, dtype=np.int64)} for r in rows]


def test_lengths_come_from_the_length_column_or_the_arrow_offsets():
    rows = _rows()
    with_column = HFDocuments(_dataset(rows))
    assert with_column.length_column == "length"
    np.testing.assert_array_equal(with_column.lengths, [len(r) for r in rows])
    offsets = HFDocuments(_dataset(rows, length=False))
    assert offsets.length_column == ""
    np.testing.assert_array_equal(offsets.lengths, [len(r) for r in rows])
    reordered = HFDocuments(_dataset(rows, length=False).select([3, 1, 2]))  # an indices mapping
    np.testing.assert_array_equal(reordered.lengths, [len(rows[3]), len(rows[1]), len(rows[2])])
    np.testing.assert_array_equal(reordered[0]["input_ids"], rows[3])
    num_tokens = HFDocuments(datasets.Dataset.from_dict({"input_ids": rows[:3], "num_tokens": [len(r) for r in rows[:3]]}))
    assert num_tokens.length_column == "num_tokens"


def test_planning_reads_no_token_rows(tmp_path, monkeypatch):
    ds = _dataset(_rows())

    def no_rows(self, i):
        raise AssertionError(f"planning read row {i}")

    monkeypatch.setattr(HFDocuments, "_read", no_rows)
    store = precompute(ds, tmp_path / "plan", **precompute_records(**KW, overflow="split"))
    assert store.manifest["input"]["kind"] == "hf_dataset"
    assert store.manifest["input"]["tokens"] == sum(len(r) for r in _rows())


def test_a_lying_length_column_is_refused_when_the_row_is_read():
    rows = _rows(5)
    ds = datasets.Dataset.from_dict({"input_ids": rows, "length": [len(r) + (i == 2) for i, r in enumerate(rows)]})
    docs = HFDocuments(ds)
    docs[1]
    with pytest.raises(ValueError, match=r"dataset row 2: length says \d+ tokens but 'input_ids' has \d+"):
        docs[2]


def test_precomputed_plan_from_a_dataset_serves_the_online_packs(tmp_path):
    rows = _rows()
    ds = _dataset(rows)
    plan = tmp_path / "plan"
    precompute(ds, plan, **precompute_records(**KW, overflow="split"))
    served = list(ShardForRank(Collate(PrecomputedPacks(plan, ds, cp_size=2, layout="thd")), cp_size=2, cp_rank=0,
                               layout="thd"))  # fmt: skip
    again = list(PrecomputedPacks(plan, _dataset(rows)))  # another Dataset object over the same data
    assert len(again) == len(served)
    online = _batches(build_loader(_as_list(rows), **records(cp_rank=0, overflow="split", **KW, restart_on_stop_iteration=False)))
    assert len(served) == len(online) > 3
    for a, e in zip(served, online, strict=True):
        assert_batches_equal(a, e)


def test_fingerprint_binds_the_plan_to_the_data(tmp_path):
    rows = _rows()
    ds = _dataset(rows)
    assert HFDocuments(ds).fingerprint() == HFDocuments(_dataset(rows)).fingerprint()  # stable across objects
    assert HFDocuments(pickle.loads(pickle.dumps(ds))).fingerprint() == HFDocuments(ds).fingerprint()
    plan = tmp_path / "plan"
    precompute(ds, plan, **precompute_records(**KW, overflow="split"))
    changed = ds.map(lambda row: {"input_ids": row["input_ids"][::-1]})
    for other in (changed, ds.select(range(len(ds) - 1)), _dataset(_rows(seed=1))):
        assert HFDocuments(other).fingerprint() != HFDocuments(ds).fingerprint()
        with pytest.raises(ValueError, match="hash to"):
            PrecomputedPacks(plan, other)


def test_build_loader_and_workers_take_a_dataset_and_a_streaming_dataset():
    rows = _rows()
    expected = _batches(build_loader(_as_list(rows), **records(cp_rank=1, overflow="split", **KW, restart_on_stop_iteration=False)))
    assert len(expected) > 3
    sources = {"arrow": _dataset(rows), "streaming": _dataset(rows).to_iterable_dataset()}
    for name, source in sources.items():
        got = _batches(build_loader(source, **records(cp_rank=1, overflow="split", **KW, restart_on_stop_iteration=False)))
        assert len(got) == len(expected), name
        for a, e in zip(got, expected, strict=True):
            assert_batches_equal(a, e)
    loader = StatefulDataLoader(CPDataset(sources["arrow"], **records(cp_rank=1, overflow="split", **KW)),
                                batch_size=None, num_workers=2, multiprocessing_context="fork")  # fmt: skip
    got = list(loader)
    assert len(got) == len(expected)
    for a, e in zip(got, expected, strict=True):
        assert_batches_equal(a, e)


def test_resume_over_a_dataset_is_exact():
    rows = _rows()
    for source in (_dataset(rows), _dataset(rows).to_iterable_dataset()):
        reference = _batches(build_loader(source, **records(cp_rank=0, overflow="split", **KW, restart_on_stop_iteration=False)))
        loader = build_loader(source, **records(cp_rank=0, overflow="split", **KW, restart_on_stop_iteration=False))
        it = iter(loader)
        head = [next(it) for _ in range(2)]
        state = loader.state_dict()
        close_loader(loader)
        resumed = build_loader(source, **records(cp_rank=0, overflow="split", **KW, restart_on_stop_iteration=False))
        resumed.load_state_dict(state)
        tail = _batches(resumed)
        assert len(head) + len(tail) == len(reference)
        for a, e in zip(head + tail, reference, strict=True):
            assert_batches_equal(a, e)


def test_every_flat_numeric_list_column_travels_whatever_its_list_feature():
    rows = _rows(5)
    weights = [[0.5 * k for k in range(len(r))] for r in rows]
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")), "weights": datasets.LargeList(datasets.Value("float32")),
        "flags": datasets.Sequence(datasets.Value("bool")), "words": datasets.Sequence(datasets.Value("string")),
        "nested": datasets.Sequence(datasets.Sequence(datasets.Value("int32"))), "length": datasets.Value("int64"),
    })  # fmt: skip
    columns = {"input_ids": rows, "weights": weights, "flags": [[k % 2 == 0 for k in range(len(r))] for r in rows],
               "words": [["w"] * len(r) for r in rows], "nested": [[[k] for k in r] for r in rows],
               "length": [len(r) for r in rows]}  # fmt: skip
    source = HFDocuments(datasets.Dataset.from_dict(columns, features=features))
    for i, row in enumerate(rows):
        doc = source[i]
        assert sorted(doc) == ["flags", "input_ids", "weights"]  # strings, nested lists and the length are not per-token
        assert doc["input_ids"].tolist() == row and doc["weights"].tolist() == weights[i]
        assert doc["flags"].tolist() == columns["flags"][i]


def test_masks_travel_padding_is_refused_and_streaming_cannot_be_indexed(tmp_path):
    rows = _rows(4)
    masks = [[1] * len(r) for r in rows]
    doc = HFDocuments(_dataset(rows, loss_mask=masks, attention_mask=masks))[0]
    assert sorted(doc) == ["input_ids", "loss_mask"]  # text and length are metadata; all-ones attention dropped
    padded = [m[:-1] + [0] for m in masks]
    with pytest.raises(ValueError, match="'attention_mask' is 0 at .* so the row holds padding"):
        HFDocuments(_dataset(rows, attention_mask=padded))[0]
    with pytest.raises(ValueError, match="no 'input_ids'"):
        HFDocuments(datasets.Dataset.from_dict({"text": ["a"]}))
    streaming = _dataset(rows).to_iterable_dataset()
    with pytest.raises(TypeError, match="streaming datasets.IterableDataset has no index"):
        precompute(streaming, tmp_path / "plan", **precompute_records(**KW, overflow="split"))
    assert not (tmp_path / "plan").exists()
    bad = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, -4]]})
    with pytest.raises(ValueError, match="document 1 has token id -4 at position 1"):
        precompute(bad, tmp_path / "plan", **precompute_records(**KW))


def test_fingerprint_hooks_refuse_another_dataset_on_resume(tmp_path):
    rows = _rows()
    loader = build_loader(_dataset(rows), **records(cp_rank=0, overflow="split", **KW))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    close_loader(loader)
    other = build_loader(_dataset([r[::-1] for r in rows]), **records(cp_rank=0, overflow="split", **KW))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint hf_dataset:"):
        next(iter(other))
    close_loader(other)
    saved = _dataset(rows)
    saved.save_to_disk(str(tmp_path / "saved"))
    from cpdata import open_dataset

    opened = open_dataset(tmp_path / "saved")
    assert isinstance(opened, HFDocuments) and opened.fingerprint().startswith("hf_dataset:")
    opened.check_unchanged()
    cache = next(iter(opened._cache_sizes))
    with open(cache, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="changed since it was opened"):
        opened.check_unchanged()
