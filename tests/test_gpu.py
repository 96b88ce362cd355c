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
    from cpdata.nodes.loader import build_loader, closing_loader

    with closing_loader(build_loader(_docs(), capacity=2048, cp_size=2, cp_rank=0, layout="balanced",
                                     pin_memory=True)) as loader:  # fmt: skip
        batch = next(iter(loader))
    assert all(t.is_pinned() for t in batch.values())
    assert batch.layout.gather_index.is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moved = batch.to("cuda", non_blocking=True)
    stream.synchronize()
    for key, tensor in batch.items():
        assert moved[key].is_cuda and torch.equal(moved[key].cpu(), tensor)


def test_copy_overlaps_compute():
    """A pinned non-blocking copy on a side stream runs while a matmul occupies the default stream."""
    host = torch.empty(64 * 1024 * 1024 // 8, dtype=torch.int64).pin_memory()
    x = torch.randn(4096, 4096, device="cuda")
    copy_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(8):
        x = x @ x
        x = x / x.norm()
    with torch.cuda.stream(copy_stream):
        copy_start = torch.cuda.Event(enable_timing=True)
        copy_end = torch.cuda.Event(enable_timing=True)
        copy_start.record(copy_stream)
        host.to("cuda", non_blocking=True)
        copy_end.record(copy_stream)
    end.record()
    torch.cuda.synchronize()
    # The copy was issued after the matmuls but finished before the compute did: it overlapped.
    assert start.elapsed_time(copy_end) < start.elapsed_time(end)


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
