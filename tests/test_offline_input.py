"""Bad bytes and bad ids in offline inputs: refused at open / plan time, naming file, line, offset or document."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cpdata.cli import main as cli_main
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.offline import precompute
from cpdata.offline.tokenize_files import convert_jsonl
from cpdata.sources import open_dataset


def _opened(path, reader: str):
    """``path`` read by ``open_dataset`` or converted by ``cpdata pack-store`` (one parser, the same
    refusals); a refused conversion leaves no store behind."""
    if reader == "open_dataset":
        return open_dataset(path)
    out = path.with_name("store")
    try:
        return convert_jsonl(path, out)[0]
    finally:
        assert out.exists() == (out / "tokens.bin").is_file()  # written whole, or not at all


def _rows(*rows: dict) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.mark.parametrize("reader", ["open_dataset", "pack-store"])
@pytest.mark.parametrize("field", ["input_ids", "meta"])
def test_invalid_utf8_names_file_line_offset_and_encoding(tmp_path, field, reader):
    """One bad byte anywhere in a row, even in a field the reader ignores, is named precisely."""
    head = _rows({"input_ids": [1, 2]}, {"input_ids": [3], "meta": "ok"})
    if field == "meta":
        bad = b'{"input_ids": [4, 5], "meta": "caf\xe9"}\n'
        column = bad.index(b"\xe9")
    else:
        bad = b'{"input_ids": [4, 5\xff]}\n'
        column = bad.index(b"\xff")
    path = tmp_path / "bad.jsonl"
    path.write_bytes(head + bad + _rows({"input_ids": [6]}))
    with pytest.raises(ValueError) as info:
        _opened(path, reader)
    message = str(info.value)
    for part in (str(path), "line 3", f"byte offset {len(head) + column}", "invalid UTF-8 byte 0x",
                 "must be UTF-8"):  # fmt: skip
        assert part in message, (part, message)


@pytest.mark.parametrize("reader", ["open_dataset", "pack-store"])
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_utf16_file_is_named_as_such(tmp_path, encoding, reader):
    """``json.loads`` of bytes would decode UTF-16/32; both readers refuse it as not UTF-8."""
    path = tmp_path / "wide.jsonl"
    path.write_bytes(_rows({"input_ids": [1, 2]}, {"input_ids": [3]}).decode().encode(encoding))
    with pytest.raises(ValueError) as info:
        _opened(path, reader)
    message = str(info.value)
    for part in (str(path), "line 1", "byte offset", "UTF-16 or UTF-32", "must be UTF-8", "iconv"):
        assert part in message, (part, message)
    if encoding in ("utf-16", "utf-32"):
        assert "byte-order mark" in message


@pytest.mark.parametrize("reader", ["open_dataset", "pack-store"])
def test_utf8_byte_order_mark_and_non_ascii_text_are_accepted(tmp_path, reader):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _rows({"input_ids": [1, 2], "meta": "café ✓"}, {"input_ids": [3]}))
    data = _opened(path, reader)
    assert [d["input_ids"].tolist() for d in data] == [[1, 2], [3]]


def test_a_row_whose_bytes_went_bad_after_opening_names_the_document(tmp_path):
    """Bytes that change after opening (here to invalid UTF-8) are refused on read, with the document and offset."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(_rows({"input_ids": [1, 2], "meta": "aa"}, {"input_ids": [3, 4], "meta": "bb"}))
    data = open_dataset(path)
    raw = bytearray(path.read_bytes())
    at = raw.rindex(b"bb")
    raw[at] = 0xFF
    path.write_bytes(bytes(raw))
    row = raw.index(b'{"input_ids": [3')
    with pytest.raises(ValueError, match=rf"document 1 \(byte offset {row}\) changed since the file was opened"):
        data[1]


# ---------------------------------------------------------------------------------------------- token ids


def _jsonl(tmp_path, docs) -> str:
    path = tmp_path / "ids.jsonl"
    path.write_bytes(_rows(*({"input_ids": d} for d in docs)))
    return str(path)


def _folder(tmp_path, docs) -> str:
    folder = tmp_path / "ids"
    folder.mkdir()
    for i, d in enumerate(docs):
        np.save(folder / f"{i:03d}.npy", np.array(d, dtype=np.int64))
    return str(folder)


@pytest.mark.parametrize("fmt", [_jsonl, _folder], ids=["jsonl", "folder"])
@pytest.mark.parametrize(("bad", "vocab", "parts"), [
    ([5, -1, 2], None, ["document 3 has token id -1 at position 1", "must be >= 0"]),
    ([5, -1, 2], 100, ["document 3 has token id -1 at position 1", "must be >= 0"]),
    ([-100], None, ["document 3 has token id -100 at position 0", "'labels'"]),
    ([5, 100, 2], 100, ["document 3 has token id 100 at position 1", "vocab_size=100"]),
    ([99, 7], 100, None),
    ([1000], None, None),
])  # fmt: skip
def test_precompute_refuses_bad_ids_with_the_document_and_writes_nothing(tmp_path, fmt, bad, vocab, parts):
    docs = [[1, 2, 3], [4], [5, 6], bad, [7, 8]]
    data = fmt(tmp_path, docs)
    out = tmp_path / "plan"
    if parts is None:
        precompute(data, out, capacity=16, cp_size=1, layout="identity", data=DataPolicy(vocab_size=vocab))
        assert (out / "manifest.json").is_file()
        return
    with pytest.raises(ValueError) as info:
        precompute(data, out, capacity=16, cp_size=1, layout="identity", data=DataPolicy(vocab_size=vocab))
    message = str(info.value)
    assert all(p in message for p in parts), (parts, message)
    assert data in message
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(data)], "no plan, no temp directory"


