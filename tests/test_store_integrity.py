"""Token store content checks: a same-size edit of any file is refused on every path that reads it.

Stores here span several 1 MiB chunks (2.4M uint16 tokens), so the tests see
a bad chunk refused while the others still serve, and errors name the right
byte range and document.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata import build_loader, open_dataset, precompute
from cpdata.cli import main as cli_main
from cpdata.nodes.loader import close_loader
from cpdata.sources import chunksums
from cpdata.sources.chunksums import CHUNK_BYTES, ChunkChecker, ChunkHasher
from cpdata.sources.manifest import canonical as _canonical
from cpdata.sources.manifest import manifest_digest as _manifest_digest
from cpdata.sources.tokenstore import TokenStore, write_token_store
from tests.flat_options import precompute_records, records

N_DOCS, DOC_TOKENS = 600, 4000  # 2.4M tokens x 2 bytes: chunks 0..4 of tokens.bin
PLAN = {"capacity": 8192, "cp_size": 1, "layout": "identity", "labels_alignment": "inputs"}


def _docs(n: int = N_DOCS) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    docs = []
    for i in range(n):
        doc = {"input_ids": rng.integers(0, 60_000, DOC_TOKENS)}
        if i % 2:
            doc["loss_mask"] = np.ones(DOC_TOKENS, dtype=np.int8)
        docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    docs = _docs()
    write_token_store(docs, root / "clean", vocab_size=60_000)
    return root / "clean", docs


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _flip_token(path, token: int) -> None:
    """Same size, one token changed (what no size check sees)."""
    with open(path, "r+b") as f:
        f.seek(2 * token)
        old = f.read(2)
        f.seek(2 * token)
        f.write(bytes([old[0] ^ 0x01, old[1]]))


def test_a_changed_token_is_refused_naming_file_byte_range_and_document(clean, tmp_path):
    store_dir = _copy(clean[0], tmp_path / "s")
    docs = clean[1]
    token = 2 * CHUNK_BYTES // 2 + 1000  # a token in chunk 2 of tokens.bin
    doc = token // DOC_TOKENS
    _flip_token(store_dir / "tokens.bin", token)
    store = open_dataset(store_dir)  # the open stays O(1): sizes match
    assert store.manifest["files"]["tokens"]["bytes"] > 4 * CHUNK_BYTES
    np.testing.assert_array_equal(store[0]["input_ids"], docs[0]["input_ids"])  # chunk 0 is fine
    lo, hi = 2 * CHUNK_BYTES, 3 * CHUNK_BYTES
    with pytest.raises(ValueError, match=rf"tokens.bin bytes {lo}\.\.{hi} \(chunk 2 of 5\) do not match .*"
                                         rf"while reading document {doc}; documents {lo // 2 // DOC_TOKENS}\.\.{hi // 2 // DOC_TOKENS} are stored "):  # fmt: skip
        store[doc]
    with pytest.raises(ValueError, match="do not match"):  # refused again, not remembered as checked
        store[doc]
    clone = pickle.loads(pickle.dumps(store))  # a worker process checks for itself
    with pytest.raises(ValueError, match=rf"document {doc}; "):
        clone[doc]


def test_build_loader_epoch_and_precompute_refuse_the_changed_store(clean, tmp_path):
    store_dir = _copy(clean[0], tmp_path / "s")
    last = N_DOCS * DOC_TOKENS - 1  # the last token of the last document: the last, short chunk
    _flip_token(store_dir / "tokens.bin", last)
    loader = build_loader(open_dataset(store_dir), **records(cp_rank=0, restart_on_stop_iteration=False, **PLAN))
    with pytest.raises(ValueError, match=rf"tokens.bin bytes {4 * CHUNK_BYTES}\.\.{2 * N_DOCS * DOC_TOKENS} "
                                         rf"\(chunk 4 of 5\).*documents \d+\.\.{N_DOCS - 1} are stored there"):  # fmt: skip
        for _ in loader:
            pass
    close_loader(loader)
    with pytest.raises(ValueError, match=rf"checking the whole file; documents \d+\.\.{N_DOCS - 1} are stored there"):
        precompute(store_dir, tmp_path / "plan", **precompute_records(**PLAN))
    assert not (tmp_path / "plan").exists()
    argv = ["precompute", str(store_dir), "--capacity", "8192", "--cp-size", "1", "--layout", "identity", "--out",
            str(tmp_path / "plan"), "--quiet", "--labels-alignment", "inputs"]  # fmt: skip
    assert cli_main(argv) == 1 and not (tmp_path / "plan").exists()


@pytest.mark.parametrize("file", ["tokens.bin", "offsets.npy", "loss_mask.present.npy"])
def test_a_dataloader_worker_checks_the_chunks_it_reads(clean, tmp_path, file):
    from cpdata import CPDataLoader, CPDataset

    store_dir = _copy(clean[0], tmp_path / "s")
    store = open_dataset(store_dir)
    for i in (0, N_DOCS - 1):
        store[i]  # the main process checked the index files and token chunks 0 and 4 before the edit ...
    assert all(c.complete for c in store._check_index)
    if file == "tokens.bin":
        _flip_token(store_dir / file, 10)
    else:  # the index files: a worker's first read checks them whole again
        header = store._offsets.offset if file == "offsets.npy" else store._checked_extras["loss_mask"][1].offset
        with open(store_dir / file, "r+b") as f:
            f.seek(header + 3)
            old = f.read(1)
            f.seek(header + 3)
            f.write(bytes([old[0] ^ 0x01]))
    loader = CPDataLoader(CPDataset(store, **records(cp_rank=0, **PLAN)), num_workers=1, multiprocessing_context="fork")
    with pytest.raises(ValueError, match=rf"{file} bytes 0\.\.\d+ \(chunk 0 of \d\) do not match"):  # ... the worker
        for _ in loader:
            pass


def test_the_first_read_checks_the_index_even_for_an_empty_document(tmp_path):
    docs = [{"input_ids": []}, *({"input_ids": [i, i + 1]} for i in range(9))]
    store = write_token_store(docs, tmp_path / "s", vocab_size=100)
    with open(tmp_path / "s" / "offsets.npy", "r+b") as f:
        f.seek(store._offsets.offset + 8 * 5)  # offsets[5]: documents 4 and 5 would move
        f.write(np.int64(7).tobytes())
    with pytest.raises(ValueError, match=r"offsets.npy bytes .*while reading document 0;"):
        TokenStore(tmp_path / "s")[0]  # document 0 reads no token byte, but the offsets that say so are checked


def test_the_plan_records_the_digest_of_the_bytes_it_read(clean, tmp_path):
    opened = TokenStore(clean[0])
    assert all(c.checked == 0 for c in opened._checkers())
    plan = precompute(opened, tmp_path / "plan", **precompute_records(**PLAN))
    assert plan.manifest["input"]["identity"] == opened.fingerprint() == f"token_store:{opened.manifest['manifest_sha256']}"
    # ... the digest covers the chunk checksums, and precompute checked every chunk of every file against them
    assert all(c.checked == len(c.sums) > 0 for c in opened._checkers())


def test_extras_offsets_and_flags_are_checked_too(clean, tmp_path):
    store_dir = _copy(clean[0], tmp_path / "s")
    mask = np.fromfile(store_dir / "loss_mask.bin", dtype=np.int8)
    assert mask.shape[0] == N_DOCS * DOC_TOKENS
    with open(store_dir / "loss_mask.bin", "r+b") as f:
        f.seek(DOC_TOKENS + 5)  # document 1 (it carries a mask)
        f.write(b"\x00")
    store = TokenStore(store_dir)
    store[0]  # document 0 has no mask: its flag is read, not the mask bytes
    with pytest.raises(ValueError, match=r"loss_mask.bin bytes 0\.\.\d+ .*document 1; documents 0\.\.\d+ are stored"):
        store[1]

    store_dir = _copy(clean[0], tmp_path / "o")
    header = TokenStore(store_dir)._offsets.offset
    with open(store_dir / "offsets.npy", "r+b") as f:
        f.seek(header + 8 * 10)  # offsets[10]: documents 9 and 10 would move
        f.write(np.int64(10 * DOC_TOKENS + 1).tobytes())
    store = TokenStore(store_dir)
    with pytest.raises(ValueError, match=r"offsets.npy bytes 0\.\.\d+ .*document 9; it holds the offsets of documents 0\.\.600\)"):
        store[9]
    with pytest.raises(ValueError, match=r"offsets.npy .*checking the whole file"):
        _ = TokenStore(store_dir).lengths


def _as_format_1(store_dir) -> None:
    """The manifest a store had before chunk checksums (cpdata format_version 1)."""
    manifest = json.loads((store_dir / "manifest.json").read_bytes())
    manifest["format_version"] = 1
    for key in ("chunk_bytes", "chunk_hash", "manifest_sha256"):
        manifest.pop(key)
    for entry in manifest["files"].values():
        entry.pop("chunks")
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (store_dir / "manifest.json").write_bytes(_canonical(manifest))


def test_a_format_1_store_is_hashed_whole_at_open_and_pack_store_rewrites_it(clean, tmp_path, capsys):
    old_dir = _copy(clean[0], tmp_path / "old")
    _as_format_1(old_dir)
    with pytest.warns(UserWarning, match=rf"format_version 1.*`cpdata pack-store {old_dir} --out NEW_DIR`"):
        old = TokenStore(old_dir)
    np.testing.assert_array_equal(old[N_DOCS - 1]["input_ids"], clean[1][-1]["input_ids"])
    _flip_token(old_dir / "tokens.bin", 123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"tokens.bin is corrupted \(sha256 differs"):
            TokenStore(old_dir)
        with pytest.raises(ValueError, match="do not match"):  # a process that opened it before the edit
            pickle.loads(pickle.dumps(old))[0]
    _flip_token(old_dir / "tokens.bin", 123)  # flipped back
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli_main(["pack-store", str(old_dir), "--out", str(tmp_path / "new"), "--quiet"]) == 0
    assert "600 documents" in capsys.readouterr().out
    new = TokenStore(tmp_path / "new")
    assert new.manifest["format_version"] == 2 and new.manifest == TokenStore(clean[0]).manifest
    for i in (0, 1, N_DOCS - 1):
        assert sorted(new[i]) == sorted(clean[1][i])


@pytest.mark.parametrize(("vocab", "dtype", "top"), [(65_536, "<u2", 65_535), (65_537, "<u4", 65_536)])
def test_the_token_dtype_boundary_keeps_the_top_id(tmp_path, vocab, dtype, top):
    store = write_token_store([{"input_ids": [0, top, 1]}, {"input_ids": [top]}], tmp_path / "s", vocab_size=vocab)
    assert store.manifest["dtype"] == dtype and store.manifest["max_id"] == top
    assert (tmp_path / "s" / "tokens.bin").stat().st_size == 4 * np.dtype(dtype).itemsize
    opened = TokenStore(tmp_path / "s", verify=True)
    assert opened[0]["input_ids"].tolist() == [0, top, 1] and opened[1]["input_ids"].tolist() == [top]
    with pytest.raises(ValueError, match=rf"token id {vocab} at position 0, >= vocab_size={vocab}"):
        write_token_store([{"input_ids": [vocab]}], tmp_path / "over", vocab_size=vocab)


def test_a_store_with_masks_needs_an_alignment_to_be_planned_as_jsonl_does(clean, tmp_path):
    store = TokenStore(clean[0])
    assert store.per_token_keys == {"loss_mask"} and store.labels_alignment is None
    with pytest.raises(ValueError, match=r"carries \['loss_mask'\] but labels_alignment is not set"):
        precompute(store, tmp_path / "plan", capacity=8192, cp_size=1, layout="identity")


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(0, 120), st.sampled_from([1, 2, 4, 8, 32]), st.sampled_from([1, 2, 4]))
def test_a_read_inside_the_checked_span_needs_no_check_and_every_read_byte_is_checked(data, n, chunk_bytes, width):
    """The store's fast path (a read inside ``span`` skips ``check``) against the chunks each read overlaps."""
    raw = np.random.default_rng(n).integers(0, 256, n * width, dtype=np.uint8)
    hasher = ChunkHasher(chunk_bytes)
    hasher.update(raw.tobytes())
    checker = ChunkChecker(Path("f.bin"), hasher.finish(), raw.size, chunk_bytes, "fix", data=raw, itemsize=width)
    needed: set[int] = set()
    reach, chunksums._REACH = chunksums._REACH, data.draw(st.sampled_from([1, 3, chunksums._REACH]))
    try:
        _reads(data, checker, n, width, chunk_bytes, needed)
    finally:
        chunksums._REACH = reach
    checker.check_all()
    assert checker.complete and (n == 0 or checker.span == (0, n))  # (an empty file's span stays empty)


def _reads(data, checker: ChunkChecker, n: int, width: int, chunk_bytes: int, needed: set[int]) -> None:
    for _ in range(data.draw(st.integers(1, 12))):
        start = data.draw(st.integers(0, n))
        stop = data.draw(st.integers(start, n))
        lo, hi = checker.span
        if start < lo or stop > hi:
            checker.check(start * width, stop * width, None)
        if stop > start:
            needed |= set(range(start * width // chunk_bytes, -(-stop * width // chunk_bytes)))
        assert checker.checked == len(needed)  # every chunk the read overlaps, and no other, is checked
        lo, hi = checker.span
        if lo < hi:  # the span lies in checked chunks
            assert set(range(lo * width // chunk_bytes, -(-hi * width // chunk_bytes))) <= needed
