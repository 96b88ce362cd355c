"""Balanced packs (best-fit-decreasing, long documents split) for all-gather attention with a document mask.

Feeds flex-attention CP or ``examples/cp_model.py``; why ``balanced`` is in docs/recipes.md.
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
    layout: str = "balanced",
    overflow: str = "split",
    padding_token_id: int = 0,
    vocab_size: int | None = None,
    prefetch: int = 2,
) -> ResumableLoader:
    """Loader of ``[1, capacity / cp_size]`` BSHD shards of ``source`` (``{"input_ids": int [n], ...}``
    documents) for one CP rank; every CP rank of a group passes the same ``seed``."""
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout=layout, batch_size=1, qkv_format="bshd",
        padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
