"""verify_layout_consistency on real gloo ranks: passes on agreement, raises on every rank otherwise."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from cpdata.device.consistency import verify_layout_consistency
from cpdata.layout.shard_layout import ShardLayout

DIGEST = 0x1234_5678_9ABC_DEF0 & ((1 << 63) - 1)


class _Batch(dict):
    def __init__(self, layout):
        super().__init__()
        self.layout = layout


def _outcome(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "ok"


def _check(rank: int, cp: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    same = ShardLayout(cp_size=cp, cp_rank=rank, digest=DIGEST)
    odd = ShardLayout(cp_size=cp, cp_rank=rank, digest=DIGEST + (rank == cp - 1))
    missing = ShardLayout(cp_size=cp, cp_rank=rank, digest=None if rank == 0 else DIGEST)
    too_wide = ShardLayout(cp_size=cp, cp_rank=rank, digest=2**63)  # past int64: not a 63-bit plan digest
    return {
        "equal_mesh": _outcome(lambda: verify_layout_consistency(same, mesh)),
        "equal_batch_group": _outcome(lambda: verify_layout_consistency(_Batch(same), dist.group.WORLD)),
        "one_differs": _outcome(lambda: verify_layout_consistency(odd, mesh)),
        "one_missing": _outcome(lambda: verify_layout_consistency(missing, mesh)),
        "too_wide": _outcome(lambda: verify_layout_consistency(too_wide, mesh)),
        "after": _outcome(lambda: verify_layout_consistency(same, mesh)),  # still in step after failures
    }


@pytest.mark.parametrize("cp", [2, 4])
def test_consistency_passes_on_agreement_and_raises_everywhere_otherwise(cp):
    start = time.monotonic()
    results = run_ranks(_check, cp, timeout=30)
    assert time.monotonic() - start < 30
    for rank, r in enumerate(results):
        assert r["equal_mesh"] == r["equal_batch_group"] == r["after"] == "ok"
        assert "different shard plans" in r["one_differs"]
        assert f"layout.digest is {2**63} on cp_rank {rank}" in r["too_wide"], r["too_wide"]
        assert f"min {DIGEST} and max {DIGEST + 1}" in r["one_differs"]
        assert f"this rank (cp_rank {rank}) has digest {DIGEST + (rank == cp - 1)}" in r["one_differs"]
        if rank == 0:
            assert "layout.digest is None" in r["one_missing"] and "plan_digest" in r["one_missing"]
        else:
            assert "some rank has no digest" in r["one_missing"]


def test_consistency_rejects_non_layouts():
    with pytest.raises(TypeError, match="ShardLayout or a batch with a .layout"):
        verify_layout_consistency({"input_ids": None}, None)


def _epoch_end_rank(rank: int, world: int) -> int:
    from cpdata.device.consistency import all_ranks_have_batch

    it = iter(range(3 + 2 * rank))  # DP ranks whose epochs end at different steps
    steps = 0
    while all_ranks_have_batch(next(it, None) is not None):
        dist.all_reduce(torch.ones(1))  # a step's collective: would hang if one rank stopped alone
        steps += 1
    return steps


def test_all_ranks_stop_at_the_shortest_epoch():
    assert run_ranks(_epoch_end_rank, 3, timeout=60) == [3, 3, 3]


def test_all_ranks_have_batch_without_a_process_group():
    from cpdata.device.consistency import all_ranks_have_batch

    assert all_ranks_have_batch(True) is True and all_ranks_have_batch(False) is False
