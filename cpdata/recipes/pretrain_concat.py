"""Concatenated pretraining packs for torch ``context_parallel``.

Use for pretraining with ``torch.distributed.tensor.experimental.context_parallel``
and causal SDPA. Documents are concatenated in order and cut at ``capacity``
(``algorithm="concat"``): every pack is full except possibly the last, so
padding is ~0; a document cut at a pack boundary continues in the next pack
with its position ids continuing.

Layout ``round_robin``: rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of the
pack, the order torch's head-tail load balancer expects for ``is_causal``
attention (causal work max/mean ~1.0 instead of ~(2cp-1)/cp for contiguous
chunks). Shards are ``[batch_size, capacity / cp_size]`` BSHD. Causal SDPA
attends across document boundaries inside a pack, as concatenated pretraining
usually does; ``document_ids`` and the ``cu_seqlens`` metadata are there for a
model that masks them.
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

    Args:
        source: documents ``{"input_ids": int [n]}`` (a sequence, iterable or node).
        capacity: tokens per pack, a multiple of ``2 * cp_size``.
        cp_size, cp_rank: the CP group and this rank in it.
        dp_rank, dp_size: the data-parallel shard of ``source`` this group reads.
        seed: packer seed (all CP ranks of a group must use the same).
        batch_size: packs per batch (rows; the layout is the same for every row).
        padding_token_id, vocab_size: pad id (only the final pack is padded);
            ids are checked against ``vocab_size``.
        prefetch: batches prepared ahead in a background thread.
    """
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="round_robin", batch_size=batch_size,
        qkv_format="bshd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="concat"),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
