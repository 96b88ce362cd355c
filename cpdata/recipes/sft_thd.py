"""Supervised fine-tuning packs in THD form for Transformer Engine (``qkv_format="thd"``, ``padding_causal``).

Each example is one document, truncated to ``capacity``; its ``labels`` or loss mask become next-token targets
under ``labels_alignment`` (:mod:`cpdata.worker.targets`). Layout ``thd`` is TE's own partitioning
(docs/recipes.md).
"""

from __future__ import annotations

from typing import Any

from cpdata.nodes.loader import ResumableLoader, build_loader
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan, refuse_keywords

__all__ = ["build"]


def build(
    source: Any,
    *,
    capacity: int,
    cp_size: int,
    cp_rank: int,
    batch_size: int = 1,
    overflow: str = "truncate",
    padding_token_id: int = 0,
    data: DataPolicy = DataPolicy(),
    delivery: Delivery = Delivery(),
    **removed: Any,
) -> ResumableLoader:
    """Loader of flat THD shards ``[batch_size * capacity / cp_size]`` of ``source`` (``{"input_ids": int [n],
    "labels"?: int [n], "loss_mask"?: [n]}`` examples; ``data.labels_alignment`` is needed with labels or a
    mask)."""
    refuse_keywords("sft_thd.build", removed,
                    ("capacity", "cp_size", "cp_rank", "batch_size", "overflow", "padding_token_id", "data", "delivery"))
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="thd", batch_size=batch_size,
        qkv_format="thd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow),
        data=data, delivery=delivery,
    )  # fmt: skip
