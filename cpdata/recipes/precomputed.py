"""Serve a plan directory written by ``cpdata precompute``.

Use when packing a large dataset online would cost start-up time or planner
memory on every rank, or when the same packs must be replayed exactly across
jobs. ``cpdata precompute DATASET OUT --capacity ... --cp-size ... --layout ...``
plans the whole dataset once; this pipeline reads that plan with O(1) seek
(resume restores a pack index, not a replay) and fetches each pack's
documents by index:

    PrecomputedPacks -> Collate -> ShardForRank -> Prefetcher -> PinMemory (CUDA only) -> Loader

Capacity, layout and ``cp_size`` come from the plan's manifest; a plan written
for another ``cp_size`` or layout, or for other documents (sha256), is refused.
With data parallelism DP rank ``d`` serves packs ``d, d + dp, ...`` of the one
plan (every rank the same count).
"""

from __future__ import annotations

import os

from torchdata.nodes import BaseNode, Loader, Prefetcher

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
) -> Loader:
    """Loader over a precomputed plan for one CP rank.

    Args:
        plan_dir: the directory ``cpdata precompute`` wrote.
        documents: the tokenized dataset the plan was computed over, or its
            path (``.jsonl`` or a folder of ``.npy``; see
            :func:`cpdata.sources.open.open_dataset`).
        cp_size, cp_rank: must match the plan's ``cp_size``; this rank.
        layout: checked against the plan's layout when given (None: the plan's).
        dp_rank, dp_size: this rank's share of the packs.
        batch_size, qkv_format: packs per batch; ``"bshd"`` rows or a ``"thd"`` stream.
        padding_token_id: ``input_ids`` on pads.
        prefetch: batches prepared ahead in a background thread (0: none).
        pin_memory: pin batches (None: when CUDA is available).
        labels_alignment: the documents' label convention (``"inputs"``: HF/TRL, the model shifts;
            ``"targets"``: Megatron/NeMo next-token targets), needed when they carry labels or masks and must
            equal the one the plan was precomputed with (a mismatch is refused, naming both).
    """
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
