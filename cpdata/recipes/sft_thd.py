"""Supervised fine-tuning packs in THD form for Transformer Engine (``qkv_format="thd"``, ``padding_causal``).

Each example is one document, truncated to ``capacity``; its ``labels`` or loss mask become next-token targets
under ``labels_alignment`` (:mod:`cpdata.worker.targets`). Layout ``thd`` is TE's own partitioning
(docs/recipes.md).
"""

from __future__ import annotations

from typing import Any

from cpdata.nodes.loader import ResumableLoader, build_loader
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
    batch_size: int = 1,
    overflow: str = "truncate",
    padding_token_id: int = 0,
    vocab_size: int | None = None,
    prefetch: int = 2,
    labels_alignment: str | None = None,
) -> ResumableLoader:
    """Loader of flat THD shards ``[batch_size * capacity / cp_size]`` of ``source`` (``{"input_ids": int [n],
    "labels"?: int [n], "loss_mask"?: [n]}`` examples; ``labels_alignment`` is needed with labels or a mask)."""
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="thd", batch_size=batch_size,
        qkv_format="thd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size,
                        labels_alignment=labels_alignment),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
