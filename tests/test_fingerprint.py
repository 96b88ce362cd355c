"""Data that changes under a run, and resumes onto other data of the same shape: refused, naming what changed."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from cpdata.nodes.loader import build_loader, closing_loader
from cpdata.nodes.options import StreamPlan
from cpdata.offline import PrecomputedPacks, precompute
from cpdata.sources import open_dataset
from cpdata.sources.fingerprint import source_fingerprint
from tests.flat_options import records

CFG = dict(capacity=64, cp_size=2, cp_rank=0, layout="thd", window=4, overflow="split", prefetch=0)


def _docs(seed: int, n: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, int(k)).tolist() for k in rng.integers(1, 40, n)]


def _write(path, docs, width: int = 4) -> str:
    """JSONL with every id printed at a fixed width, so an in-place edit keeps every line's length."""
    with open(path, "w") as f:
        for d in docs:
            f.write('{"input_ids": [' + ", ".join(f"{t:{width}d}" for t in d) + "]}\n")
    return str(path)


def _edit_in_place(path: str, doc: int) -> None:
    """Change one id of document ``doc`` without changing any line length."""
    lines = open(path, "rb").read().split(b"\n")
    row = json.loads(lines[doc])
    row_ids = row["input_ids"]
    old = f"{row_ids[0]:4d}".encode()
    new = f"{(row_ids[0] + 1) % 1000:4d}".encode()
    lines[doc] = lines[doc].replace(old, new, 1)
    with open(path, "r+b") as f:
        f.write(b"\n".join(lines))


def _epochs(loader, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        out.append([b.info["digest"] for b in loader])
    return out


# ---------------------------------------------------------------------------------------------- edited in place


def test_a_document_edited_in_place_mid_epoch_raises_naming_file_and_document(tmp_path):
    path = _write(tmp_path / "d.jsonl", _docs(0, n=200))
    with closing_loader(build_loader(open_dataset(path), **records(block_size=16, **CFG))) as loader:
        it = iter(loader)
        next(it)
        _edit_in_place(path, 150)  # a document not read yet (the first block of 16 batches reads ~50)
        with pytest.raises(ValueError) as info:
            for _ in it:
                pass
    message = str(info.value)
    assert path in message and "document 150" in message and "changed since the file was opened" in message


def test_a_document_edited_between_epochs_is_refused_at_the_epoch_start(tmp_path):
    path = _write(tmp_path / "d.jsonl", _docs(0))
    with closing_loader(build_loader(open_dataset(path), **records(**CFG))) as loader:
        first = [b.info["digest"] for b in loader]
        assert first
        _edit_in_place(path, 0)
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
        with pytest.raises(ValueError, match=r"document 0 \(byte offset 0\) changed since the file was opened"):
            next(iter(loader))



def test_the_check_itself_reads_sampled_rows_when_the_mtime_moved(tmp_path):
    """``check_unchanged`` (each epoch's start) of a JSONL file edited in place, same size, mtime moved: the
    last row, always sampled, is compared before any read reaches it."""
    docs = _docs(0)
    path = _write(tmp_path / "d.jsonl", docs)
    data = open_dataset(path)
    data.check_unchanged()
    _edit_in_place(path, len(docs) - 1)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=rf"document {len(docs) - 1} \(byte offset \d+\) changed since"):
        data.check_unchanged()

def test_a_touched_but_unchanged_file_is_served(tmp_path):
    path = _write(tmp_path / "d.jsonl", _docs(0))
    with closing_loader(build_loader(open_dataset(path), **records(**CFG))) as loader:
        first = [b.info["digest"] for b in loader]
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
        assert [b.info["digest"] for b in loader] == first


def test_rows_appended_after_opening_are_refused_at_the_next_epoch(tmp_path):
    """The dataset of a run is the file as opened: appended rows are never silently mixed in."""
    path = _write(tmp_path / "d.jsonl", _docs(0))
    with closing_loader(build_loader(open_dataset(path), **records(**CFG))) as loader:
        it = iter(loader)
        next(it)
        with open(path, "a") as f:
            f.write('{"input_ids": [1, 2, 3]}\n')
        rest = list(it)  # this epoch: the rows planned at open, unchanged, are served
        assert rest
        with pytest.raises(ValueError, match=r"changed since it was opened: \d+ bytes then, \d+ now \(rows were "
                                             r"appended\).*reopen it"):  # fmt: skip
            next(iter(loader))


