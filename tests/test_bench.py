"""``cpdata bench``: one quick run end to end (JSON shape, sanity) plus the bench's own references."""

from __future__ import annotations

import importlib
import json
import math
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.bench import runner
from cpdata.bench.anchors import ANCHOR_LAYOUTS, anchor_shard, te_thd_partitioned_indices
from cpdata.bench.packing_quality import lower_bound_bins, split_lower_bound_bins
from cpdata.bench.report import render_markdown
from cpdata.bench.timing import paired_ratio
from cpdata.cli import main
from cpdata.layout.maps import rank_indices, thd_slot_lens

MACHINE_KEYS = {"cpu_model", "cores", "torch_version", "device"}


def _reject_constant(name: str) -> float:
    raise AssertionError(f"bench JSON holds {name}")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "quick.json"
    assert main(["bench", "--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text(), parse_constant=_reject_constant)


def test_every_section_has_rows_with_the_required_keys(results):
    assert MACHINE_KEYS <= set(results["machine"])
    assert results["default_algorithm"] == "bfd"
    for name, module_name in runner.SECTIONS.items():
        module = importlib.import_module(module_name)
        rows = results[name]
        assert rows, f"section {name} is empty"
        for row in rows:
            assert set(module.COLUMNS) <= set(row), (name, set(module.COLUMNS) - set(row))
            for key, value in row.items():
                assert not isinstance(value, float) or math.isfinite(value), (name, key, value)


def test_step_shard_is_faster_and_ships_a_cp_th_of_the_bytes(results):
    rows = results["step_shard"]
    assert {r["layout"] for r in rows} >= {"round_robin", "thd"}
    for r in rows:
        assert r["speedup"] > 1 and r["anchor_ms"] > r["cpdata_ms"] > 0, r  # cpdata is faster, every row
        assert r["speedup"] == pytest.approx(r["anchor_ms"] / r["cpdata_ms"], rel=0.01)
        assert r["cpdata_h2d_bytes"] * r["cp_size"] <= r["anchor_h2d_bytes"] * 1.02, r
        assert r["layout_bytes"] > 0
        assert 0 < r["copy_ms"] < r["cpdata_ms"], r  # the modelled copy alone is part of cpdata's step


def test_worker_and_memcpy_rates_are_positive(results):
    for r in results["worker"]:
        assert 0 < r["tokens_per_s"] < r["memcpy_tokens_per_s"], r  # memcpy is the ceiling
        assert r["fraction_of_memcpy"] == pytest.approx(r["tokens_per_s"] / r["memcpy_tokens_per_s"])
        assert r["cpdata_us_per_pack"] > 0 and r["anchor_host_us"] > 0
        assert r["ratio"] > 0  # (paired round by round: test_the_paired_ratio_divides_out_a_change_of_load)
        assert r["ns_per_pack_token"] * r["capacity"] == pytest.approx(r["cpdata_us_per_pack"] * 1e3, rel=0.05)
    assert {r["cp_size"] for r in results["worker"]} == {2, 4, 8}
    names = {t["target"] for t in results["targets"]}
    assert {"worker vs in-step", "worker per token", "one storage", "handoff cost"} <= names


def test_the_paired_ratio_divides_out_a_change_of_load() -> None:
    """Round by round: where load comes and goes, the rounds it spares give the true 0.5 and so does the median of
    the rounds' ratios, where the ratio of the two sides' medians says 0.125; unequal rounds and a time of zero are
    refused with the values."""
    ours, theirs = [1.0, 1.0, 4.0], [2.0, 8.0, 8.0]  # (round 2: the load arrived between our run and theirs)
    assert paired_ratio([1.0, 4.0, 2.0], [2.0, 8.0, 4.0]) == 0.5
    assert paired_ratio(ours, theirs) == 0.5 and np.median(ours) / np.median(theirs) == 0.125
    with pytest.raises(ValueError, match="as many times on each side, at least one: got 2 and 1"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="not positive: 0.0 s"):
        paired_ratio([0.0, 1.0], [1.0, 1.0])


def test_handoff_receives_one_storage_against_a_dict_of_many(results):
    rows = results["handoff"]
    assert {r["strategy"] for r in rows} == set(torch.multiprocessing.get_all_sharing_strategies())
    for r in rows:
        assert r["storages_per_batch"] == 1 and r["baseline_storages_per_batch"] >= 10
        assert r["receive_ms_per_batch"] > 0 and r["baseline_receive_ms_per_batch"] > 0


def test_packing_never_beats_its_lower_bound(results):
    rows = results["packing"]
    assert {r["algorithm"] for r in rows} == {"bfd", "next_fit", "first_fit", "ffd"}
    assert {r["overflow"] for r in rows} == {"none", "split"}  # both bound kinds exercised
    for r in rows:
        assert r["padding_pct"] >= r["lower_bound_pct"] - 1e-9, r
        assert r["us_per_doc"] > 0
    by = {(r["distribution"], r["capacity"], r["algorithm"]): r for r in rows}
    for (dist, cap, algorithm), r in by.items():
        if algorithm == "bfd":  # the default packs no worse than the online baselines
            for baseline in ("next_fit", "first_fit"):
                assert r["padding_pct"] <= by[(dist, cap, baseline)]["padding_pct"] + 1e-9, (dist, cap, baseline)


def test_balanced_layout_is_no_worse_than_the_head_tail_anchors(results):
    rows = results["balance"]
    by = {(r["distribution"], r["cp_size"], r["layout"]): r for r in rows}
    checked = 0
    for (dist, cp, layout), r in by.items():
        if layout != "balanced":
            continue
        assert r["doc_pad_pct"] == 0 and r["equal_tokens"]
        for anchor in ("contiguous", "round_robin"):
            assert r["imbalance_p95"] <= by[(dist, cp, anchor)]["imbalance_p95"] + 1e-12
            checked += 1
        assert r["imbalance_p95"] <= by[(dist, cp, "thd")]["imbalance_p95"] + 1e-12
        assert by[(dist, cp, "thd")]["doc_pad_pct"] > 0
    assert checked >= 6


def test_gather_collectives_are_counted_per_direction(results):
    for r in results["gather"]:
        assert (r["collectives_cpdata_fwd"], r["collectives_cpdata_bwd"]) == (1, 1)
        assert r["collectives_cpdata"] == 2
        # anchor: all_gather of the tensor + all_gather of the index maps forward; gloo backward = cp scatters
        assert r["collectives_anchor_fwd"] == 2 and r["collectives_anchor_bwd"] >= 1
        assert r["collectives_cpdata"] < r["collectives_anchor"], r  # the direction: fewer collectives
        # Time is only checked for sanity: over gloo on a loaded CPU the two are within noise (0.95-1.24x measured);
        # the direction is asserted on the collective counts above.
        assert r["speedup"] > 0


def test_long_document_offline_is_within_twice_online(results):
    for r in results["long_document"]:
        assert r["pieces"] >= 10 and r["online_s"] > 0
        # Direction only: re-parsing the row per piece measured 4.6x at this quick size, parsing it once
        # per epoch 1.4x. The 2x target is the bench's to report (load on a shared machine moves a single
        # quick run by +-50 %); the behaviour is pinned by counting parses in test_offline_input.
        assert r["ratio"] < 4, r


def test_integrity_rows_time_both_stores_and_check_every_chunk(results):
    rows = results["integrity"]
    assert [r["store"] for r in rows] == ["tokens", "tokens+loss_mask"]
    for r in rows:
        assert r["chunks"] >= 8 and r["plain_s"] > 0 and r["first_s"] > 0 and r["verify_gb_s"] > 0, r
        # Direction only: the <= 5 % target is the bench's to report (a quick pass of ~0.1 s on a shared machine
        # moves by +-20 %); that every chunk is checked is pinned in tests/test_store_integrity.py.
        assert r["overhead_pct"] < 100, r


def test_schedule_rows_cover_every_method_and_balance_beats_the_anchors(results):
    rows = results["schedule"]
    by = {(r["distribution"], r["dp_size"], r["method"]): r for r in rows}
    assert {(r["distribution"], r["dp_size"]) for r in rows} == {("D1", 8), ("D2", 8), ("D2", 32)}
    for dist, dp in (("D1", 8), ("D2", 8), ("D2", 32)):
        assert {m for d, p, m in by if (d, p) == (dist, dp)} >= {
            "nemo_rl_ffd", "verl_kk", "verl_kk_cap", "megatron_dp_balanced", "cpdata_0.1"}
    for r in rows:
        assert r["batches"] >= 8 and 0 <= r["imb_step_mean"] <= r["imb_mb_mean"] + 1e-9, r
        if r["method"].startswith("cpdata_schedule"):
            assert r["over_cap_pct"] == 0 and r["extra_microbatch_pct"] == 0, r
            assert r["max_delay_steps"] <= max(1, r["max_delay"]) and r["min_delay_steps"] >= -1, r  # FIFO step
    assert by[("D1", 8, "verl_kk_cap")]["over_cap_pct"] == 0
    for dist, dp, mine in (("D1", 8, "cpdata_schedule"), ("D2", 8, "cpdata_schedule_delay4")):
        for anchor in ("nemo_rl_ffd", "verl_kk_cap", "megatron_dp_balanced", "cpdata_0.1"):
            assert by[(dist, dp, mine)]["imb_mb_mean"] < by[(dist, dp, anchor)]["imb_mb_mean"], anchor


def test_attention_rows_show_tiled_at_the_ideal_tiles_where_balanced_is_not(results):
    by = {(r["distribution"], r["layout"]): r for r in results["attention"]}
    assert {layout for _, layout in by} == {"contiguous", "round_robin", "thd", "balanced", "tiled"}
    for dist in {d for d, _ in by}:
        tiled, balanced = by[(dist, "tiled")], by[(dist, "balanced")]
        assert 1.0 <= tiled["tiles_max_over_ideal"] <= 1.02 < balanced["tiles_max_over_ideal"], dist
        assert tiled["kv_recv_fraction"] < balanced["kv_recv_fraction"], dist  # balanced needs nearly every key
        assert tiled["flex_mask_mib"] < tiled["dense_mask_mib"] and tiled["solve_us_per_pack"] > 0


def test_targets_and_markdown_cover_every_section(results):
    assert {t["section"] for t in results["targets"]} == set(runner.SECTIONS)
    text = render_markdown(results)
    for header in ("Per-step sharding", "Worker", "Handoff", "Packing", "Load balance", "Gather", "Long document",
                   "Scheduling across DP ranks", "Kernel tiles", "World as one CP group", "Token store checks"):
        assert header in text


def test_unknown_section_is_a_usage_error(capsys):
    assert main(["bench", "--sections", "nope"]) == 2
    assert "unknown bench sections ['nope']" in capsys.readouterr().err


def test_median_rows_take_each_number_s_median_and_keep_the_names():
    runs = [
        [{"layout": "thd", "cp_size": 2, "us": us, "flag": True}, {"layout": "balanced", "cp_size": 4, "us": other,
                                                                   "flag": False}]
        for us, other in ((10.0, 7.0), (30.0, 5.0), (20.0, 6.0))
    ]  # fmt: skip
    assert runner.median_rows("s", runs) == [
        {"layout": "thd", "cp_size": 2, "us": 20.0, "flag": True},
        {"layout": "balanced", "cp_size": 4, "us": 6.0, "flag": False},
    ]
    ints = runner.median_rows("s", [[{"n": 3}], [{"n": 1}]])
    assert ints == [{"n": 1}] and type(ints[0]["n"]) is int  # the lower median stays an int
    with pytest.raises(AssertionError, match="layout differs"):
        runner.median_rows("s", [[{"layout": "thd"}], [{"layout": "balanced"}]])


def test_runs_repeat_every_section_and_report_medians(monkeypatch, tmp_path):
    """``--runs 3``: the section runs three times, its rows are the medians, the JSON and markdown say so."""
    calls = []
    section = types.ModuleType("fake_section")
    section.COLUMNS = ("name", "us")

    def run(*, quick):
        calls.append(quick)
        return [{"name": "a", "us": [5.0, 1.0, 3.0][len(calls) - 1]}]

    section.run = run
    monkeypatch.setitem(sys.modules, "fake_section", section)
    monkeypatch.setattr(runner, "SECTIONS", {"fake": "fake_section"})
    monkeypatch.setattr(runner, "evaluate_targets", lambda results: [])
    path = tmp_path / "runs.json"
    assert main(["bench", "--sections", "fake", "--runs", "3", "--json", str(path)]) == 0
    got = json.loads(path.read_text())
    assert calls == [False, False, False]
    assert got["runs"] == 3 and got["fake"] == [{"name": "a", "us": 3.0}]
    assert "`cpdata bench --runs 3`" in render_markdown(got)


@pytest.mark.parametrize("value", ["0", "-2", "three"])
def test_runs_below_one_is_a_usage_error_naming_the_value(value, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--runs", value])
    assert f"must be an int >= 1, got '{value}'" in capsys.readouterr().err


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(0, 3), st.data())
def test_anchor_indices_match_the_layouts(cp, units, tail_units, data):
    lens = np.asarray(units, dtype=np.int64) * 2 * cp
    pack = int(lens.sum()) + 2 * cp * tail_units
    rank = data.draw(st.integers(0, cp - 1))
    slots = thd_slot_lens(lens, pack)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(slots)]))
    np.testing.assert_array_equal(te_thd_partitioned_indices(cu, pack, cp, rank).numpy(),
                                  rank_indices("thd", cp, lens, pack)[rank])
    for layout in ("round_robin", "contiguous"):
        got = ANCHOR_LAYOUTS[layout]({"input_ids": torch.zeros(1)}, pack, cp, rank).numpy()
        np.testing.assert_array_equal(got, rank_indices(layout, cp, lens, pack)[rank])


