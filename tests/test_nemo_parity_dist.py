"""NeMo-style direct construction on real gloo ranks: gathers without a precomputed inverse.

A backend's ``shard_batch`` reports a layout with lengths only (NeMo's
round-robin) or an int32 ``[1, N]`` partition (TE's), and no ``gather_index``.
The first gather all-gathers the index map once and caches the inverse on the
layout; every later gather is one collective on the data.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from dist_utils import run_ranks
from test_gather_dist import GATHERS, counting_collectives
from torch.distributed.device_mesh import init_device_mesh

from cpdata.layout.maps import rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.raw_shard import closed_form_indices
from cpdata.nemo.sharder import ContextParallelSharder


def _lazy_inverse(rank: int, cp: int) -> list[int]:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    seq, padded = 4 * cp - 1, 4 * cp
    full = torch.randn(2, padded, 3, generator=torch.Generator().manual_seed(cp), dtype=torch.float64)
    rows = rank_indices("round_robin", cp, (), padded)
    counts = []

    def lengths_only(cp_mesh, tp_mesh, batch, **kw):  # NeMo's round-robin report
        return contextlib.nullcontext, batch, ShardLayout(original_seq_len=seq, padded_seq_len=padded)

    s = ContextParallelSharder(device_mesh=mesh, shard_batch=lengths_only,
                               local_token_global_indices=functools.partial(closed_form_indices, "round_robin"))
    s.shard({})
    local = full[:, torch.from_numpy(rows[rank])].clone().requires_grad_()
    for _ in range(2):
        with counting_collectives() as calls:
            gathered = s.gather_token_tensor(local, seq_dim=1)
        assert torch.equal(gathered, full) and all(n in GATHERS for n, _ in calls)
        counts.append(len(calls))
    assert s.shard_layout.gather_index is not None and s.shard_layout.original_seq_len == seq
    assert torch.equal(s.gather_token_tensor(local, seq_dim=1, trim=True), full[:, :seq])
    (gathered * 2).sum().backward()
    assert torch.equal(local.grad, torch.full_like(local, 2.0 * cp))  # replicated loss: cp x (gradient contract)

    thd_rows = rank_indices("thd", cp, [2 * cp, 6 * cp], 8 * cp)
    partition = torch.from_numpy(thd_rows[rank]).to(torch.int32)[None]  # TE reports int32 [1, N]

    def te_report(cp_mesh, tp_mesh, batch, **kw):
        return contextlib.nullcontext, batch, ShardLayout(local_token_global_indices=partition, padded_seq_len=8 * cp)

    te = ContextParallelSharder(device_mesh=mesh, shard_batch=te_report)
    te.shard({})
    stream = torch.arange(8.0 * cp)
    with counting_collectives() as calls:
        assert torch.equal(te.gather_token_tensor(te.shard_token_tensor(stream, seq_dim=0), seq_dim=0), stream)
    counts.append(len(calls))
    return counts


@pytest.mark.parametrize("cp", [2, 4])
def test_gather_builds_the_inverse_once_for_backend_layouts(cp):
    assert run_ranks(_lazy_inverse, cp, timeout=120) == [[2, 1, 2]] * cp
