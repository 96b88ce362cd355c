"""Offline precompute: datasets on disk, the plan directory, the reader node, the CLI."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from state_contract import assert_items_equal, run_save_load_contract

from cpdata.cli import main as cli_main
from cpdata.nodes.collate import Collate
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.pack import Pack
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.source import Documents
from cpdata.offline import PrecomputedPacks, precompute, read_store
from cpdata.offline.progress import Progress
from cpdata.offline.store import ARRAYS, MANIFEST
from cpdata.packing import plan_lengths
from cpdata.sources import open_dataset
from cpdata.sources.files import JsonlDocuments, LengthsFile, NpyFolder
from cpdata.sources.fingerprint import lengths_sha256
from cpdata.worker.keys import IGNORE_INDEX
from tests.flat_options import precompute_records

CAPACITY, CP, LAYOUT = 256, 2, "thd"


def make_docs(seed: int = 0, n: int = 60, max_len: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len, n)
    lens[[3, 17]] = 0  # empty documents are skipped by the planner
    return [rng.integers(0, 50_000, int(k)).astype(np.int64) for k in lens]


def write_jsonl(path: Path, docs: list[np.ndarray], *, labels: bool = False) -> Path:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            row: dict = {"input_ids": d.tolist(), "meta": "ignored"}
            if labels:
                row["labels"] = (d % 7).tolist()
                row["loss_mask"] = [float(i % 2)] * len(d)
            f.write(json.dumps(row) + "\n")
            if i == 5:
                f.write("\n")  # a blank line is not a document
    return path


def write_folder(path: Path, docs: list[np.ndarray]) -> Path:
    path.mkdir()
    for i, d in enumerate(docs):
        np.save(path / f"doc_{i:05d}.npy", d.astype(np.int32))
    return path


@pytest.fixture
def docs() -> list[np.ndarray]:
    return make_docs()


@pytest.fixture
def jsonl(tmp_path, docs) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", docs)


def plan_dir(tmp_path: Path, data: Path | object, name: str = "plan", **kw) -> Path:
    opts = {"capacity": CAPACITY, "cp_size": CP, "layout": LAYOUT, "overflow": "split"} | kw
    precompute(data, tmp_path / name, **precompute_records(**opts))
    return tmp_path / name


def expected_plans(docs, result, capacity):
    """Brute-force PackPlan contents from a PackingResult and the token lists."""
    out = []
    for p in range(result.n_packs):
        idx, start, length, slot = result.pack(p)
        pieces = []
        for d, s, n in zip(idx.tolist(), start.tolist(), length.tolist(), strict=True):
            tokens = docs[d]
            nxt = int(tokens[s + n]) if s + n < len(tokens) else IGNORE_INDEX
            pieces.append((d, s, tokens[s : s + n], nxt))
        out.append((pieces, slot, capacity))
    return out


# ---------------------------------------------------------------------------------------------- datasets


def test_three_input_formats_agree(tmp_path, docs):
    lengths = np.array([len(d) for d in docs])
    jl = open_dataset(write_jsonl(tmp_path / "a.jsonl", docs, labels=True))
    folder = open_dataset(write_folder(tmp_path / "docs", docs))
    np.save(tmp_path / "lens.npy", lengths.astype(np.int32))
    np.savez(tmp_path / "lens.npz", lengths=lengths)
    npy, npz = open_dataset(tmp_path / "lens.npy"), open_dataset(tmp_path / "lens.npz")
    assert (type(jl), type(folder), type(npy), type(npz)) == (JsonlDocuments, NpyFolder, LengthsFile, LengthsFile)
    assert isinstance(np.load(tmp_path / "lens.npy", mmap_mode="r"), np.memmap)
    for ds in (jl, folder, npy, npz):
        assert len(ds) == len(docs)
        np.testing.assert_array_equal(ds.lengths, lengths)
        assert ds.lengths.dtype == np.int64
    assert npy.fingerprint() == f"lengths:{lengths_sha256(jl.lengths)}" == f"lengths:{lengths_sha256(folder.lengths)}"
    rng = np.random.default_rng(1)
    for i in [*rng.integers(0, len(docs), 20).tolist(), 0, len(docs) - 1, -1]:
        for ds in (jl, folder):
            got = ds[i]
            np.testing.assert_array_equal(got["input_ids"], docs[i])
            assert got["input_ids"].dtype == np.int64
        np.testing.assert_array_equal(jl[i]["labels"], docs[i] % 7)
        assert jl[i]["loss_mask"].shape == docs[i].shape
        assert sorted(jl[i]) == ["input_ids", "labels", "loss_mask"]  # "meta" is not per-token
    with pytest.raises(ValueError, match="lengths only.*tokenized dataset"):
        npy[0]
    with pytest.raises(IndexError, match="out of range"):
        jl[len(docs)]
    # Pickled (to a worker process) the JSONL reader reopens its file.
    _ = jl[3]
    clone = pickle.loads(pickle.dumps(jl))
    np.testing.assert_array_equal(clone[7]["input_ids"], docs[7])


def test_fingerprint_is_over_the_input_bytes(tmp_path, docs):
    a = write_jsonl(tmp_path / "a.jsonl", docs)
    b = write_jsonl(tmp_path / "b.jsonl", docs)
    assert open_dataset(a).fingerprint() == open_dataset(b).fingerprint()
    raw = bytearray(b.read_bytes())
    raw[raw.index(b"]") - 1] ^= 1  # one digit of the first document
    b.write_bytes(bytes(raw))
    changed = open_dataset(b)
    assert changed.fingerprint() != open_dataset(a).fingerprint()
    np.testing.assert_array_equal(changed.lengths, open_dataset(a).lengths)  # same lengths, other tokens
    f1, f2 = write_folder(tmp_path / "f1", docs), write_folder(tmp_path / "f2", docs)
    assert NpyFolder(f1).fingerprint() == NpyFolder(f2).fingerprint()
    os.rename(f2 / "doc_00000.npy", f2 / "doc_99999.npy")  # reorder: same bytes, other order
    assert NpyFolder(f2).fingerprint() != NpyFolder(f1).fingerprint()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"input_ids": [1, 2]}\nnot json\n', "line 2: not valid JSON"),
        ('{"tokens": [1]}\n', "line 1: expected an object with an 'input_ids' list"),
        ('{"input_ids": [1, 2], "labels": [1]}\n', "line 1: 'labels' has 1 entries but input_ids has 2"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        open_dataset(path)


def test_unknown_input_format(tmp_path):
    (tmp_path / "x.txt").write_text("1 2 3")
    with pytest.raises(ValueError, match="unknown dataset format.*'.txt'"):
        open_dataset(tmp_path / "x.txt")
    with pytest.raises(ValueError, match="does not exist"):
        open_dataset(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------------------------- precompute


@pytest.mark.parametrize("algorithm", ["bfd", "concat"])
def test_plan_directory_holds_the_planner_result(tmp_path, jsonl, docs, algorithm):
    lengths = np.array([len(d) for d in docs])
    plan = plan_dir(tmp_path, jsonl, algorithm=algorithm, window=16)
    store = read_store(plan)
    want = plan_lengths(lengths, capacity=CAPACITY, cp_size=CP, layout=LAYOUT, overflow="split",
                        algorithm=algorithm, window=16)  # fmt: skip
    for name in ("pack_offsets", "doc_index", "doc_start", "doc_len", "slot_len"):
        np.testing.assert_array_equal(store.arrays[name], getattr(want, name), err_msg=name)
    m = store.manifest
    assert m["counts"]["packs"] == want.n_packs == store.n_packs
    assert m["stats"]["padding_pct"] == want.stats.padding_pct
    assert m["stats"]["split"] == want.stats.split > 0  # documents longer than the capacity were split
    assert m["stats"]["skipped"] == 2
    assert m["config"]["planner"] == {"algorithm": algorithm, "overflow": "split", "seed": 0, "window": 16}
    assert m["input"]["identity"] == open_dataset(jsonl).fingerprint()
    # continues: brute force over the pieces.
    a = store.arrays
    starts = {(int(d), int(s)) for d, s in zip(a["doc_index"], a["doc_start"], strict=True)}
    brute = [(int(d), int(s + n)) in starts for d, s, n in zip(a["doc_index"], a["doc_start"], a["doc_len"],
                                                                 strict=True)]  # fmt: skip
    np.testing.assert_array_equal(a["continues"], brute)
    assert a["continues"].any()
    # per-pack stats
    tokens = [int(want.pack(p)[2].sum()) for p in range(want.n_packs)]
    np.testing.assert_array_equal(a["pack_tokens"], tokens)
    assert a["rank_work"].shape == (want.n_packs, CP)


def test_rerun_is_byte_identical(tmp_path, jsonl):
    first = plan_dir(tmp_path, jsonl, "one")
    second = plan_dir(tmp_path, jsonl, "two")
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted([MANIFEST, *(f"{n}.npy" for n in ARRAYS)])
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    manifest = (first / MANIFEST).read_text()
    assert str(tmp_path) not in manifest  # relocatable: no absolute paths, no timestamps
    precompute(jsonl, first, capacity=CAPACITY, cp_size=CP, layout=LAYOUT, overwrite=True, plan=StreamPlan(overflow="split"))
    assert (first / MANIFEST).read_text() == manifest


def test_existing_output_is_refused_and_a_crash_leaves_nothing(tmp_path, jsonl, monkeypatch):
    plan = plan_dir(tmp_path, jsonl)
    with pytest.raises(ValueError, match="already exists.*overwrite=True"):
        plan_dir(tmp_path, jsonl)
    calls = {"n": 0}
    real_save = np.save

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 4 == 0:  # the 4th array of each run
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        plan_dir(tmp_path, jsonl, "crashed")
    with pytest.raises(OSError, match="disk full"):
        precompute(jsonl, plan, capacity=CAPACITY, cp_size=CP, layout=LAYOUT, overwrite=True, plan=StreamPlan(overflow="split"))
    assert calls["n"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "plan"]  # no half or temp directory
    read_store(plan)  # the old plan survived the failed overwrite


# ---------------------------------------------------------------------------------------------- refusals


def _rewrite_manifest(plan: Path, edit) -> None:
    m = json.loads((plan / MANIFEST).read_text())
    edit(m)
    (plan / MANIFEST).write_text(json.dumps(m, sort_keys=True, indent=2))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: _rewrite_manifest(p, lambda m: m["config"].update(capacity=512)), "manifest.json is corrupted"),
        (lambda p: (p / MANIFEST).write_text("{not json"), "corrupted \\(not valid JSON"),
        (lambda p: _rewrite_manifest(p, lambda m: m.update(format_version=99)), "format_version 99, this cpdata reads"),
        (lambda p: _rewrite_manifest(p, lambda m: m.update(format_version=1)),  # bound its input by checksums
         "format_version 1, this cpdata reads version 2; re-run `cpdata precompute`"),
        (lambda p: (p / "doc_len.npy").unlink(), "'doc_len' is missing"),
        (lambda p: (p / MANIFEST).unlink(), "not a precomputed plan directory"),
    ],
)
def test_damaged_plan_is_refused(tmp_path, jsonl, damage, match):
    plan = plan_dir(tmp_path, jsonl)
    damage(plan)
    with pytest.raises(ValueError, match=match):
        PrecomputedPacks(plan, open_dataset(jsonl))


def test_corrupted_array_is_refused(tmp_path, jsonl):
    plan = plan_dir(tmp_path, jsonl)
    raw = bytearray((plan / "doc_start.npy").read_bytes())
    raw[-3] ^= 0x10
    (plan / "doc_start.npy").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="'doc_start' is corrupted: .* hashes to .* re-run `cpdata precompute`"):
        PrecomputedPacks(plan, open_dataset(jsonl))


def test_mismatched_dataset_cp_size_or_layout_is_refused(tmp_path, jsonl, docs):
    plan = plan_dir(tmp_path, jsonl)
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(seed=5))
    with pytest.raises(ValueError, match="precomputed from 'data.jsonl' .* hash to"):
        PrecomputedPacks(plan, open_dataset(other))
    with pytest.raises(ValueError, match="cp_size=2, the pipeline asks for cp_size=4.*--cp-size 4"):
        PrecomputedPacks(plan, open_dataset(jsonl), cp_size=4)
    with pytest.raises(ValueError, match="layout='thd', the pipeline asks for layout='balanced'"):
        PrecomputedPacks(plan, open_dataset(jsonl), layout="balanced")
    with pytest.raises(ValueError, match="precomputed from 'data.jsonl' .* hash to list:"):
        PrecomputedPacks(plan, docs)
    node = PrecomputedPacks(plan, open_dataset(jsonl), cp_size=CP, layout=LAYOUT)
    assert len(node) == read_store(plan).n_packs


def test_lengths_only_plan_is_served_by_a_dataset_with_those_lengths(tmp_path, jsonl, docs):
    lengths = np.array([len(d) for d in docs])
    np.save(tmp_path / "lens.npy", lengths)
    plan = plan_dir(tmp_path, tmp_path / "lens.npy")
    assert read_store(plan).manifest["input"]["kind"] == "lengths"
    node = PrecomputedPacks(plan, open_dataset(jsonl))
    from_tokens = PrecomputedPacks(plan_dir(tmp_path, jsonl, "from_tokens"), open_dataset(jsonl))
    assert [(p.slot_lens.tolist(), [x.index for x in p.pieces]) for p in node] == [
        (p.slot_lens.tolist(), [x.index for x in p.pieces]) for p in from_tokens
    ]
    shorter = write_jsonl(tmp_path / "shorter.jsonl", [d[:-1] if len(d) > 1 else d for d in docs])
    with pytest.raises(ValueError, match="precomputed from the lengths file 'lens.npy'.*other lengths"):
        PrecomputedPacks(plan, open_dataset(shorter))
    with pytest.raises(ValueError, match="lengths only"):
        next(PrecomputedPacks(plan, open_dataset(tmp_path / "lens.npy")))


# ---------------------------------------------------------------------------------------------- reader


@pytest.mark.parametrize("fmt", ["jsonl", "folder"])
def test_reader_emits_the_planned_packs(tmp_path, docs, fmt):
    data = write_jsonl(tmp_path / "d.jsonl", docs) if fmt == "jsonl" else write_folder(tmp_path / "d", docs)
    plan = plan_dir(tmp_path, data, algorithm="concat")
    lengths = np.array([len(d) for d in docs])
    want = expected_plans(docs, plan_lengths(lengths, capacity=CAPACITY, cp_size=CP, layout=LAYOUT,
                                             algorithm="concat", overflow="split"), CAPACITY)  # fmt: skip
    got = list(PrecomputedPacks(plan, open_dataset(data)))
    assert len(got) == len(want) > 5
    continued = 0
    for k, (plan_k, (pieces, slot, capacity)) in enumerate(zip(got, want, strict=True)):
        assert (plan_k.index, plan_k.capacity) == (k, capacity)
        np.testing.assert_array_equal(plan_k.slot_lens, slot)
        assert plan_k.slot_lens.dtype == np.int64
        assert len(plan_k.pieces) == len(pieces)
        for piece, (d, s, tokens, nxt) in zip(plan_k.pieces, pieces, strict=True):
            assert (piece.index, piece.start, piece.next_label) == (d, s, nxt)
            np.testing.assert_array_equal(piece.arrays["input_ids"], tokens)
            continued += nxt != IGNORE_INDEX
    assert continued > 0  # concat cut documents across packs


def test_truncated_pieces_do_not_continue(tmp_path, jsonl, docs):
    plan = plan_dir(tmp_path, jsonl, overflow="truncate")
    assert read_store(plan).manifest["stats"]["truncated"] > 0
    plans = list(PrecomputedPacks(plan, open_dataset(jsonl)))
    cut = [p for plan_k in plans for p in plan_k.pieces if p.length < len(docs[p.index])]
    assert cut and all(p.next_label == IGNORE_INDEX for p in cut)


def test_state_is_a_pack_index_and_restores_anywhere(tmp_path, jsonl):
    plan = plan_dir(tmp_path, jsonl)
    data = open_dataset(jsonl)
    full = [p.slot_lens.tolist() for p in PrecomputedPacks(plan, data)]
    rng = np.random.default_rng(0)
    for k in [0, len(full), *rng.integers(1, len(full), 5).tolist()]:
        node = PrecomputedPacks(plan, data)
        for _ in range(k):
            next(node)
        state = node.state_dict()
        assert state["item"] == k and len(json.dumps(state)) < 300
        fresh = PrecomputedPacks(plan, data)
        fresh.reset(state)
        assert [p.slot_lens.tolist() for p in fresh] == full[k:]
    other = plan_dir(tmp_path, jsonl, "other", layout="balanced")
    with pytest.raises(ValueError, match="saved over other data"):
        PrecomputedPacks(other, data).reset(state)
    with pytest.raises(ValueError, match="version"):
        PrecomputedPacks(plan, data).reset({**state, "version": 0})
    with pytest.raises(ValueError, match="item=9999"):
        PrecomputedPacks(plan, data).reset({**state, "item": 9999})


def test_dp_ranks_share_the_packs_evenly(tmp_path, jsonl):
    plan = plan_dir(tmp_path, jsonl)
    data = open_dataset(jsonl)
    n = read_store(plan).n_packs
    assert n % 3  # the uneven tail is left out
    streams = [list(PrecomputedPacks(plan, data, data=DataPolicy(dp_rank=r, dp_size=3))) for r in range(3)]
    assert [len(s) for s in streams] == [n // 3] * 3
    whole = list(PrecomputedPacks(plan, data))
    for r, stream in enumerate(streams):
        assert [p.index for p in stream] == [i * 3 + r for i in range(n // 3)]  # the plan's own pack ids
        for i, p in enumerate(stream):
            assert [x.index for x in p.pieces] == [x.index for x in whole[i * 3 + r].pieces]
    node = PrecomputedPacks(plan, data, data=DataPolicy(dp_rank=1, dp_size=3))
    with pytest.raises(ValueError, match=r"saved with \{.dp.: \[1, 3\].*resume with the same"):
        PrecomputedPacks(plan, data, data=DataPolicy(dp_rank=0, dp_size=3)).reset(node.state_dict())
    with pytest.raises(ValueError, match="dp_rank < dp_size"):
        PrecomputedPacks(plan, data, data=DataPolicy(dp_rank=3, dp_size=3))


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_precompute_end_to_end(tmp_path, jsonl, capsys):
    out = tmp_path / "plan"
    args = ["precompute", str(jsonl), "--capacity", "256", "--cp-size", "2", "--layout", "thd",
            "--overflow", "split", "--out", str(out), "--quiet"]  # fmt: skip
    assert cli_main(args) == 0
    assert "packs of 256 tokens from 60 documents" in capsys.readouterr().out
    assert read_store(out).config["layout"] == "thd"
    assert cli_main(args) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli_main([*args, "--force"]) == 0
    assert cli_main([*args[:3], "255", *args[4:], "--force"]) == 1
    assert "--capacity 255 is not a multiple of 4" in capsys.readouterr().err


def test_cli_precompute_subprocess(tmp_path, jsonl):
    exe = Path(sys.executable).parent / "cpdata"
    out = tmp_path / "plan"
    proc = subprocess.run(
        [str(exe), "precompute", str(jsonl), "--capacity", "256", "--cp-size", "2", "--layout", "balanced",
         "--overflow", "truncate", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "truncated" in proc.stdout
    assert read_store(out).manifest["stats"]["truncated"] > 0


def test_reader_pickles_without_copying_the_arrays(tmp_path, jsonl):
    plan = plan_dir(tmp_path, jsonl)
    node = PrecomputedPacks(plan, open_dataset(jsonl))
    next(node)
    blob = pickle.dumps(node)
    assert len(blob) < 20_000 and b"pack_offsets" not in blob
    clone = pickle.loads(blob)
    assert isinstance(clone.store.arrays["doc_index"], np.memmap)
    assert [p.slot_lens.tolist() for p in clone] == [p.slot_lens.tolist() for p in node]


# ---------------------------------------------------------------------------------------------- online parity


def assert_batches_equal(actual, expected) -> None:
    """ShardedBatch (or a tuple of them, one per rank): tensors, layout and info."""
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_batches_equal(a, e)
        return
    assert_items_equal(dict(actual), dict(expected), "batch")
    assert_items_equal(actual.layout, expected.layout, "batch.layout")
    assert_items_equal(actual.info, expected.info, "batch.info")


PARITY = [
    # (format, layout, cp, algorithm, overflow, window, batch_size, qkv_format)
    ("jsonl_labels", "thd", 2, "bfd", "split", 8, 2, "thd"),
    ("jsonl", "balanced", 3, "concat", None, None, 1, "bshd"),
    ("folder", "contiguous", 4, "ffd", "truncate", None, 2, "bshd"),
    ("folder", "round_robin", 2, "first_fit", "drop", 16, 1, "thd"),
]


@pytest.mark.parametrize(("fmt", "layout", "cp", "algorithm", "overflow", "window", "batch", "qkv"), PARITY)
def test_precomputed_pipeline_equals_the_online_pipeline(tmp_path, docs, fmt, layout, cp, algorithm, overflow,
                                                         window, batch, qkv):  # fmt: skip
    if fmt == "folder":
        path = write_folder(tmp_path / "docs", docs)
    else:
        path = write_jsonl(tmp_path / "d.jsonl", docs, labels=fmt == "jsonl_labels")
    capacity = 240 if cp == 3 else 256
    opts = dict(capacity=capacity, layout=layout, cp_size=cp, algorithm=algorithm, overflow=overflow, window=window)
    data = open_dataset(path)
    plan = tmp_path / "plan"
    precompute(data, plan, **precompute_records(**opts, labels_alignment="targets"))

    def offline_plans():
        return PrecomputedPacks(plan, data, cp_size=cp, layout=layout, data=DataPolicy(labels_alignment="targets"))

    def online_plans():
        return Pack(Documents(open_dataset(path), labels_alignment="targets"), **opts)

    def shard(plans):
        return ShardForRank(Collate(plans, batch_size=batch, qkv_format=qkv, padding_token_id=7),
                            cp_size=cp, cp_rank=0, layout=layout, all_ranks=True)  # fmt: skip

    want_plans = list(online_plans())
    assert len(want_plans) > 4
    assert_items_equal(list(offline_plans()), want_plans, "plans")
    want = list(shard(online_plans()))
    got = list(shard(offline_plans()))
    assert len(got) == len(want) == -(-len(want_plans) // batch)
    for a, e in zip(got, want, strict=True):
        assert_batches_equal(a, e)
    if fmt == "jsonl_labels":
        assert "loss_mask" in got[0][0] and "labels" in want_plans[0].pieces[0].arrays


def test_resume_at_random_pack_indices_is_exact(tmp_path, jsonl):
    plan = plan_dir(tmp_path, jsonl, algorithm="concat")
    data = open_dataset(jsonl)
    n = read_store(plan).n_packs
    rng = np.random.default_rng(7)
    points = [0, 1, n, *rng.integers(2, n, 4).tolist()]
    reference = run_save_load_contract(lambda: PrecomputedPacks(plan, data), points, epochs=2)
    assert len(reference) == 2 * n
    points = [0, n // 2, *rng.integers(1, n // 2, 3).tolist()]
    run_save_load_contract(
        lambda: ShardForRank(Collate(PrecomputedPacks(plan, data), batch_size=2, qkv_format="thd"),
                             cp_size=CP, cp_rank=1, layout=LAYOUT),  # fmt: skip
        points,
        compare=assert_batches_equal,
        round_trips=("pickle",),
    )


def test_progress_prints_ten_steps_or_uses_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed
    outputs = []
    for delay in (0.0, 60.0):  # nothing for work shorter than the delay
        buf = io.StringIO()
        with Progress(40, "work", unit="docs", delay=delay, file=buf) as bar:
            for _ in range(40):
                bar.update()
        outputs.append(buf.getvalue().splitlines())
    assert len(outputs[0]) == 11 and outputs[0][-1] == "work: 100% (40/40 docs)"
    assert outputs[1] == []
    calls = []

    class FakeTqdm:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs["total"], kwargs["delay"]))

        def update(self, n):
            calls.append(("update", n))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    with Progress(3, "work", file=io.StringIO()) as bar:
        bar.update(2)
    assert calls == [("init", 3, 1.0), ("update", 2), ("close",)]


@pytest.mark.parametrize("bad", [
    {"input_ids": [1.7, 2.2, 3.9]}, {"input_ids": [[1, 2], [3, 4]]}, {"input_ids": ["5", "6"]},
    {"input_ids": [True, False]}, {"input_ids": [1, 2], "labels": [1.5, 2.5]},
])  # fmt: skip
def test_jsonl_rows_are_validated_not_cast(tmp_path, bad):
    from cpdata.sources.open import open_dataset

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="line 2: .* must be a flat list of integers"):
        open_dataset(path)


def test_precompute_stays_the_function_after_its_module_is_imported():
    # the function and its module have different names, so importing the module cannot rebind the package's name
    code = ("import cpdata, cpdata.offline.precompute_plan as m; from cpdata.offline import precompute; "
            "print(precompute is m.precompute is cpdata.precompute, type(precompute).__name__)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "function"]
