"""Concatenated pretraining packs for torch ``context_parallel`` with causal SDPA.

Documents are concatenated in order and cut at ``capacity`` (``algorithm="concat"``): padding ~0, a cut
document continuing in the next pack with its positions. Layout ``round_robin`` gives rank ``r`` chunks ``r`` and
``2cp-1-r``, torch's head-tail order for ``is_causal`` (causal work max/mean ~1.0 instead of ~(2cp-1)/cp for
contiguous chunks). Causal SDPA attends across documents inside a pack, as concatenated pretraining usually
does; ``document_ids`` and ``cu_seqlens`` are there for a model that masks them.
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
    padding_token_id: int = 0,
    vocab_size: int | None = None,
    prefetch: int = 2,
) -> Loader:
    """Loader of ``[batch_size, capacity / cp_size]`` round-robin shards for one CP rank.

    ``source``: documents ``{"input_ids": int [n]}`` (a sequence, iterable or node); ``capacity`` a multiple of
    ``2 * cp_size``. All CP ranks of a group use the same ``seed``; only the final pack is padded.
    """
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="round_robin", batch_size=batch_size,
        qkv_format="bshd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="concat"),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
