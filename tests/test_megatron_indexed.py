"""Megatron indexed datasets: written by megatron-core's own builder, read back by cpdata exactly (every dtype,
multi-sequence documents), packed, precomputed; cpdata's writer read back by megatron-core's ``IndexedDataset``;
bad input refused naming the file."""

from __future__ import annotations

import json
import pickle
import warnings

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    pytest.importorskip("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
import torch

from cpdata import (
    Collate,
    PrecomputedPacks,
    ShardForRank,
    build_loader,
    close_loader,
    open_dataset,
    precompute,
)
from cpdata.cli import main as cli_main
from cpdata.sources.megatron import MegatronIndexed
from cpdata.sources.megatron_writer import write_megatron
from tests.flat_options import precompute_records, records
from tests.test_precompute import assert_batches_equal
from tests.tokenizer_fixture import CORPUS, chat_tokenizer

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64, np.uint16]


def _docs(n=60, vocab=120, seed=0, empty=True):
    rng = np.random.default_rng(seed)
    lo = 1 if not empty else 0
    return [rng.integers(0, vocab, int(rng.integers(lo, 40))) for _ in range(n)]


def _build(prefix, docs, dtype, split=None):
    """megatron-core writes ``docs``; ``split[i]`` = the sentence lengths of document i (--split-sentences)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i, ids in enumerate(docs):
        lengths = [len(ids)] if split is None else split[i]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), lengths)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _sentences(docs, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for ids in docs:
        cuts = np.sort(rng.integers(0, len(ids) + 1, int(rng.integers(0, 4))))
        out.append(np.diff(np.concatenate([[0], cuts, [len(ids)]])).tolist())
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_document_reads_back_exactly_for_every_dtype(tmp_path, dtype):
    docs = _docs()
    prefix = _build(tmp_path / "c_text_document", docs, dtype)
    ds = open_dataset(prefix)
    assert isinstance(ds, MegatronIndexed) and ds.dtype == np.dtype(dtype) and len(ds) == len(docs)
    assert sum(len(d) == 0 for d in docs) > 0  # empty documents are documents too
    np.testing.assert_array_equal(ds.lengths, [len(d) for d in docs])
    for i, ids in enumerate(docs):
        got = ds[i]
        assert list(got) == ["input_ids"] and got["input_ids"].dtype == np.int64
        np.testing.assert_array_equal(got["input_ids"], ids)
    for path in (f"{prefix}.bin", f"{prefix}.idx"):  # either file of the pair names the prefix
        assert open_dataset(path).fingerprint() == ds.fingerprint()
    ds.check_token_ids(120)
    with pytest.raises(ValueError, match=r"document \d+ has token id 11\d at position \d+, >= vocab_size=110"):
        ds.check_token_ids(110)


def test_split_sentence_documents_are_their_sentences_concatenated(tmp_path):
    docs = _docs(80, vocab=60000, empty=False)
    split = _sentences(docs)
    assert max(map(len, split)) > 2 and any(0 in s for s in split)  # several sentences, some empty
    prefix = _build(tmp_path / "s", docs, np.uint16, split)
    meg = IndexedDataset(prefix)
    ds = open_dataset(prefix)
    assert len(ds) == len(docs) and ds.sequences == len(meg) == sum(map(len, split))
    for d, ids in enumerate(docs):
        np.testing.assert_array_equal(ds[d]["input_ids"], ids)
        first, last = int(meg.document_indices[d]), int(meg.document_indices[d + 1])
        np.testing.assert_array_equal(ds[d]["input_ids"], np.concatenate([meg[j] for j in range(first, last)]))
    np.testing.assert_array_equal(ds.lengths, [len(d) for d in docs])
    fresh = MegatronIndexed(prefix)  # reads before lengths are known check each document's own index rows
    np.testing.assert_array_equal(fresh[5]["input_ids"], docs[5])
    sentences = MegatronIndexed(prefix, unit="sequences")
    assert len(sentences) == len(meg) and sentences.fingerprint() != ds.fingerprint()
    for j in range(len(meg)):
        np.testing.assert_array_equal(sentences[j]["input_ids"], meg[j])
    np.testing.assert_array_equal(sentences.lengths, meg.sequence_lengths)


def test_open_is_o1_and_pickles_small(tmp_path, monkeypatch):
    docs = _docs(2000)
    prefix = _build(tmp_path / "c", docs, np.int32)
    ds = open_dataset(prefix)
    assert ds._lengths is None and isinstance(ds._tokens.base, np.memmap)  # nothing scanned at open: a map
    blob = pickle.dumps(ds)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone[1999]["input_ids"], docs[1999])
    assert clone.fingerprint() == ds.fingerprint() == MegatronIndexed(prefix).fingerprint()


def test_packs_and_precomputes_like_the_online_pipeline(tmp_path):
    docs = _docs(90, vocab=30000, empty=False)
    prefix = _build(tmp_path / "c", docs, np.uint16, _sentences(docs))
    kw = {"capacity": 64, "cp_size": 2, "layout": "thd", "overflow": "split"}
    reference = [{"input_ids": ids.astype(np.int64)} for ids in docs]
    loader = build_loader(reference, **records(cp_rank=1, restart_on_stop_iteration=False, **kw))
    online = list(loader)
    close_loader(loader)
    assert len(online) > 5
    from_megatron = build_loader(open_dataset(prefix), **records(cp_rank=1, restart_on_stop_iteration=False, **kw))
    got = list(from_megatron)
    close_loader(from_megatron)
    assert len(got) == len(online)
    for a, e in zip(got, online, strict=True):
        assert_batches_equal(a, e)
    store = precompute(prefix, tmp_path / "plan", **precompute_records(**kw))
    assert store.manifest["input"]["kind"] == "megatron" and store.manifest["input"]["documents"] == len(docs)
    served = list(ShardForRank(Collate(PrecomputedPacks(tmp_path / "plan", open_dataset(prefix))),
                               cp_size=2, cp_rank=1, layout="thd"))  # fmt: skip
    assert len(served) == len(online)
    for a, e in zip(served, online, strict=True):
        assert_batches_equal(a, e)
    other = _build(tmp_path / "d", docs[:-1], np.uint16)
    with pytest.raises(ValueError, match="was precomputed from 'c'"):
        PrecomputedPacks(tmp_path / "plan", open_dataset(other))


@pytest.mark.parametrize("vocab", [300, 70_000, None])
def test_cpdatas_writer_is_megatrons_builder_byte_for_byte(tmp_path, vocab):
    docs = _docs(50, vocab=vocab or 1 << 20)
    ours = write_megatron([{"input_ids": d} for d in docs], tmp_path / "ours", vocab_size=vocab)
    dtype = np.uint16 if vocab == 300 else np.int32  # megatron-core's DType.optimal_dtype
    theirs = _build(tmp_path / "theirs", docs, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    meg = IndexedDataset(str(tmp_path / "ours"))
    assert len(meg) == len(docs) == len(ours) and meg.index.dtype == dtype
    for i, ids in enumerate(docs):
        np.testing.assert_array_equal(meg[i], ids)
    assert ours.fingerprint() == open_dataset(theirs).fingerprint()
    assert [x.tolist() for x in meg[3:7]] == [d.tolist() for d in docs[3:7]]


def test_tokenize_command_writes_megatron(tmp_path, capsys):
    chat_tokenizer().save_pretrained(tmp_path / "tok")
    tok = str(tmp_path / "tok")
    rows = tmp_path / "t.jsonl"
    rows.write_text("".join(json.dumps({"text": line}) + "\n" for line in CORPUS * 7)[: -1] + "\n")
    assert cli_main(["tokenize", str(rows), "--tokenizer", tok, "--append-eos", "--format", "megatron",
                     "--out", str(tmp_path / "m"), "--quiet"]) == 0  # fmt: skip
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["tokenize", str(rows), "--tokenizer", tok, "--append-eos", "--out", str(tmp_path / "s"),
                     "--quiet"]) == 0  # fmt: skip
    store, meg = open_dataset(tmp_path / "s"), IndexedDataset(str(tmp_path / "m"))
    assert len(meg) == len(store) == 7 * len(CORPUS)
    for i in range(len(meg)):
        np.testing.assert_array_equal(meg[i], store[i]["input_ids"])
    assert cli_main(["tokenize", str(rows), "--tokenizer", tok, "--format", "megatron", "--out",
                     str(tmp_path / "m")]) != 0  # fmt: skip
    assert "m.idx already exist; pass --force" in capsys.readouterr().err
    assert cli_main(["tokenize", str(rows), "--tokenizer", tok, "--format", "megatron", "--assistant-only",
                     "--out", str(tmp_path / "m2")]) != 0  # fmt: skip
    assert "a Megatron indexed dataset holds input_ids only" in capsys.readouterr().err
    assert not list(tmp_path.glob("m2*"))


def test_bad_input_is_refused_naming_the_file_and_the_fix(tmp_path):
    docs = _docs(30, empty=False)
    prefix = _build(tmp_path / "c", docs, np.int32)
    bin_, idx = tmp_path / "c.bin", tmp_path / "c.idx"
    good_bin, good_idx = bin_.read_bytes(), idx.read_bytes()

    def refused(match):
        with pytest.raises(ValueError, match=match):
            open_dataset(prefix)

    bin_.write_bytes(good_bin[:-4])
    refused(r"c\.bin has \d+ bytes but .*c\.idx says its last sequence ends at byte \d+: the \.bin is truncated")
    bin_.write_bytes(good_bin + b"\0" * 4)
    refused(r"longer than its index: the \.idx belongs to another \.bin")
    bin_.write_bytes(good_bin)
    idx.write_bytes(b"TNTIDX\x00\x00" + good_idx[8:])
    refused(r"c\.idx is not a Megatron indexed-dataset index \(the legacy non-mmap 'TNTIDX'")
    idx.write_bytes(good_idx[:-8])
    refused(r"c\.idx has \d+ bytes, but its header's counts \(30 sequences, 31 document indices\) need \d+")
    idx.write_bytes(good_idx[:9] + (2).to_bytes(8, "little") + good_idx[17:])
    refused("has index version 2")
    idx.write_bytes(good_idx[:17] + bytes([9]) + good_idx[18:])
    refused("declares dtype code 9")
    damaged = bytearray(good_idx)
    damaged[34 + 4 * 30 + 8 * 5 : 34 + 4 * 30 + 8 * 6] = (10**6).to_bytes(8, "little")  # pointer of sequence 5
    idx.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"sequence 5 .* does not follow the one before it"):
        _ = MegatronIndexed(prefix)[5]
    with pytest.raises(ValueError, match=r"sequence 5 .* does not follow the one before it"):
        _ = MegatronIndexed(prefix).lengths
    damaged = bytearray(good_idx)
    damaged[34 + 12 * 30 + 8 * 29 : 34 + 12 * 30 + 8 * 30] = (31).to_bytes(8, "little")  # past the 30 sequences
    idx.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"document 28 spans sequences 28\.\.31; the index is damaged"):
        _ = MegatronIndexed(prefix)[28]  # read before .lengths checked the whole index
    idx.unlink()
    with pytest.raises(ValueError, match=r"c\.idx does not exist; a Megatron indexed dataset is PREFIX\.bin and"):
        open_dataset(prefix)
    idx.write_bytes(good_idx)
    ds = open_dataset(prefix)
    bin_.write_bytes(good_bin[:-4])
    with pytest.raises(ValueError, match="Megatron data file .*c.bin changed since it was opened"):
        ds.check_unchanged()
    bin_.write_bytes(good_bin[::-1])  # same size, other bytes
    with pytest.raises(ValueError, match="rewritten since it was opened"):
        ds.check_unchanged()
    with pytest.raises(ValueError, match=r"carries \['labels'\], but a Megatron indexed dataset holds input_ids only"):
        write_megatron([{"input_ids": [1], "labels": [1]}], tmp_path / "x")
    with pytest.raises(ValueError, match="document 1 has token id 300 at position 0, >= vocab_size=300"):
        write_megatron([{"input_ids": [1]}, {"input_ids": [300]}], tmp_path / "x", vocab_size=300)
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob(".x*"))  # nothing half-written
    with pytest.raises(ValueError, match="document 0 has token id 70000 at position 0, >= vocab_size=65536"):
        write_megatron([{"input_ids": [70_000]}], tmp_path / "x", dtype=np.uint16)
    floats = _build(tmp_path / "f", [np.array([1, 2, 3])], np.float32)
    (tmp_path / "f.bin").write_bytes(np.array([1, 2.5, 3], np.float32).tobytes())
    with pytest.raises(ValueError, match="document 0 holds 2.5 at position 1; token ids are whole numbers"):
        _ = open_dataset(floats)[0]
    with pytest.raises(ValueError, match="document 0 holds 2.5 at position 1; token ids are whole numbers"):
        open_dataset(floats).check_token_ids()  # the id scan (precompute's) finds it too, without a read first


def test_multimodal_indexes_read_text_and_refuse_other_modes(tmp_path):
    docs = _docs(12, empty=False)
    builder = IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.int32, multimodal=True)
    for i, ids in enumerate(docs):
        half = len(ids) // 2
        builder.add_document(torch.tensor(ids), [half, len(ids) - half], modes=[0, 1 if i == 9 else 0])
    builder.finalize(str(tmp_path / "mm.idx"))
    ds = open_dataset(tmp_path / "mm")
    assert ds.multimodal and ds.sequences == 24
    for i in range(9):
        np.testing.assert_array_equal(ds[i]["input_ids"], docs[i])
    with pytest.raises(ValueError, match=r"mm\.idx: sequence 19 has mode 1 \(a multimodal build's non-text item\)"):
        _ = ds[9]
    with pytest.raises(ValueError, match="sequence 19 has mode 1"):
        _ = ds.lengths


def test_an_empty_dataset_opens_empty(tmp_path):
    ds = write_megatron([], tmp_path / "none")
    assert len(ds) == 0 and ds.lengths.shape == (0,)  # (megatron-core's reader cannot mmap the empty .bin)
    assert (tmp_path / "none.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert open_dataset(tmp_path / "none").fingerprint() == ds.fingerprint()
