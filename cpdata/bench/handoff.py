"""Section ``handoff``: what the training process pays to receive one batch from a dataloader worker.

A ``StatefulDataLoader`` worker (``fork``, ``batch_size=None``) yields one CP rank's batches built beforehand
(32K tokens, cp 4, ``balanced``; ``--quick``: 8K): cpdata's :class:`~cpdata.worker.batch.ShardedBatch` (one
buffer for its tensors and layout maps) and, as the baseline, a plain dict of the same tensors plus the two
maps. ``receive_ms_per_batch``: the main process's CPU time per batch (``time.process_time``) from the second
batch on, median over repeats alternating the two; ``storages_per_batch``: distinct storages of a received
batch. Every sharing strategy torch offers is measured. A received ``ShardedBatch`` builds its views on first
read (in training, on the device copy), so the receive time leaves them out.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch
import torch.multiprocessing as tmp
from torch.utils.data import IterableDataset

from cpdata.bench.distributions import sample, token_documents
from cpdata.worker.batch import ShardedBatch

__all__ = ["COLUMNS", "TABLE", "run"]

COLUMNS: tuple[str, ...] = (
    "strategy", "tokens", "storages_per_batch", "receive_ms_per_batch", "baseline_storages_per_batch",
    "baseline_receive_ms_per_batch", "ratio",
)
TABLE: tuple[str, ...] = (*COLUMNS, "batches")
TITLE = "main-process CPU to receive one rank's batch from a StatefulDataLoader worker: cpdata vs plain dict"


class _Prebuilt(IterableDataset):
    """Yields ``items`` once each (built in the parent; a forked worker inherits them)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def _batches(tokens: int, count: int) -> list:
    from cpdata.nodes.dataset import CPDataset

    docs = token_documents(sample("sft", int(tokens * count / 600) + 64, 0))
    dataset = CPDataset(docs, capacity=tokens, cp_size=4, cp_rank=0, layout="balanced")
    return list(itertools.islice(dataset, count))


def _with_maps(batch: ShardedBatch) -> dict[str, torch.Tensor]:
    """The batch's tensors and its two layout maps (which travel in the batch's one buffer)."""
    return {**batch, "local_token_global_indices": batch.layout.local_token_global_indices,
            "gather_index": batch.layout.gather_index}


def _storages(item) -> int:
    tensors = _with_maps(item) if isinstance(item, ShardedBatch) else item
    return len({t.untyped_storage().data_ptr() for t in tensors.values()})


def _receive(items: list) -> tuple[float, int]:
    """Main-process CPU seconds per item after the first, and storages of a received item."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(_Prebuilt(items), batch_size=None, num_workers=1, multiprocessing_context="fork")
    it = iter(loader)
    got = [next(it)]
    t0 = time.process_time()
    got.extend(it)
    seconds = (time.process_time() - t0) / (len(got) - 1)
    assert len(got) == len(items)
    return seconds, _storages(got[-1])


def _one(strategy: str, tokens: int, count: int, repeats: int) -> dict:
    batches = _batches(tokens, count)
    plain = [{k: v.clone() for k, v in _with_maps(b).items()} for b in batches]
    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy(strategy)
    try:
        ours, base = [], []
        for _ in range(repeats):
            ours.append(_receive(batches))
            base.append(_receive(plain))
    finally:
        tmp.set_sharing_strategy(previous)
    ours_s = float(np.median([s for s, _ in ours]))
    base_s = float(np.median([s for s, _ in base]))
    return {
        "strategy": strategy, "tokens": tokens, "batches": count,
        "storages_per_batch": ours[0][1], "receive_ms_per_batch": ours_s * 1e3,
        "baseline_storages_per_batch": base[0][1], "baseline_receive_ms_per_batch": base_s * 1e3,
        "ratio": ours_s / base_s,
    }  # fmt: skip


def run(*, quick: bool) -> list[dict]:
    tokens, count, repeats = (8192, 24, 3) if quick else (32768, 64, 5)
    strategies = sorted(tmp.get_all_sharing_strategies())
    return [_one(s, tokens, count, repeats) for s in strategies]