def test_npy_folder_file_rewritten_is_refused_naming_the_file(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    for i, d in enumerate(_docs(0, 20)):
        np.save(folder / f"{i:03d}.npy", np.array(d, dtype=np.int64))
    data = open_dataset(folder)
    arr = np.load(folder / "007.npy")
    np.save(folder / "007.npy", arr + 1)  # same size, new bytes
    os.utime(folder / "007.npy", ns=(0, os.stat(folder / "007.npy").st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"007\.npy \(document 7\) changed since the folder was opened"):
        data[7]
    np.save(folder / "999.npy", arr)
    os.utime(folder, ns=(0, os.stat(folder).st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"\.npy files added \['999\.npy'\]"):
        data.check_unchanged()


def test_in_memory_list_changed_between_epochs_is_refused():
    docs = [{"input_ids": np.array(d)} for d in _docs(0)]
    with closing_loader(build_loader(docs, **records(**CFG))) as loader:
        assert [b.info["digest"] for b in loader]
        docs[0] = {"input_ids": np.array([5, 6, 7])}
        with pytest.raises(ValueError, match="the source list changed since it was first read"):
            next(iter(loader))



def test_in_memory_tuple_edited_in_place_between_epochs_is_refused():
    """A tuple cannot be reassigned, but its items can be edited in place: checked like a list."""
    docs = tuple({"input_ids": np.array(d)} for d in _docs(0))
    with closing_loader(build_loader(docs, **records(**CFG))) as loader:
        assert [b.info["digest"] for b in loader]
        docs[0]["input_ids"][0] += 1
        with pytest.raises(ValueError, match="the source list changed since it was first read"):
            next(iter(loader))

def test_a_list_fingerprint_reads_values_not_object_pointers():
    """Equal items built apart fingerprint alike, also when ``input_ids`` is an object array (large Python
    ints): its raw bytes are pointers, which differ between copies and between processes."""
    def docs(first):
        return [{"input_ids": np.array([first + 10**20 + k for k in range(3)], dtype=object)} for _ in range(4)]

    assert source_fingerprint(docs(0)) == source_fingerprint(docs(0))
    assert source_fingerprint(docs(0)) != source_fingerprint(docs(1))
    plain = [{"input_ids": np.arange(5)}] * 3
    assert source_fingerprint(plain) == source_fingerprint([{"input_ids": np.arange(5)}] * 3)


# ---------------------------------------------------------------------------------------------- resume onto other data


def _state(source) -> dict:
    with closing_loader(build_loader(source, **records(**CFG))) as loader:
        it = iter(loader)
        next(it), next(it)
        return loader.state_dict()


def _restore_error(state, source) -> str:
    with closing_loader(build_loader(source, **records(**CFG))) as loader:
        loader.load_state_dict(state)
        with pytest.raises(ValueError) as info:
            next(iter(loader))
    return str(info.value)


@pytest.mark.parametrize("kind", ["jsonl", "list", "folder"])
def test_resume_onto_another_dataset_with_the_same_row_count_is_refused(tmp_path, kind):
    def make(name, seed):
        docs = _docs(seed)
        if kind == "jsonl":
            return open_dataset(_write(tmp_path / f"{name}.jsonl", docs))
        if kind == "list":
            return [{"input_ids": np.array(d)} for d in docs]
        folder = tmp_path / name
        folder.mkdir()
        for i, d in enumerate(docs):
            np.save(folder / f"{i:03d}.npy", np.array(d, dtype=np.int64))
        return open_dataset(folder)

    same, other = make("a", 0), make("b", 1)
    assert len(same) == len(other)
    state = _state(same)
    message = _restore_error(state, other)
    assert "fingerprint" in message and "same length, other content" in message and "same dataset" in message
    # the same data, opened again (another process, another machine), resumes
    again = make("c", 0) if kind != "list" else [dict(d) for d in same]
    with closing_loader(build_loader(again, **records(**CFG))) as loader:
        loader.load_state_dict(state)
        assert next(iter(loader)).info["real_tokens"] > 0


def test_fingerprints_ignore_paths_and_mtimes(tmp_path):
    a = _write(tmp_path / "a.jsonl", _docs(0))
    b = _write(tmp_path / "b.jsonl", _docs(0))
    os.utime(b, ns=(0, 10**18))
    assert source_fingerprint(open_dataset(a)) == source_fingerprint(open_dataset(b))
    assert source_fingerprint(open_dataset(a)) != source_fingerprint(open_dataset(_write(tmp_path / "c.jsonl", _docs(1))))
    assert source_fingerprint(iter([])) is None and source_fingerprint(object()) is None


# ---------------------------------------------------------------------------------------------- precomputed plans


def test_precomputed_plan_replaced_on_disk_is_refused_at_the_next_epoch(tmp_path):
    path = _write(tmp_path / "d.jsonl", _docs(0))
    data = open_dataset(path)
    precompute(data, tmp_path / "plan", capacity=64, cp_size=2, layout="thd", plan=StreamPlan(overflow="split"))
    node = PrecomputedPacks(tmp_path / "plan", data)
    assert list(node)
    precompute(data, tmp_path / "plan", capacity=128, cp_size=2, layout="thd", overwrite=True, plan=StreamPlan(overflow="split"))
    with pytest.raises(ValueError, match="plan .* changed on disk since this node opened it"):
        node.reset()
    with pytest.raises(ValueError, match="plan .* changed on disk since this node opened it"):
        pickle.loads(pickle.dumps(node))  # what a spawned worker receives


def test_precomputed_plan_documents_edited_are_refused(tmp_path):
    path = _write(tmp_path / "d.jsonl", _docs(0))
    data = open_dataset(path)
    precompute(data, tmp_path / "plan", capacity=64, cp_size=2, layout="thd", plan=StreamPlan(overflow="split"))
    node = PrecomputedPacks(tmp_path / "plan", data)
    _edit_in_place(path, 30)
    with pytest.raises(ValueError, match=r"document 30 \(byte offset \d+\) changed since the file was opened"):
        list(node)


SCHEDULED = records(capacity=64, cp_size=2, cp_rank=0, layout="thd", overflow="split", prefetch=0, schedule="balanced")


def test_a_schedule_refuses_a_document_edited_between_epochs_naming_file_and_document(tmp_path):
    path = _write(tmp_path / "d.jsonl", _docs(0))
    with closing_loader(build_loader(open_dataset(path), **SCHEDULED)) as loader:
        assert [b.info["digest"] for b in loader]
        _edit_in_place(path, 0)  # same lengths: the schedule alone would not notice
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
        with pytest.raises(ValueError, match=r"document 0 \(byte offset 0\) changed since the file was opened"):
            next(iter(loader))


def test_a_schedule_resumes_only_onto_the_same_data_not_the_same_lengths(tmp_path):
    docs = _docs(0)
    other = [[(t + 1) % 1000 for t in d] for d in docs]  # every length the same, other tokens
    a, b = _write(tmp_path / "a.jsonl", docs), _write(tmp_path / "b.jsonl", other)
    assert (open_dataset(a).lengths == open_dataset(b).lengths).all()
    with closing_loader(build_loader(open_dataset(a), **SCHEDULED)) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        want = [x.info["digest"] for x in it]
    with closing_loader(build_loader(open_dataset(b), **SCHEDULED)) as loader:
        with pytest.raises(ValueError, match="saved over other data"):
            loader.load_state_dict(state)
            next(iter(loader))
    with closing_loader(build_loader(open_dataset(a), **SCHEDULED)) as loader:  # the same file opened again
        loader.load_state_dict(state)
        assert [x.info["digest"] for x in loader] == want and want


def test_a_list_fingerprint_tells_equal_bytes_of_other_dtypes_apart():
    """Items whose ``input_ids`` share their raw bytes but not their tokens (uint8 ``[1, 0, 2, 0]`` is
    little-endian uint16 ``[1, 2]``) are other documents: their lists fingerprint differently."""
    wide = [{"input_ids": np.array([1, 2], dtype="<u2")}] * 3
    narrow = [{"input_ids": np.array([1, 0, 2, 0], dtype="u1")}] * 3
    assert wide[0]["input_ids"].tobytes() == narrow[0]["input_ids"].tobytes()
    assert source_fingerprint(wide) != source_fingerprint(narrow)
    assert source_fingerprint(wide) == source_fingerprint([{"input_ids": np.array([1, 2], dtype="<u2")}] * 3)


class _Rows(list):
    """A list subclass with ``.lengths`` and no fingerprint (a subclass may read lazily): its type and the
    lengths a schedule plans from are all that identify it."""

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(d["input_ids"]) for d in self], dtype=np.int64)


def test_a_schedule_over_a_source_without_fingerprint_binds_to_its_lengths():
    docs = _docs(0)
    same = _Rows({"input_ids": np.array(d)} for d in docs)
    shorter = _Rows({"input_ids": np.array(d[: max(1, len(d) // 2)])} for d in docs)  # same count and type
    assert source_fingerprint(same) is None and len(same) == len(shorter)
    with closing_loader(build_loader(same, **SCHEDULED)) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        want = [x.info["digest"] for x in it]
    with closing_loader(build_loader(shorter, **SCHEDULED)) as loader:
        with pytest.raises(ValueError, match="saved over other data"):
            loader.load_state_dict(state)
            next(iter(loader))
    with closing_loader(build_loader(_Rows(same), **SCHEDULED)) as loader:  # the same rows resume
        loader.load_state_dict(state)
        assert [x.info["digest"] for x in loader] == want and want


def test_slices_of_one_dataset_fingerprint_their_own_documents(tmp_path):
    """``ds[a:b]`` serves other documents than ``ds[c:d]`` of the same count: a resume from one onto the other
    is refused; the same slice of the file opened again resumes."""
    path = _write(tmp_path / "d.jsonl", _docs(0))
    first, second = open_dataset(path)[:30], open_dataset(path)[30:]
    assert len(first) == len(second) == 30
    assert source_fingerprint(first) != source_fingerprint(second)
    assert source_fingerprint(first) == source_fingerprint(open_dataset(path)[0:30:1])
    message = _restore_error(_state(first), second)
    assert "fingerprint" in message
