"""The layout check on by default: CP ranks fed different packs (a ``dp_rank`` slip) fail on every rank at the
first ``shard()`` and on entering a hand-built ``ContextParallelAttention``; agreeing ranks pass; 0 turns it off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from cpdata import build_loader
from cpdata.device.consistency import LayoutCheck
from cpdata.device.cp_attention import ContextParallelAttention
from cpdata.nemo.sharder import ContextParallelSharder

RNG = np.random.default_rng(4)
DOCS = [{"input_ids": RNG.integers(1, 300, int(n))} for n in RNG.integers(8, 60, 40)]


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "ok"


def _batches(rank: int, cp: int, dp_rank: int, n: int) -> list:
    """The first ``n`` batches of CP rank ``rank`` when the pipeline is told ``dp_rank`` (of 2)."""
    loader = build_loader(DOCS, capacity=128, cp_size=cp, cp_rank=rank, layout="thd", dp_rank=dp_rank, dp_size=2,
                          prefetch=0)  # fmt: skip
    return [b for b, _ in zip(loader, range(n), strict=False)]


def _run(rank: int, cp: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    good = _batches(rank, cp, 0, 3)  # a pure-CP mesh: every CP rank is DP rank 0
    slip = _batches(rank, cp, rank % 2, 3)  # the global rank passed as dp_rank: ranks get other packs
    out: dict[str, object] = {}
    sharder = ContextParallelSharder(None, mesh, good[0])
    out["good"] = [_outcome(lambda b=b: sharder.shard(b)) for b in good]
    out["good_calls"] = sharder._check.calls
    sharder = ContextParallelSharder(None, mesh, slip[0])
    out["slip"] = _outcome(lambda: sharder.shard(slip[0]))  # the very first step
    off = ContextParallelSharder(None, mesh, slip[0], check_layout_every=0)
    out["off"] = [_outcome(lambda b=b: off.shard(b)) for b in slip]
    every2 = ContextParallelSharder(None, mesh, slip[0], check_layout_every=2)
    calls = []

    def counted(layout, group=None, *, device=None):
        calls.append(layout.digest)

    import cpdata.device.consistency as consistency

    real, consistency.verify_layout_consistency = consistency.verify_layout_consistency, counted
    try:
        for b in slip:
            every2.shard(b)
    finally:
        consistency.verify_layout_consistency = real
    out["every2"] = len(calls)  # batches 0 and 2 of 3
    layout = ContextParallelSharder(None, mesh, slip[0], check_layout_every=0)
    layout.shard(slip[0])

    def enter():
        with ContextParallelAttention(layout.shard_layout, mesh.get_group()):
            pass

    out["ctx"] = _outcome(enter)
    out["digests_differ"] = good[0].layout.digest != slip[0].layout.digest or rank == 0
    dist.barrier()
    return out


@pytest.mark.parametrize("cp", [2])
def test_a_dp_rank_slip_fails_on_every_rank_at_the_first_step(cp):
    results = run_ranks(_run, cp, timeout=60)
    for rank, r in enumerate(results):
        assert r["good"] == ["ok"] * 3 and r["good_calls"] == 3, r
        assert "CP ranks received different shard plans" in r["slip"], (rank, r["slip"])
        assert "global rank as dp_rank" in r["slip"]
        assert r["off"] == ["ok"] * 3, "check_layout_every=0 turns the check off"
        assert r["every2"] == 2
        assert "CP ranks received different shard plans" in r["ctx"], (rank, r["ctx"])
        assert r["digests_differ"]


def test_the_interval_is_checked():
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="layout check interval"):
            LayoutCheck(bad)
    with pytest.raises(ValueError, match="layout check interval"):
        ContextParallelSharder(None, None, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, check_layout_every=-2)
