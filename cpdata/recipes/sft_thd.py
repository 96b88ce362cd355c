"""Supervised fine-tuning packs in THD form for Transformer Engine.

Use with TE's ``DotProductAttention(qkv_format="thd", attn_mask_type="padding_causal")``
under context parallelism. Each example is one document; its own ``labels``
(e.g. -100 on the prompt) or loss mask (``loss_mask``, ``assistant_masks``,
``completion_mask``) become next-token targets under ``labels_alignment``
(``"inputs"`` for Hugging Face / TRL rows, ``"targets"`` for Megatron / NeMo
rows; see :mod:`cpdata.worker.targets`); pads get -100 and 0. Examples longer than ``capacity`` are truncated
(``overflow="truncate"``): an SFT example split across packs would lose its
prompt.

Packing: best-fit-decreasing. Layout ``thd``: every document slot is padded to
a multiple of ``2 * cp_size`` and rank ``r`` holds chunks ``r`` and
``2cp-1-r`` of every document, exactly TE's ``thd_get_partitioned_indices``.
Shards are flat ``[batch_size * capacity / cp_size]`` streams; the metadata
``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (slot offsets, the last
slot absorbing the stream's tail) are global, as TE expects, and
``max_seqlen`` is the longest real document. The per-document padding costs
at most ``2 * cp_size - 1`` tokens per example.
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

    Args:
        source: examples ``{"input_ids": int [n], "labels"?: int [n], "loss_mask"?: [n]}``.
        capacity: tokens per pack, a multiple of ``2 * cp_size``.
        cp_size, cp_rank: the CP group and this rank in it.
        dp_rank, dp_size: the data-parallel shard of ``source`` this group reads.
        seed: packer seed (all CP ranks of a group must use the same).
        batch_size: packs concatenated into one stream.
        overflow: ``"truncate"``, ``"drop"`` or ``"error"`` for over-long examples.
        padding_token_id, vocab_size: pad id; ids are checked against ``vocab_size``.
        prefetch: batches prepared ahead in a background thread.
        labels_alignment: ``"inputs"`` or ``"targets"``, required when examples carry labels or a mask.
    """
    return build_loader(
        source, capacity=capacity, cp_size=cp_size, cp_rank=cp_rank, layout="thd", batch_size=batch_size,
        qkv_format="thd", padding_token_id=padding_token_id, plan=StreamPlan(algorithm="bfd", overflow=overflow),
        data=DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, vocab_size=vocab_size,
                        labels_alignment=labels_alignment),
        delivery=Delivery(prefetch=prefetch),
    )  # fmt: skip
