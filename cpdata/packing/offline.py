"""``plan_lengths``: pack a whole dataset from its document lengths alone."""

from __future__ import annotations

import numpy as np

from cpdata.packing.pieces import check_lengths
from cpdata.packing.planner import StreamPlanner, window_ends
from cpdata.packing.records import PackingConfig, PackingResult, PackKeys

__all__ = ["plan_lengths"]


def _as_lengths(lengths: object) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 0, got lengths[{bad}]={int(arr[bad])}")
    return arr


def plan_lengths(
    lengths: np.ndarray,
    *,
    capacity: int,
    layout: str,
    cp_size: int,
    algorithm: str = "bfd",
    overflow: str | None = None,
    seed: int = 0,
    window: int | None = None,
    first_target: np.ndarray | None = None,
) -> PackingResult:
    """Plan the packs of a whole dataset from its document lengths, one window at a time as the
    :class:`~cpdata.nodes.pack.Pack` node does: same documents, same packs.

    Args:
        lengths: int ``[n]`` real tokens per document, in stream order.
        capacity, layout, cp_size, algorithm, overflow, window: as
            :meth:`~cpdata.packing.records.PackingConfig.resolve` takes them; ``seed`` is recorded only.
        first_target: int ``[n]`` each document's first trained target, -1 if none (left out, counted
            ``untrained``); ``None``: every document is trained.

    Returns:
        :class:`~cpdata.packing.PackingResult` (``doc_index`` into ``lengths``); O(n) time, O(window) memory.
    """
    config = PackingConfig.resolve(
        capacity=capacity, layout=layout, cp_size=cp_size, algorithm=algorithm,
        overflow=overflow, seed=seed, window=window,
    )
    lengths = _as_lengths(lengths)
    check_lengths(lengths, config)  # every overlong document at once, before planning
    if first_target is not None:
        first_target = np.asarray(first_target, dtype=np.int64)
        if first_target.shape != lengths.shape:
            raise ValueError(f"first_target has shape {first_target.shape}, lengths {lengths.shape}; pass one per document")
    planner = StreamPlanner(config)
    columns: list[tuple[np.ndarray, ...]] = [(np.zeros(0, np.int64),) * 4]
    parts: list[PackKeys] = []
    lo = 0
    for hi in window_ends(lengths, config):
        targets = None if first_target is None else first_target[lo:hi]
        pieces, _, done = planner.add_window(lengths[lo:hi], np.arange(lo, hi, dtype=np.int64), targets)
        columns.append((pieces.doc + lo, pieces.start, pieces.length, pieces.slot))
        parts.append(done)
        lo = hi
    parts.append(planner.finish())

    packs = PackKeys.concat(parts)
    order = packs.keys
    offsets = np.concatenate([[0], np.cumsum(packs.sizes)]).astype(np.int64)
    table = [np.concatenate(c) for c in zip(*columns, strict=True)]
    assert order.shape[0] == table[0].shape[0], "every piece must land in exactly one pack"
    doc_index, doc_start, doc_len, slot_len = (col[order] for col in table)
    for a in (offsets, doc_index, doc_start, doc_len, slot_len):
        a.flags.writeable = False
    planner.account(packs=len(packs), tokens=int(doc_len.sum()), slot_tokens=int(slot_len.sum()))
    return PackingResult(pack_offsets=offsets, doc_index=doc_index, doc_start=doc_start, doc_len=doc_len,
                         slot_len=slot_len, stats=planner.stats(), config=config)
