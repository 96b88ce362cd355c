"""Same-length in-place edits of one token, at the first, a middle and the last document, for every source kind.

A fingerprint that hashed only dtype and shape, or never sampled the last item,
would pass tests that change lengths; here nothing changes but one value. Each
kind is asked what its contract promises (:mod:`cpdata.sources.fingerprint`):

| source | after the edit |
|---|---|
| list | ``check_source_unchanged`` raises; the fingerprint differs |
| JSONL | reading the document raises (CRC-32 from the scan); ``check_unchanged`` raises; a reopen's fingerprint differs |
| ``.npy`` folder | reading the document raises; ``check_unchanged`` raises; a reopen's fingerprint differs |
| HF ``datasets`` on disk | ``check_unchanged`` raises; a reopen's fingerprint differs |
| token store | reading the document raises (chunk checksum); ``verify_content`` raises |

The middle document is a sampled one (lists and HF datasets sample 16 evenly
spaced items; the file formats check every document they read).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from cpdata.sources import open_dataset
from cpdata.sources.fingerprint import (
    LIST_SAMPLES,
    check_source_unchanged,
    sample_positions,
    source_fingerprint,
)
from cpdata.sources.tokenstore import write_token_store

N = 41  # more than LIST_SAMPLES: the middle document is sampled, not every one
MIDDLE = sample_positions(N, LIST_SAMPLES)[LIST_SAMPLES // 2]
POSITIONS = {"first": 0, "middle": MIDDLE, "last": N - 1}


def _docs() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(1000, 9000, 12) for _ in range(N)]  # 4 digits each: an edit keeps every line's length


def _edited(ids: np.ndarray) -> np.ndarray:
    out = ids.copy()
    out[5] = 1000 + (int(out[5]) - 999) % 8000  # another 4-digit id, same dtype and length
    return out


def _later() -> None:
    """Let the clock move past the open's mtime (file systems stamp at a few ms granularity)."""
    time.sleep(0.02)


def test_the_middle_position_is_sampled_and_the_last_too():
    assert MIDDLE not in (0, N - 1) and N - 1 in sample_positions(N, LIST_SAMPLES)


@pytest.mark.parametrize("where", POSITIONS)
def test_list(where):
    docs = [{"input_ids": d} for d in _docs()]
    opened = source_fingerprint(docs)
    docs[POSITIONS[where]]["input_ids"][:] = _edited(docs[POSITIONS[where]]["input_ids"])  # in place
    assert source_fingerprint(docs) != opened
    with pytest.raises(ValueError, match="input_ids edited in place"):
        check_source_unchanged(docs, opened)


@pytest.mark.parametrize("where", POSITIONS)
def test_jsonl(tmp_path, where):
    path = tmp_path / "d.jsonl"
    docs = _docs()
    path.write_text("".join(json.dumps({"input_ids": d.tolist()}) + "\n" for d in docs))
    data = open_dataset(path)
    opened, size = source_fingerprint(data), path.stat().st_size
    i = POSITIONS[where]
    docs[i] = _edited(docs[i])
    _later()
    with open(path, "r+b") as f:  # rewrite in place, every line the same length
        f.write("".join(json.dumps({"input_ids": d.tolist()}) + "\n" for d in docs).encode())
    assert path.stat().st_size == size
    with pytest.raises(ValueError, match=rf"document {i} \(byte offset \d+\) changed since the file was opened"):
        data[i]
    with pytest.raises(ValueError, match=rf"document {i} .*changed since the file was opened"):
        data.check_unchanged()
    assert source_fingerprint(open_dataset(path)) != opened


@pytest.mark.parametrize("where", POSITIONS)
def test_npy_folder(tmp_path, where):
    folder = tmp_path / "f"
    folder.mkdir()
    docs = _docs()
    for k, d in enumerate(docs):
        np.save(folder / f"{k:03d}.npy", d)
    data = open_dataset(folder)
    opened = source_fingerprint(data)
    i = POSITIONS[where]
    _later()
    np.save(folder / f"{i:03d}.npy", _edited(docs[i]))  # same size, one value changed
    with pytest.raises(ValueError, match=rf"{i:03d}\.npy \(document {i}\) changed since the folder was opened"):
        data[i]
    with pytest.raises(ValueError, match=rf"\(document {i}\) changed"):
        data.check_unchanged()
    assert source_fingerprint(open_dataset(folder)) != opened


def _arrow_files(root):
    return sorted(root.glob("*.arrow"))


@pytest.mark.parametrize("where", POSITIONS)
def test_hf_dataset_on_disk(tmp_path, where):
    datasets = pytest.importorskip("datasets")
    docs = _docs()
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]}, features=features).save_to_disk(
        str(tmp_path / "ds"))
    data = open_dataset(tmp_path / "ds")
    opened = source_fingerprint(data)
    i = POSITIONS[where]
    (arrow,) = _arrow_files(tmp_path / "ds")
    raw = bytearray(arrow.read_bytes())
    old = docs[i].astype("<i4").tobytes()
    assert raw.count(old) == 1  # the document's values, stored once
    at = raw.index(old)
    raw[at : at + len(old)] = _edited(docs[i]).astype("<i4").tobytes()
    with open(arrow, "r+b") as f:  # in place: the memory-mapped dataset sees the new bytes, same size
        f.write(bytes(raw))
    assert data[i]["input_ids"].tolist() == _edited(docs[i]).tolist()
    with pytest.raises(ValueError, match=r"input_ids of sampled rows .* differ"):
        data.check_unchanged()
    assert source_fingerprint(open_dataset(tmp_path / "ds")) != opened


@pytest.mark.parametrize("where", POSITIONS)
def test_token_store(tmp_path, where):
    docs = _docs()
    store = write_token_store([{"input_ids": d} for d in docs], tmp_path / "s", vocab_size=10_000)
    i = POSITIONS[where]
    with open(tmp_path / "s" / "tokens.bin", "r+b") as f:
        f.seek(2 * (12 * i + 5))
        f.write(np.uint16(_edited(docs[i])[5]).tobytes())
    data = open_dataset(tmp_path / "s")
    with pytest.raises(ValueError, match=rf"tokens.bin bytes 0\.\.{2 * 12 * N} .*while reading document {i};"):
        data[i]
    with pytest.raises(ValueError, match=r"tokens.bin .* do not match"):
        store.verify_content()
