"""The GPU check's plumbing on CPU: every part skipped and named, the JSON and markdown written, exit 0; its
per-rank cases and its per-tile fit checked on their own (the timed parts need CUDA)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cpdata.bench import gpu_check
from cpdata.bench.gpu_attention import LAYOUTS, fit_line, rank_cases, time_step
from cpdata.device.varlen import varlen_plan
from cpdata.layout.tiles import live_tiles

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour (every part skipped)")


def test_cpu_machine_skips_every_part_by_name_and_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "cpdata.bench.gpu_check", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert list(report["parts"]) == list(gpu_check.PARTS)
    for name, part in report["parts"].items():
        assert part["status"] == "skipped" and "no CUDA device" in part["reason"], (name, part)
        assert f"{name}: skipped" in done.stdout
    text = (tmp_path / "out" / "gpu_check.md").read_text()
    assert all(f"| {name} | skipped |" in text for name in gpu_check.PARTS)
    assert not (tmp_path / "out" / "calibration.json").exists()
    assert f"wrote {tmp_path / 'out'}" in done.stdout


def test_an_unknown_part_is_refused_listing_the_parts_before_any_runs():
    ran = gpu_check.run_parts(["pinned_batches"])
    assert list(ran) == ["pinned_batches"]  # a known part is taken (skipped by name on CPU)
    parts = ", ".join(map(repr, gpu_check.PARTS))
    with pytest.raises(ValueError, match=rf"^unknown part 'warp'; choose one of \[{parts}\]$"):
        gpu_check.run_parts(["warp"])
    logged: list[str] = []
    with pytest.raises(ValueError, match="unknown part 'warp'"):  # a bad name after a good one: nothing ran
        gpu_check.run_parts(["pinned_batches", "warp"], log=logged.append)
    assert logged == []


def test_fit_recovers_a_line_and_refuses_one_point():
    tiles = np.array([10, 200, 3000, 45000])
    fit = fit_line(tiles, 1e-4 + 2e-6 * tiles)
    assert fit["per_tile_seconds"] == pytest.approx(2e-6) and fit["intercept_seconds"] == pytest.approx(1e-4)
    assert fit["r2"] == pytest.approx(1.0) and fit["points"] == 4
    assert fit_line(np.array([5, 5]), np.array([1.0, 2.0]))["per_tile_seconds"] is None
    by_position = fit_line(tiles, 3e-5 + 4e-9 * tiles, per="position")  # (the linear layers' part names its slope)
    assert by_position["per_position_seconds"] == pytest.approx(4e-9) and "per_tile_seconds" not in by_position


def test_time_step_leaves_out_its_warm_up_and_takes_the_median_of_the_repeats():
    naps = iter([0.5, 0.002, 0.3, 0.02])  # the warm-up (compiling), then three timed calls
    seconds = time_step(lambda: time.sleep(next(naps)), 3)
    assert next(naps, None) is None  # one warm-up + three repeats, no more
    assert 0.02 <= seconds < 0.1  # the middle nap: not the warm-up, nor a mean (0.107 over the repeats)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank_cases_cover_the_pack_and_hold_every_key_their_queries_need(layout):
    cases = rank_cases("sft", 8192, 4, layout)
    assert [c.rank for c in cases] == [0, 1, 2, 3]
    assert np.array_equal(np.sort(np.concatenate([c.pos for c in cases])), np.arange(8192))
    for case in cases:
        assert case.exchange == (layout == "tiled") and np.all(case.start <= case.pos)
        assert np.array_equal(case.key_pos[: case.pos.size], case.pos) or not case.exchange
        plan = varlen_plan(torch.as_tensor(case.start), torch.as_tensor(case.pos), torch.as_tensor(case.key_pos),
                           window=None, device=torch.device("cpu"))  # fmt: skip (raises if a key is missing)
        assert plan.cu_seq_q[-1] == case.pos.size
    if layout != "tiled":  # keys in global order: the flex mask's tiles are the stream-grid counter's
        from cpdata.device.attention_masks import block_mask

        rows = np.stack([c.pos for c in cases])
        lens = np.diff(np.unique(np.concatenate([c.start for c in cases] + [[8192]])))
        want = live_tiles(rows, lens, 8192, 128)
        for case in cases:
            mask = block_mask(torch.as_tensor(case.start)[None], torch.as_tensor(case.pos)[None], 8192)
            assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) == want[case.rank]


def test_autocast_part_runs_cp2_on_cpu_ranks_within_bf16_tolerance():
    """The autocast part's code on CPU (gloo, spawned ranks): bf16 autocast through "cpdata" at cp 2 against the
    documents alone under the same autocast. Rotary leaves q and k in float32 and v in bf16 under autocast; the
    attention casts them as autocast casts SDPA's inputs (before, the K/V concatenation refused the mix)."""
    from cpdata.bench.gpu_steps import BF16_TOL, autocast_cp2

    result = autocast_cp2("cpu")
    assert result["ok"] and 0 < result["max_rel_error"] < BF16_TOL and result["documents"] >= 3, result


