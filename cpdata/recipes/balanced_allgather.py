"""Balanced packs (best-fit-decreasing, long documents split) for all-gather attention with a document mask.

Feeds flex-attention CP or ``examples/cp_model.py``; why ``balanced`` is in docs/recipes.md.
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
    layout: str = "balanced",
    overflow: str = "split",
    padding_token_id: int = 0,
    data: DataPolicy = DataPolicy(),
    delivery: Delivery = Delivery(),
    **removed: Any,
) -> ResumableLoader:
    """Loader of ``[1, capacity / cp_size]`` BSHD shards of ``source`` (``{"input_ids": int [n], ...}``
    documents) for one CP rank; every CP rank of a group passes the same ``data``."""
    refuse_keywords("balanced_allgather.build", removed,
                    ("capacity", "cp_size", "cp_rank", "layout", "overflow", "padding_token_id", "data", "delivery"))
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout, batch_size=1, qkv_format="bshd",
        padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow), data=data,
        delivery=delivery,
    )  # fmt: skip
