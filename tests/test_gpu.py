"""GPU tier: pinned batches, non-blocking host-to-device copy, the gather on CUDA.

Skipped without CUDA (the reason is printed). Single process: a 1-rank NCCL
group is enough to exercise the device paths; the multi-rank gather semantics
are covered on gloo in test_gather_dist.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinning and H2D overlap are GPU-only"),
]


def _docs(n: int = 64, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 1000, int(rng.integers(20, 400)))} for _ in range(n)]


def test_batches_arrive_pinned_and_copy_without_blocking():
    from cpdata.bench.gpu_steps import pinned_batches

    result = pinned_batches()  # a pin_memory=True loader's batch, copied on a side stream
    assert result["pinned"] and result["copied_unchanged"], result


def test_copy_overlaps_compute():
    """A pinned non-blocking copy on a side stream runs while a matmul occupies the default stream."""
    from cpdata.bench.gpu_steps import copy_overlap

    result = copy_overlap()
    # The copy was issued after the matmuls but finished before the compute did: it overlapped.
    assert result["copy_done_ms"] < result["compute_done_ms"], result


@pytest.fixture
def one_rank_nccl(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_sharder_moves_a_worker_batch_to_cuda_and_gathers(one_rank_nccl):
    from cpdata.nemo.sharder import ContextParallelSharder
    from cpdata.nodes.loader import build_loader, closing_loader

    with closing_loader(build_loader(_docs(), capacity=1024, cp_size=1, cp_rank=0, layout="identity")) as loader:
        batch = next(iter(loader))
    sharder = ContextParallelSharder(None, one_rank_nccl, batch)
    _, local = sharder.shard(batch)
    assert all(t.is_cuda for t in local.values() if isinstance(t, torch.Tensor))
    x = local["input_ids"].float().requires_grad_()
    full = sharder.gather_token_tensor(x, seq_dim=1)
    assert torch.equal(full, x)
    full.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