def test_an_anchor_for_a_layout_without_one_is_refused_listing_those_with_one():
    batch = {"input_ids": torch.arange(8).view(1, 8)}
    local, index = anchor_shard(batch, layout="contiguous", cp_size=2, cp_rank=1, device=torch.device("cpu"))
    assert index.tolist() == [4, 5, 6, 7] and local["input_ids"].tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"^unknown in-step anchor layout 'balanced'; choose one of \['contiguous', "):
        anchor_shard(batch, layout="balanced", cp_size=2, cp_rank=1, device=torch.device("cpu"))


def _exact_bins(items: list[int], capacity: int) -> int:
    best = len(items)
    items = sorted(items, reverse=True)

    def place(i: int, bins: list[int]) -> None:
        nonlocal best
        if len(bins) >= best:
            return
        if i == len(items):
            best = len(bins)
            return
        for j, used in enumerate(bins):
            if used + items[i] <= capacity and used not in bins[:j]:
                bins[j] += items[i]
                place(i + 1, bins)
                bins[j] -= items[i]
        place(i + 1, [*bins, items[i]])

    place(0, [])
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(4, 30), st.data())
def test_lower_bound_is_valid_and_beats_the_volume_bound(capacity, data):
    items = data.draw(st.lists(st.integers(1, capacity), min_size=1, max_size=8))
    bound = lower_bound_bins(np.asarray(items), capacity)
    assert math.ceil(sum(items) / capacity) <= bound <= _exact_bins(items, capacity)


