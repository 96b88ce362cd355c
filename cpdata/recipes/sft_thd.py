"""Supervised fine-tuning packs in THD form for Transformer Engine (``qkv_format="thd"``, ``padding_causal``).

Each example is one document; its ``labels`` or loss mask (``loss_mask``, ``assistant_masks``,
``completion_mask``) become next-token targets under ``labels_alignment`` (:mod:`cpdata.worker.targets`).
Examples longer than ``capacity`` are truncated: split across packs, an example would lose its prompt.
Best-fit-decreasing packing; layout ``thd`` pads every document to a multiple of ``2 * cp_size`` (at most
``2 * cp_size - 1`` tokens each) and gives rank ``r`` chunks ``r`` and ``2cp-1-r`` of each, exactly TE's
``thd_get_partitioned_indices``; ``cu_seqlens`` / ``cu_seqlens_padded`` are global, as TE expects.
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
    batch_size: int = 1,
    overflow: str = "truncate",
    padding_token_id: int = 0,
    vocab_size: int | None = None,
    prefetch: int = 2,
    labels_alignment: str | None = None,
) -> Loader:
    """Loader of flat THD shards ``[batch_size * capacity / cp_size]`` for one CP rank.

    ``source``: examples ``{"input_ids": int [n], "labels"?: int [n], "loss_mask"?: [n]}``; ``capacity`` a
    multiple of ``2 * cp_size``; ``labels_alignment`` (``"inputs"`` or ``"targets"``) is required when examples
    carry labels or a mask. All CP ranks of a group use the same ``seed``.
    """
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="thd", batch_size=batch_size,
        qkv_format="thd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size,
                        labels_alignment=labels_alignment),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
