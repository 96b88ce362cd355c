"""Pinning: gated on CUDA; ShardedBatch takes torch's pin path; PinMemory keeps resume exact (CPU, patched)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from test_collate import make_plans
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory
from torchdata.nodes import IterableWrapper, Loader, PinMemory

from cpdata.nodes import loader as loader_module
from cpdata.nodes.collate import Collate
from cpdata.nodes.loader import close_loader, maybe_pin
from cpdata.nodes.shard import ShardForRank
from cpdata.worker.batch import ShardedBatch


def shard_node(n_plans: int = 6):
    plans, _ = make_plans(np.random.default_rng(0), n_plans=n_plans, capacity=64, doc_multiple=4)
    return ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=1, layout="thd")


@pytest.fixture
def fake_pinning(monkeypatch):
    """CUDA 'available', page-locking replaced by a clone that counts its calls."""
    calls = []

    def fake_pin(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return self.clone()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_no_pinning_without_cuda(caplog):
    loader_module._log_once.cache_clear()  # messages logged by earlier tests are logged again
    node = shard_node()
    with caplog.at_level(logging.INFO, logger="cpdata.nodes.loader"):
        assert maybe_pin(node, pin_memory=None) is node
        assert maybe_pin(node, pin_memory=True) is node
        assert maybe_pin(node, pin_memory=True) is node
        assert maybe_pin(node, pin_memory=False) is node
    messages = [r.getMessage() for r in caplog.records]
    assert sum("pin_memory=True" in m for m in messages) == 1  # logged once
    assert sum("not pinning batches" in m for m in messages) == 1  # None: no CUDA, so no pinning


def test_sharded_batch_takes_torchs_pin_path(fake_pinning):
    batch = next(shard_node())
    pinned = torch_pin_memory(batch)
    assert isinstance(pinned, ShardedBatch) and pinned is not batch
    assert pinned.info == batch.info
    for k in batch:
        assert torch.equal(pinned[k], batch[k]) and pinned[k].data_ptr() != batch[k].data_ptr()
    assert torch.equal(pinned.layout.gather_index, batch.layout.gather_index)
    assert pinned.layout.gather_index.data_ptr() != batch.layout.gather_index.data_ptr()
    # One pin for the buffer that backs every tensor and both layout maps (single host-to-device copy later).
    assert len(fake_pinning) == 1
    lay = batch.layout
    maps = (lay.local_token_global_indices, lay.gather_index)
    assert fake_pinning[0][0] >= sum(t.numel() * t.element_size() for t in (*batch.values(), *maps))
    plans, _ = make_plans(np.random.default_rng(1), n_plans=1, capacity=64, doc_multiple=4)
    every_rank = next(ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd", all_ranks=True))
    both = torch_pin_memory(every_rank)
    assert isinstance(both, tuple) and all(isinstance(b, ShardedBatch) for b in both)


def test_pin_memory_node_thread_and_resume(fake_pinning):
    root = maybe_pin(shard_node(8), pin_memory=True)
    assert isinstance(root, PinMemory)
    loader = Loader(root)
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = [b.info["digest"] for b in it]
    assert all(isinstance(b, ShardedBatch) for b in seen) and len(rest) == 5
    assert fake_pinning  # the pin thread really pinned
    close_loader(loader)

    resumed = Loader(maybe_pin(shard_node(8), pin_memory=True))
    resumed.load_state_dict(state)
    assert [b.info["digest"] for b in resumed] == rest
    close_loader(resumed)
