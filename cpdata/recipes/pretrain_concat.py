"""Concatenated pretraining packs (padding ~0) in ``round_robin`` layout for torch ``context_parallel``.

Causal SDPA attends across documents inside a pack; the trade-offs are in docs/recipes.md.
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
    padding_token_id: int = 0,
    data: DataPolicy = DataPolicy(),
    delivery: Delivery = Delivery(),
    **removed: Any,
) -> ResumableLoader:
    """Loader of ``[batch_size, capacity / cp_size]`` round-robin shards of ``source`` (``{"input_ids": int
    [n]}`` documents) for one CP rank; every CP rank of a group passes the same ``data``."""
    refuse_keywords("pretrain_concat.build", removed,
                    ("capacity", "cp_size", "cp_rank", "batch_size", "padding_token_id", "data", "delivery"))
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="round_robin", batch_size=batch_size,
        qkv_format="bshd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="concat"), data=data,
        delivery=delivery,
    )  # fmt: skip
