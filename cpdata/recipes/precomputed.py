"""Serve a plan written by ``cpdata precompute``, with its manifest's capacity, layout and ``cp_size``::

    PrecomputedPacks -> Collate -> ShardForRank -> Prefetcher -> PinMemory (CUDA only) -> Loader
"""

from __future__ import annotations

import os
from typing import Any

from cpdata.nodes.loader import ResumableLoader, delivered, rank_node, shard_graph
from cpdata.nodes.options import DataPolicy, Delivery, check_records, refuse_keywords
from cpdata.offline.reader import PrecomputedPacks
from cpdata.sources.open import open_dataset

__all__ = ["build"]


def build(
    plan_dir: str | os.PathLike[str],
    documents: Any,
    *,
    cp_size: int,
    cp_rank: int,
    layout: str | None = None,
    batch_size: int = 1,
    qkv_format: str = "bshd",
    padding_token_id: int = 0,
    data: DataPolicy = DataPolicy(),
    delivery: Delivery = Delivery(),
    **removed: Any,
) -> ResumableLoader:
    """Loader over a precomputed plan for one CP rank, reading the ``documents`` it was computed over (a
    source as :class:`~cpdata.PrecomputedPacks` takes it, or a path :func:`~cpdata.open_dataset` opens);
    ``cp_size``, ``layout`` (None: the plan's) and ``data`` as for :class:`~cpdata.PrecomputedPacks`."""
    refuse_keywords("precomputed.build", removed, ("cp_size", "cp_rank", "layout", "batch_size", "qkv_format",
                                                   "padding_token_id", "data", "delivery"))  # fmt: skip
    check_records(data=data, delivery=delivery)
    if documents is None:
        raise ValueError(f"a precomputed plan ({plan_dir}) needs the documents it was computed over; "
                         "pass them or their path (e.g. --documents data.jsonl)")
    if isinstance(documents, (str, os.PathLike)):
        documents = open_dataset(documents)
    plans = PrecomputedPacks(plan_dir, documents, cp_size=cp_size, layout=layout, data=data)
    options = plans.graph_options(batch_size=batch_size, qkv_format=qkv_format, padding_token_id=padding_token_id)
    return ResumableLoader(delivered(rank_node(shard_graph(None, options, packs=plans), options, cp_rank, delivery),
                                     delivery))  # fmt: skip
