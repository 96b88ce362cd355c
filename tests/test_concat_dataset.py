"""open_dataset([...]): shards written by a distributed tokenizer read as one dataset, planned from the
engine's lengths file and served from the shards."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from cpdata import (
    Collate,
    Documents,
    PrecomputedPacks,
    ShardForRank,
    build_loader,
    close_loader,
    open_dataset,
    precompute,
)
from cpdata.offline.store import read_store
from cpdata.sources.concat import ConcatDataset
from cpdata.sources.megatron_writer import write_megatron
from cpdata.sources.tokenstore import write_token_store
from tests.flat_options import precompute_records, records
from tests.test_precompute import assert_batches_equal


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 500, int(rng.integers(1, 60)))} for _ in range(n)]


def _shards(tmp_path):
    parts = [_docs(40, 0), _docs(25, 1), _docs(30, 2)]
    write_megatron(parts[0], tmp_path / "shard0_text_document", vocab_size=500)
    write_megatron(parts[1], tmp_path / "shard1_text_document", vocab_size=500)
    write_token_store(parts[2], tmp_path / "shard2_store", vocab_size=500)
    paths = [tmp_path / "shard0_text_document", tmp_path / "shard1_text_document", tmp_path / "shard2_store"]
    return paths, [d for part in parts for d in part]


def test_shards_read_as_one_dataset_in_order(tmp_path):
    paths, docs = _shards(tmp_path)
    ds = open_dataset(paths)
    assert isinstance(ds, ConcatDataset) and len(ds) == len(docs) == 95
    np.testing.assert_array_equal(ds.lengths, [len(d["input_ids"]) for d in docs])
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i]["input_ids"], doc["input_ids"])
    assert ds.locate(40) == (1, 0) and ds.locate(94) == (2, 29)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.fingerprint() == ds.fingerprint()
    swapped = open_dataset([paths[1], paths[0], paths[2]])
    assert swapped.fingerprint() != ds.fingerprint()
    with pytest.raises(ValueError, match="needs at least one path"):
        open_dataset([])


def test_a_plan_from_the_engines_lengths_serves_from_the_shards(tmp_path):
    paths, docs = _shards(tmp_path)
    lengths = np.array([len(d["input_ids"]) for d in docs], dtype=np.int64)  # what the engine wrote beside its shards
    np.save(tmp_path / "lengths.npy", lengths)
    kw = {"capacity": 128, "cp_size": 2, "layout": "balanced", "overflow": "split"}
    precompute(tmp_path / "lengths.npy", tmp_path / "plan", **precompute_records(**kw))
    served = list(ShardForRank(Collate(PrecomputedPacks(tmp_path / "plan", open_dataset(paths))), cp_size=2,
                               cp_rank=0, layout="balanced"))  # fmt: skip
    loader = build_loader(docs, **records(cp_rank=0, restart_on_stop_iteration=False, **kw))
    online = list(loader)
    close_loader(loader)
    assert len(served) == len(online) > 5
    for a, e in zip(served, online, strict=True):
        assert_batches_equal(a, e)
    np.save(tmp_path / "other.npy", lengths[::-1].copy())
    precompute(tmp_path / "other.npy", tmp_path / "plan2", **precompute_records(**kw))
    with pytest.raises(ValueError, match="have other lengths"):
        PrecomputedPacks(tmp_path / "plan2", open_dataset(paths))


def test_errors_name_the_shard(tmp_path):
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([1], [2], [600])))
    paths, _ = _shards(tmp_path)
    ds = open_dataset([paths[0], tmp_path / "bad.jsonl"])
    with pytest.raises(ValueError, match=r"part 1 of 2 \(.*bad.jsonl\): .*document 2 has token id 600"):
        ds.check_token_ids(500)
    with pytest.raises(ValueError, match=r"document 2 of part 1 \(.*bad\.jsonl\)"):
        for _ in Documents(ds, vocab_size=500):
            pass
    (tmp_path / "bad.jsonl").write_text("")
    with pytest.raises(ValueError, match="part 1 of 2: .*bad.jsonl changed since it was opened"):
        ds.check_unchanged()


def test_shards_declaring_different_label_conventions_are_refused(tmp_path):
    """A shard of HF labels ("inputs") beside one of Megatron targets ("targets"): no choice reads both right."""
    rng = np.random.default_rng(5)
    ids = [rng.integers(3, 500, 30) for _ in range(6)]
    hf = [{"input_ids": x, "labels": np.where(np.arange(30) < 5, -100, x)} for x in ids[:3]]
    megatron = [{"input_ids": x, "labels": np.append(np.where(np.arange(29) < 4, -100, x[1:]), -100)} for x in ids[3:]]
    write_token_store(hf, tmp_path / "hf", vocab_size=500, labels_alignment="inputs")
    write_token_store(megatron, tmp_path / "mg", vocab_size=500, labels_alignment="targets")
    write_megatron(_docs(5, 1), tmp_path / "plain_text_document", vocab_size=500)  # no labels, no convention
    with pytest.raises(ValueError, match=r"part 0 .*hf.* declare labels_alignment='inputs'; part 1 .*mg.* "
                                         r"declare labels_alignment='targets'.*shift them by one token"):
        open_dataset([tmp_path / "hf", tmp_path / "mg"])
    same = open_dataset([tmp_path / "hf", tmp_path / "plain_text_document", tmp_path / "hf"])
    assert same.labels_alignment == "inputs"  # a part without labels takes the others' convention
    assert open_dataset([tmp_path / "plain_text_document"] * 2).labels_alignment is None


def test_a_part_with_labels_and_no_declared_convention_beside_a_declared_one_is_refused(tmp_path):
    """Its labels could be either convention: taking the declared part's would shift them silently."""
    rng = np.random.default_rng(6)
    ids = [rng.integers(3, 500, 20) for _ in range(4)]
    write_token_store([{"input_ids": x, "labels": np.append(x[1:], -100)} for x in ids[:2]], tmp_path / "mg",
                      vocab_size=500, labels_alignment="targets")  # fmt: skip
    (tmp_path / "hf.jsonl").write_text("".join(json.dumps({"input_ids": x.tolist(), "labels": x.tolist()}) + "\n"
                                               for x in ids[2:]))  # fmt: skip
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"input_ids": x.tolist()}) + "\n" for x in ids[2:]))
    with pytest.raises(ValueError, match=r"part 1 \(.*hf.jsonl\) may carry labels or loss masks but declare no "
                                         r"labels_alignment, while part 0 \(.*mg\) declare labels_alignment='targets'"):
        open_dataset([tmp_path / "mg", tmp_path / "hf.jsonl"])
    assert open_dataset([tmp_path / "mg", tmp_path / "plain.jsonl"]).labels_alignment == "targets"  # no labels
    assert open_dataset([tmp_path / "hf.jsonl", tmp_path / "plain.jsonl"]).labels_alignment is None  # none declared


