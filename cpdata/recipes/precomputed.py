"""Serve a plan written by ``cpdata precompute``, with its manifest's capacity, layout and ``cp_size``::

    PrecomputedPacks -> Collate -> ShardForRank -> Prefetcher -> PinMemory (CUDA only) -> Loader
"""

from __future__ import annotations

import os

from torchdata.nodes import BaseNode, Prefetcher

from cpdata.nodes.collate import Collate
from cpdata.nodes.loader import ResumableLoader
from cpdata.nodes.pin import maybe_pin
from cpdata.nodes.shard import ShardForRank
from cpdata.offline.reader import PrecomputedPacks
from cpdata.sources.base import TokenizedDataset
from cpdata.sources.open import open_dataset
from cpdata.worker.targets import LabelsAlignment

__all__ = ["build"]


def build(
    plan_dir: str | os.PathLike[str],
    documents: TokenizedDataset | str | os.PathLike[str],
    *,
    cp_size: int,
    cp_rank: int,
    layout: str | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
    batch_size: int = 1,
    qkv_format: str = "bshd",
    padding_token_id: int = 0,
    prefetch: int = 2,
    pin_memory: bool | None = None,
    labels_alignment: LabelsAlignment | None = None,
) -> ResumableLoader:
    """Loader over a precomputed plan for one CP rank, reading the ``documents`` (or their path) it was computed
    over; ``cp_size``, ``layout`` (None: the plan's) and ``labels_alignment`` must match the plan's."""
    if not isinstance(documents, TokenizedDataset):
        if documents is None:
            raise ValueError(f"a precomputed plan ({plan_dir}) needs the documents it was computed over; "
                             "pass their path (e.g. --documents data.jsonl)")
        documents = open_dataset(documents)
    plans = PrecomputedPacks(plan_dir, documents, cp_size=cp_size, layout=layout, dp_rank=dp_rank, dp_size=dp_size,
                             labels_alignment=labels_alignment)  # fmt: skip
    layout = str(plans.store.config["layout"])
    node: BaseNode = Collate(plans, batch_size=batch_size, qkv_format=qkv_format, padding_token_id=padding_token_id)
    node = ShardForRank(node, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return ResumableLoader(maybe_pin(node, pin_memory=pin_memory))
