"""``cpdata inspect``: layout figures against a brute-force reference, the printout, the picture."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.cli import main as cli_main
from cpdata.layout.maps import alignment, causal_work, rank_indices
from cpdata.offline import precompute, read_store
from cpdata.offline.metrics import SHORT_CHUNK, chunk_lengths, layouts_for, pack_geometry, summarize


def brute_work(rows: np.ndarray, doc_len, slot_len) -> list[int]:
    owner = {}
    offset = 0
    for n, s in zip(doc_len, slot_len, strict=True):
        for p in range(n):
            owner[offset + p] = p + 1
        offset += s
    return [sum(owner.get(int(g), 0) for g in row) for row in rows]


def brute_chunks(rows: np.ndarray, doc_len, slot_len) -> list[int]:
    slot_of = {}
    offset = 0
    for i, (n, s) in enumerate(zip(doc_len, slot_len, strict=True)):
        for p in range(n):
            slot_of[offset + p] = i
        offset += s
    out = []
    for row in rows.tolist():
        run = 0
        for j, g in enumerate(row):
            if g not in slot_of:
                if run:
                    out.append(run)
                run = 0
                continue
            if run and row[j - 1] == g - 1 and slot_of.get(g - 1) == slot_of[g]:
                run += 1
            else:
                if run:
                    out.append(run)
                run = 1
        if run:
            out.append(run)
    return out


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=0, max_size=6),
    cp=st.integers(1, 4),
    layout=st.sampled_from(["contiguous", "round_robin", "thd", "balanced"]),
)
def test_chunks_and_work_match_brute_force(lens, cp, layout):
    d, m = alignment(layout, cp)
    doc_len = np.array(lens, dtype=np.int64)
    slot_len = -(-doc_len // d) * d
    pack_len = -(-max(int(slot_len.sum()), 1) // m) * m + m
    geometry = pack_geometry(doc_len, slot_len, pack_len)
    rows = rank_indices(layout, cp, slot_len, pack_len)
    assert sorted(chunk_lengths(rows, geometry.slot_of).tolist()) == sorted(brute_chunks(rows, lens, slot_len))
    assert causal_work(rows, geometry.positions).tolist() == brute_work(rows, lens, slot_len)


@pytest.fixture
def plan(tmp_path):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, 80)
    np.save(tmp_path / "lens.npy", lengths)
    precompute(tmp_path / "lens.npy", tmp_path / "plan", capacity=512, cp_size=4, layout="contiguous")
    return tmp_path / "plan"


def test_summary_matches_brute_force(plan):
    store = read_store(plan)
    s = summarize(store, sample=None)
    a = store.arrays
    per_pack = np.diff(a["pack_offsets"])
    assert (s.packs, s.docs_per_pack_max) == (store.n_packs, int(per_pack.max()))
    assert s.docs_per_pack_mean == pytest.approx(per_pack.mean())
    assert s.measured_packs == store.n_packs
    assert [row.layout for row in s.layouts] == list(layouts_for(4)) == ["balanced", "contiguous", "round_robin", "thd", "tiled",
                                                                         "world"]
    for row in s.layouts:
        d, m = alignment(row.layout, 4)
        ratios, chunks, pad, real = [], [], 0, 0
        for k in range(store.n_packs):
            sl = store.pack_slice(k)
            doc_len = a["doc_len"][sl].tolist()
            slot_len = [-(-n // d) * d for n in doc_len]
            pack_len = max(512, -(-sum(slot_len) // m) * m)
            rows = rank_indices(row.layout, 4, slot_len, pack_len)
            work = brute_work(rows, doc_len, slot_len)
            ratios.append(max(work) / np.mean(work))
            chunks += brute_chunks(rows, doc_len, slot_len)
            pad += sum(slot_len) - sum(doc_len)
            real += sum(doc_len)
        assert row.imbalance_mean == pytest.approx(np.mean(ratios))
        assert row.imbalance_p95 == pytest.approx(np.percentile(ratios, 95))
        assert row.doc_padding_pct == pytest.approx(100 * pad / real)
        assert row.short_chunk_pct == pytest.approx(100 * np.mean(np.array(chunks) < SHORT_CHUNK))
        assert row.chunks == len(chunks)
    by = {row.layout: row for row in s.layouts}
    assert by["thd"].doc_padding_pct > 0 and by["contiguous"].doc_padding_pct == 0
    assert by["balanced"].imbalance_mean < by["contiguous"].imbalance_mean  # the point of the layouts
    sampled = summarize(store, sample=5)
    assert sampled.measured_packs == 5


def test_thd_padding_that_no_longer_fits_is_reported(tmp_path):
    np.save(tmp_path / "lens.npy", np.full(7, 9))
    precompute(tmp_path / "lens.npy", tmp_path / "plan", capacity=64, cp_size=4, layout="contiguous")
    store = read_store(tmp_path / "plan")
    assert store.n_packs == 1
    thd = next(r for r in summarize(store).layouts if r.layout == "thd")
    assert thd.packs_over_capacity == 1
    assert thd.doc_padding_pct == pytest.approx(100 * (7 * 16 - 63) / 63)


def test_cli_inspect_prints_the_summary_and_a_pack(plan, capsys):
    assert cli_main(["inspect", str(plan), "--pack", "2"]) == 0
    out = capsys.readouterr().out
    store = read_store(plan)
    assert f"packs       {store.n_packs} " in out
    assert "padding" in out and "lower bound" in out
    for layout in ("balanced", "contiguous", "round_robin", "thd"):
        assert f"\n  {layout:<12} " in out
    assert "contiguous" in out.split("*")[0]  # the plan's layout is marked
    assert "pack 2:" in out and "work per rank" in out
    assert cli_main(["inspect", str(plan), "--pack", str(store.n_packs)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_inspect_refuses_a_damaged_plan(plan, capsys):
    (plan / "rank_work.npy").write_bytes(b"garbage")
    assert cli_main(["inspect", str(plan)]) == 1
    assert "'rank_work' is corrupted" in capsys.readouterr().err


@pytest.mark.parametrize("all_layouts", [False, True])
def test_cli_inspect_plot_writes_a_png(plan, tmp_path, all_layouts):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "pack.png"
    args = ["inspect", str(plan), "--pack", "1", "--plot", str(out)] + (["--all-layouts"] if all_layouts else [])
    assert cli_main(args) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[1] > 1000 and image.shape[0] > (600 if all_layouts else 200)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_cli_inspect_plot_without_matplotlib(plan, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli_main(["inspect", str(plan), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'cpdata[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
