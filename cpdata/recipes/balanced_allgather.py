"""Balanced packs for all-gather attention with a document mask.

Use when each rank computes attention for its local queries against the full,
all-gathered K/V (torch flex-attention CP, the demo model in
``examples/cp_model.py``) and documents must not attend to each other.

Packing: best-fit-decreasing (padding within ~0.05 pp of the lower bound);
documents longer than ``capacity`` are split into pieces whose position ids
continue across packs (``overflow="split"``). Layout ``balanced``: every
document is cut head-tail across the CP ranks, its remainder tokens dealt
round-robin, with no per-document padding, so the causal work of a pack is
split evenly (max/mean ~1.00, against ~1.5 for ``contiguous`` on long
documents) and only the pack's tail is padded to a multiple of ``cp_size``.

The attention consumes any layout through ``ShardLayout`` alone, so ``layout``
may be overridden to compare layouts under the same model.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import Loader

from cpdata.nodes.loader import build_loader
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan

__all__ = ["build"]


def build(
    source: Any,
    *,
    capacity: int,
    cp_size: int,
    cp_rank: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    layout: str = "balanced",
    overflow: str = "split",
    padding_token_id: int = 0,
    vocab_size: int | None = None,
    prefetch: int = 2,
) -> Loader:
    """Loader of ``[1, capacity / cp_size]`` BSHD shards for one CP rank.

    Args:
        source: documents ``{"input_ids": int [n], ...}`` (a sequence, iterable or node).
        capacity: tokens per pack, a multiple of ``cp_size`` (``2 * cp_size`` for
            ``round_robin``/``thd`` overrides).
        cp_size, cp_rank: the CP group and this rank in it.
        dp_rank, dp_size: the data-parallel shard of ``source`` this group reads.
        seed: packer seed (all CP ranks of a group must use the same).
        layout: ``"balanced"``; any layout of :data:`cpdata.LAYOUTS` works with
            all-gather attention.
        overflow: policy for documents longer than ``capacity``.
        padding_token_id, vocab_size: pad id; ids are checked against ``vocab_size``.
        prefetch: batches prepared ahead in a background thread.
    """
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout, batch_size=1, qkv_format="bshd",
        padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