def test_cli_vocab_size_refusal_names_the_document(tmp_path, capsys):
    data = _jsonl(tmp_path, [[1, 2], [3, 4096]])
    code = cli_main(["precompute", data, "--capacity", "16", "--cp-size", "1", "--layout", "identity",
                     "--vocab-size", "4096", "--out", str(tmp_path / "plan"), "--quiet"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "document 1 has token id 4096 at position 1" in err and ">= --vocab-size 4096" in err
    assert not (tmp_path / "plan").exists()


def test_vocab_size_with_a_lengths_file_is_refused(tmp_path):
    np.save(tmp_path / "lengths.npy", np.array([3, 4], dtype=np.int64))
    with pytest.raises(ValueError, match="holds document lengths only"):
        precompute(tmp_path / "lengths.npy", tmp_path / "plan", capacity=16, cp_size=1, layout="identity", data=DataPolicy(vocab_size=10))  # fmt: skip


# ---------------------------------------------------------------------------------------------- long documents


@pytest.mark.parametrize(("algorithm", "dp_size"), [("bfd", 1), ("concat", 1), ("bfd", 2)])
def test_a_long_document_is_parsed_once_per_epoch_not_once_per_piece(tmp_path, monkeypatch, algorithm, dp_size):
    """A document cut into many pieces is read once per epoch (per DP rank) by the offline reader."""
    from cpdata.offline import PrecomputedPacks
    from cpdata.sources.files import JsonlDocuments

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(1, 60, 40)]
    docs.insert(20, rng.integers(0, 1000, 5000).tolist())  # 5000 tokens at capacity 128: ~40 pieces
    data = _jsonl(tmp_path, docs)
    precompute(data, tmp_path / "plan", capacity=128, cp_size=2, layout="thd", plan=StreamPlan(overflow="split", algorithm=algorithm))
    reads: list[int] = []
    real_read = JsonlDocuments._read
    monkeypatch.setattr(JsonlDocuments, "_read", lambda self, i: (reads.append(i), real_read(self, i))[1])
    dataset = open_dataset(data)
    for rank in range(dp_size):
        plans = PrecomputedPacks(tmp_path / "plan", dataset, data=DataPolicy(dp_rank=rank, dp_size=dp_size))
        plans.reset()
        pieces_of_long = sum(1 for plan in plans for p in plan.pieces if p.index == 20)
        assert pieces_of_long >= 30 // dp_size, "the long document must be cut into many pieces"
        for epoch in range(2):
            reads.clear()
            plans.reset()
            assert sum(1 for _ in plans) == len(plans)
            assert reads.count(20) == 1, (epoch, reads.count(20))
            assert len(reads) == len(set(reads)), "every document is read once per epoch"
    # the tokens served are the document's tokens: the pieces tile it (checked against the file)
    plans = PrecomputedPacks(tmp_path / "plan", dataset)
    got = sorted((p.start, p.arrays["input_ids"].tolist()) for plan in plans for p in plan.pieces if p.index == 20)
    assert [t for _, ids in got for t in ids] == docs[20]


def _store(tmp_path, docs):
    from cpdata.sources.tokenstore import write_token_store

    return write_token_store([{"input_ids": np.array(d, dtype=np.int64)} for d in docs], tmp_path / "store")


def _hf(tmp_path, docs):
    import datasets

    from cpdata.sources.hf import HFDocuments

    return HFDocuments(datasets.Dataset.from_dict({"input_ids": docs}))


@pytest.mark.parametrize("reader", [lambda t, d: open_dataset(_jsonl(t, d)), _store, _hf], ids=["jsonl", "store", "hf"])
def test_a_known_id_range_answers_the_id_check_without_reading_and_a_bad_one_names_the_document(
    tmp_path, reader, monkeypatch
):
    data = reader(tmp_path, [[1, 2, 3], [4], [5, 6], [5, 100, 2], [7, 8]])
    read, original = [], type(data)._read
    monkeypatch.setattr(type(data), "_read", lambda self, i: read.append(i) or original(self, i))
    data.check_token_ids(101)
    data.check_token_ids()
    assert read == []  # the reader knew every id
    with pytest.raises(ValueError, match="document 3 has token id 100 at position 1, >= vocab_size=100"):
        data.check_token_ids(100)
    assert read[-1] == 3
