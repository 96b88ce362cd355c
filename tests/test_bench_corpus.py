"""``cpdata bench --sections world --lengths PATH``: a user's corpus, read whole or refused, drawn as shuffled
epochs, and measured by the world section beside Megatron's scheduler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cpdata.bench import world
from cpdata.bench.corpus import Corpus, read_corpus
from cpdata.layout.world_deal import alone_tiles


def test_a_text_corpus_keeps_every_length_in_file_order(tmp_path):
    path = tmp_path / "chats.txt"
    path.write_text("# lengths after the chat template\n512\n7, 9000 13\n\n  300 # the last\n")
    corpus = read_corpus(path)
    assert (corpus.name, corpus.source) == ("chats", str(path))
    assert corpus.lengths.dtype == np.int64 and corpus.lengths.tolist() == [512, 7, 9000, 13, 300]
    assert corpus.describe() == {"name": "chats", "source": str(path), "documents": 5, "tokens": 9832}


def test_an_npy_corpus_is_its_array(tmp_path):
    path = tmp_path / "web.npy"
    lengths = np.array([1, 70_000, 250, 4096], dtype=np.int32)
    np.save(path, lengths)
    corpus = read_corpus(path)
    assert corpus.name == "web" and corpus.lengths.dtype == np.int64
    assert corpus.lengths.tolist() == lengths.tolist()


@pytest.mark.parametrize(("text", "message"), [
    ("12\n30 0\n-4\n", r"2 document length\(s\) not positive, the first 0 at line 2"),
    ("12\n30 2.5\n", r"'2.5' on line 2 is not a whole number of tokens"),
    ("12 tokens\n", r"'tokens' on line 1"),
    ("# nothing but a comment\n\n", "no document lengths in the file"),
    (f"5\n{2**64}\n", r"18446744073709551616 on line 2 is past an int64"),
])  # fmt: skip
def test_a_text_corpus_that_is_not_positive_lengths_is_refused_naming_the_entry(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_corpus(path)


@pytest.mark.parametrize(("array", "message"), [
    (np.array([3.0, 4.0]), "one-dimensional integer array .* got float64 of shape \\(2,\\)"),
    (np.ones((2, 3), dtype=np.int64), "got int64 of shape \\(2, 3\\)"),
    (np.array([5, 0, 7, 0]), r"2 document length\(s\) not positive, the first 0 at entry 1"),
    (np.array([], dtype=np.int64), "no document lengths"),
])  # fmt: skip
def test_an_npy_corpus_that_is_not_positive_integer_lengths_is_refused(tmp_path, array, message):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ValueError, match=message):
        read_corpus(path)


def test_a_draw_reads_the_corpus_epoch_by_epoch_each_a_permutation_of_the_seed():
    lengths = np.arange(1, 101, dtype=np.int64) * 7
    corpus = Corpus("c", lengths, "memory")
    stream = corpus.draw(250, seed=3)
    assert stream.shape == (250,)
    for epoch in (stream[:100], stream[100:200]):  # every document once an epoch
        assert sorted(epoch.tolist()) == lengths.tolist()
    assert set(stream[200:].tolist()) <= set(lengths.tolist()) and len(set(stream[200:].tolist())) == 50
    assert not np.array_equal(stream[:100], stream[100:200])  # each epoch its own order
    assert np.array_equal(corpus.draw(250, seed=3), stream)
    assert not np.array_equal(corpus.draw(250, seed=4), stream)


def test_the_world_section_measures_the_corpus_under_its_name(monkeypatch):
    """1,000-token documents at 8 ranks of 2,048: every rank holds two whole ones a micro-batch, so each rank's
    step costs two documents' tiles a micro-batch and receives nothing; Megatron keeps them whole too."""
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    monkeypatch.setattr(world, "WORLDS", ((8, 2048),))
    rows = world.run(quick=True, corpus=Corpus("even", np.full(500, 1000, dtype=np.int64), "memory"))
    assert len(rows) == 6 and {r["distribution"] for r in rows} == {"even"}
    step, stream = (next(r for r in rows if r["system"] == system) for system in (world.STEP, world.STREAM))
    per_rank = world.QUICK_PACKS * 2 * alone_tiles(1000, 128)
    assert (step["step_tiles"], step["step_over_mean"], step["step_recv_keys"]) == (per_rank, 1.0, 0)
    assert (stream["step_tiles"], stream["step_over_mean"]) == (world.QUICK_STEPS * per_rank, 1.0)
    assert step["fill"] == pytest.approx(2000 / 2048) and stream["fill"] == pytest.approx(2000 / 2048)
    theirs = next(r for r in rows if r["system"] == f"{world.MEGATRON} ({world.STEP}'s documents)")
    assert theirs["recv_keys"] == 0 and step["step_tiles_vs_megatron"] <= 1.0


def test_the_cli_measures_a_corpus_file_and_refuses_a_bad_one_before_running(monkeypatch, tmp_path):
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    from cpdata.bench.runner import run_bench
    from cpdata.cli import main

    monkeypatch.setattr(world, "WORLDS", ((8, 2048),))
    path, out = tmp_path / "mine.txt", tmp_path / "out.json"
    path.write_text("\n".join(str(n) for n in np.random.default_rng(0).integers(50, 6000, size=400)))
    assert main(["bench", "--quick", "--sections", "world", "--lengths", str(path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["corpus"] == read_corpus(path).describe()  # (what the run measured, recorded)
    assert {r["distribution"] for r in results["world"]} == {"mine"}
    path.write_text("100\n0\n")
    out.unlink()
    assert main(["bench", "--sections", "world", "--lengths", str(path), "--json", str(out)]) == 2
    assert main(["bench", "--sections", "world", "--lengths", str(tmp_path / "none.txt")]) == 2
    np.save(tmp_path / "ok.npy", np.array([100, 200]))
    assert main(["bench", "--sections", "packing", "--lengths", str(tmp_path / "ok.npy"), "--json", str(out)]) == 2
    assert not out.exists()
    with pytest.raises(ValueError, match="measured by the world section alone"):
        run_bench(["packing"], corpus=read_corpus(tmp_path / "ok.npy"), log=lambda _: None)