def test_precompute_verifies_every_stored_part(tmp_path):
    """A same-size edit in the second token store of a concatenation is refused by ``precompute``, naming the part
    and the file, as it is for that store alone; the clean concatenation plans the packs of one store holding both
    parts' documents."""
    parts = [_docs(20, 3), _docs(15, 4)]
    for name, docs in zip(("a_store", "b_store"), parts, strict=True):
        write_token_store(docs, tmp_path / name, vocab_size=500)
    paths = [tmp_path / "a_store", tmp_path / "b_store"]
    kw = {"capacity": 128, "cp_size": 2, "layout": "balanced", "overflow": "split"}
    precompute(open_dataset(paths), tmp_path / "clean", **precompute_records(**kw))
    write_token_store([d for part in parts for d in part], tmp_path / "joined", vocab_size=500)
    precompute(tmp_path / "joined", tmp_path / "listed", **precompute_records(**kw))
    clean, listed = read_store(tmp_path / "clean"), read_store(tmp_path / "listed")
    assert clean.n_packs == listed.n_packs > 3
    for name in ("pack_offsets", "doc_index", "doc_start", "slot_len"):
        np.testing.assert_array_equal(clean.arrays[name], listed.arrays[name])
    tokens = tmp_path / "b_store" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0x01  # the last token of part 1's last document: no read of part 0 touches it
    tokens.write_bytes(bytes(data))
    alone = rf"tokens\.bin bytes 0\.\.{len(data)} \(chunk 0 of 1\) do not match .*checking the whole file"
    with pytest.raises(ValueError, match=alone):
        precompute(tmp_path / "b_store", tmp_path / "b_plan", **precompute_records(**kw))
    with pytest.raises(ValueError, match=rf"^part 1 of 2 \({tmp_path / 'b_store'}\): token store file .*{alone}"):
        precompute(open_dataset(paths), tmp_path / "plan", **precompute_records(**kw))
    assert not (tmp_path / "plan").exists()