def test_the_linear_part_fits_seconds_per_position_from_its_timed_rows(monkeypatch):
    """On CPU with a small layer: every row timed forward + backward (gradients reach every weight), and the fit
    over the rows is the least-squares line (the timings replaced by an exact one: 2 us a position, 0.1 ms
    each call)."""
    from cpdata.bench import gpu_linear

    layer = gpu_linear.linear_layers(32, 8, 64, device="cpu", dtype=torch.float32)
    x = torch.randn(5, 32, requires_grad=True)
    layer(x).backward(torch.randn(5, 32))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())  # (K and V too)
    timed: list[int] = []

    def exact(step, repeats):
        step()  # (the pass runs: backward of the layer on that row)
        timed.append(repeats)
        return 1e-4 + 2e-6 * [64, 128, 256][len(timed) - 1]

    monkeypatch.setattr(gpu_linear, "time_step", exact)
    got = gpu_linear.run(positions=(64, 128, 256), repeats=3, hidden=32, kv_dim=8, mlp=64, device="cpu",
                         dtype=torch.float32)  # fmt: skip
    assert [r["positions"] for r in got["rows"]] == [64, 128, 256] and timed == [3, 3, 3]
    assert got["per_position_seconds"] == pytest.approx(2e-6) and got["intercept_seconds"] == pytest.approx(1e-4)
    assert got["r2"] == pytest.approx(1.0) and got["rows"][0]["us_per_position"] == pytest.approx((1e-4 + 128e-6) / 64 * 1e6)
    assert got["shape"] == "hidden 32, K/V 8, SwiGLU 64, float32"


def test_calibration_takes_the_tile_and_where_measured_the_position(tmp_path):
    from cpdata.layout.world_cost import H100_DEFAULTS, WorldCost

    tile = {"per_tile_seconds": 2.5e-6, "bytes_per_key": 4096.0, "tile": 128, "source": "make gpu-check: flex"}
    attention = {"status": "ok", "result": {"calibration": tile}}
    linear = {"status": "ok", "result": {"per_position_seconds": 1.7e-6, "shape": "hidden 4096"}}
    assert gpu_check.calibration_of({"linear_per_position": linear}) is None  # (a cost file needs the tile)
    alone = gpu_check.calibration_of({"attention_per_rank": attention})
    both = gpu_check.calibration_of({"attention_per_rank": attention, "linear_per_position": linear})
    assert alone == tile and "per_position_seconds" not in alone
    assert both["per_position_seconds"] == 1.7e-6 and both["source"].endswith("; linear layers: hidden 4096, "
                                                                              "forward + backward")  # fmt: skip
    path = tmp_path / "calibration.json"
    for written, position in ((alone, H100_DEFAULTS.per_position_seconds), (both, 1.7e-6)):
        path.write_text(json.dumps(written))
        cost = WorldCost.from_json(path)  # (what make gpu-check writes, the bench reads)
        assert cost.per_tile_seconds == 2.5e-6 and cost.per_position_seconds == position
    unmeasured = {"status": "ok", "result": {"per_position_seconds": None, "shape": "x"}}
    assert gpu_check.calibration_of({"attention_per_rank": attention, "linear_per_position": unmeasured}) == tile