def test_lower_bound_sees_what_the_volume_bound_misses():
    assert lower_bound_bins(np.array([6, 6, 6, 6]), 10) == 4  # volume bound says 3
    assert split_lower_bound_bins(np.array([25, 6]), 10) == 2 + lower_bound_bins(np.array([5, 6]), 10)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=0, max_size=40), st.integers(1, 6), st.booleans())
def test_karmarkar_karp_partitions_every_item_once(weights, k, equal_size):
    from cpdata.bench.schedule_balance import karmarkar_karp

    parts = karmarkar_karp([float(w) for w in weights], k, equal_size=equal_size)
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
    if equal_size:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    if weights and k == 2 and not equal_size:  # differencing never does worse than the largest item alone
        sums = [sum(weights[i] for i in p) for p in parts]
        assert abs(sums[0] - sums[1]) <= max(weights)


def test_worker_target_reads_the_paired_ratio_and_older_results_without_it():
    """The paired ``ratio`` decides (here it passes while the ratio of the medians would not); results
    written before that column existed are judged by the ratio of the medians."""
    from cpdata.bench.targets import TARGETS

    check = next(fn for section, name, _, fn in TARGETS if name == "worker vs in-step")
    row = {"layout": "balanced", "cp_size": 8, "capacity": 8192, "cpdata_us_per_pack": 160.0, "anchor_host_us": 500.0}
    text, met = check([{**row, "ratio": 0.29}])
    assert met and text.startswith("max 0.29 x anchor (balanced, cp 8") and "medians 160 vs 500 us" in text
    assert check([row]) == ("max 0.32 x anchor (balanced, cp 8, capacity 8192: medians 160 vs 500 us)", False)
    assert check([{**row, "capacity": 4096, "ratio": 0.9}]) == ("no row at capacity >= 8K, cp <= 8", False)
