"""Section ``step_shard``: per-step sharding, in-step anchor vs cpdata's pre-sharded batch.

One pack is collated once; the anchor shards the full batch in the step
(:func:`cpdata.bench.anchors.anchor_shard`), cpdata's ``ContextParallelSharder.shard()`` only moves rank 0's
``ShardedBatch``; both are checked equal first, then timed alternately (medians). On cuda host batches are
pinned; on cpu a same-device copy models the transfer for both (one intra-op thread: parallel CPU kernels
stall on a loaded machine). ``copy_ms``: cpdata's buffer copy alone; ``*_h2d_bytes``: tensor bytes each side
copies; ``layout_bytes``: the index maps cpdata also ships.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torchdata.nodes import IterableWrapper

from cpdata.bench.anchors import ANCHOR_LAYOUTS, anchor_shard
from cpdata.bench.distributions import sample, split_graph, token_documents
from cpdata.bench.timing import alternating_medians, bench_device
from cpdata.worker.keys import STANDARD_TOKEN_KEYS

__all__ = ["COLUMNS", "LocalMesh", "TABLE", "make_batches", "run"]

COLUMNS: tuple[str, ...] = (
    "layout", "cp_size", "tokens", "anchor_ms", "cpdata_ms", "speedup", "anchor_h2d_bytes", "cpdata_h2d_bytes",
)
TABLE: tuple[str, ...] = (*COLUMNS, "copy_ms", "layout_bytes", "device")
TITLE = "in-step sharding (anchor) vs ContextParallelSharder.shard() on a pre-sharded batch, rank 0"


class LocalMesh:
    """A one-dimension ``"cp"`` mesh seen from one rank, without a process group: what the sharder reads of a
    ``DeviceMesh``, so ``shard()`` can be timed in one process."""

    mesh_dim_names = ("cp",)

    def __init__(self, rank: int, size: int, device_type: str) -> None:
        self._rank, self._size, self.device_type = rank, size, device_type

    def __getitem__(self, name: str) -> LocalMesh:
        if name != "cp":
            raise KeyError(name)
        return self

    def get_local_rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def make_batches(tokens: int, layout: str, cp_size: int, cp_rank: int = 0, seed: int = 0):
    """``(full_batch, sharded_batch)``: the first pack of an SFT-like stream, full and for ``cp_rank``."""
    from cpdata.nodes.shard import ShardForRank

    docs = token_documents(sample("sft", int(tokens / 500) + 64, seed), seed)
    collated = next(split_graph(docs, tokens, cp_size, layout))  # (a node resets itself on its first next)
    full = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in collated.tensors().items()}
    shard_node = ShardForRank(IterableWrapper([collated]), cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    return full, next(shard_node)


def _one(tokens: int, layout: str, cp_size: int, device: torch.device, repeats: int) -> dict:
    from cpdata.nemo.sharder import ContextParallelSharder

    full, sharded = make_batches(tokens, layout, cp_size)
    if device.type == "cuda":
        full = {k: v.pin_memory() for k, v in full.items()}
        sharded = sharded.pin_memory()
    sharder = ContextParallelSharder(None, LocalMesh(0, cp_size, device.type), sharded)

    anchor = functools.partial(anchor_shard, full, layout=layout, cp_size=cp_size, cp_rank=0, device=device)

    def ours():
        _, out = sharder.shard(sharded)  # on CPU the move is a no-op: model the copy as the batch does it
        moved = sharded.to(device, copy=True) if device.type == "cpu" else out
        return dict(moved)  # every key read, as the model does: a batch builds its views when read

    got_anchor, anchor_index = anchor()
    got = ours()
    for key in STANDARD_TOKEN_KEYS:
        assert torch.equal(got_anchor[key].cpu(), got[key].cpu()), f"anchor and cpdata disagree on {key!r}"
    assert torch.equal(anchor_index.cpu(), sharded.layout.local_token_global_indices), "index maps differ"

    head = sharded._buffer[: sharded._batch_bytes()]  # the bytes cpdata's step copies, alone
    copy = head.clone if device.type == "cpu" else functools.partial(head.to, device, non_blocking=True)
    anchor_s, ours_s, copy_s = alternating_medians((anchor, ours, copy), repeats=repeats, device=device)
    return {
        "layout": layout, "cp_size": cp_size, "tokens": tokens,
        "anchor_ms": anchor_s * 1e3, "cpdata_ms": ours_s * 1e3, "speedup": anchor_s / ours_s, "copy_ms": copy_s * 1e3,
        "anchor_h2d_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "cpdata_h2d_bytes": sharded.nbytes(), "layout_bytes": sharded._map_nbytes(),
        "device": str(device), "documents": int(sharded.info["n_documents"]),
    }


def run(*, quick: bool) -> list[dict]:
    device = bench_device()
    sizes = (8192, 32768) if quick else (8192, 32768, 131072)
    cps = (4,) if quick else (2, 4, 8)
    repeats = 10 if quick else 50
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring: CPU intra-op threads stall on a shared machine
    try:
        return [_one(tokens, layout, cp, device, repeats)
                for layout in ANCHOR_LAYOUTS for cp in cps for tokens in sizes]
    finally:
        torch.set_num_threads(threads)
