"""The target count of each batch: ``labels != -100`` over its whole stream, every row and every CP rank's part.

``batch.info["n_targets"]`` is what the loss divides by at ``cp_size > 1``
(:func:`cpdata.adapters.global_target_count` all-reduces the same count over the
CP group); every rank's worker knows it from the slot table and the token
buffer, before any rank's tokens are gathered, so the training step needs no
collective for it.

A slot's real tokens read buffer indices ``[at, at + n)``; pads have no target.
Without labels in the buffer (the usual case) the targets are the next ids,
which are token ids inside the piece and the element after it for its last
token (``next_label``: -100 unless the document continues), so a slot holds
``n - 1`` targets plus one if that element is not -100: one ``take`` of the
slot ends, O(slots). With labels, each slot's labels are counted (one compare
of a contiguous slice per slot, O(tokens + slots)): about the rest of an
unlabelled batch's block math at ~10 slots, several times it at hundreds of
slots (figures: docs/benchmarks.md). One gather of every slot's labels costs
the same at many slots and more at few; a prefix count over the buffer reads
the whole packing window (4-60x the batch's tokens).
"""

from __future__ import annotations

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX
from cpdata.worker.stream import StreamBlock
from cpdata.worker.token_buffer import TokenBuffer

__all__ = ["target_counts"]


def target_counts(block: StreamBlock) -> list[int]:
    """``k`` host ints: the targets of each batch of ``block`` (what ``collate_pack`` gives ``labels != -100``).

    Batches reading one buffer (a packing window's) are counted together.
    """
    slots, streams, starts = block.slots, block.streams, block.src_starts
    real, first, k = slots.table[:, 2], slots.first, len(streams)
    per_slot = np.empty(real.shape[0], dtype=np.int64)
    b = 0
    while b < k:  # a run of batches reading one buffer: one call
        buffer, e = streams[b].buffer, b + 1
        while e < k and streams[e].buffer is buffer:
            e += 1
        lo, hi = first[b], first[e]
        per_slot[lo:hi] = _slot_targets(buffer, starts[lo:hi], real[lo:hi])
        b = e
    below = np.zeros(real.shape[0] + 1, dtype=np.int64)
    per_slot.cumsum(out=below[1:])
    bounds = np.asarray(first, dtype=np.int64)
    return (below[bounds[1:]] - below[bounds[:-1]]).tolist()


def _slot_targets(buffer: TokenBuffer, at: np.ndarray, n: np.ndarray) -> np.ndarray:
    """int64 ``[K]``: targets of slots whose ``n`` real tokens start at buffer index ``at`` (int64 ``[K]``)."""
    if buffer.labels is None:
        after = buffer.ids.take(at + n)  # the target of each slot's last token (an empty slot's: unused)
        return np.where(n > 0, n - 1 + (after != IGNORE_INDEX), 0)
    labels, spans = buffer.labels, zip(at.tolist(), n.tolist(), strict=True)
    counts = (np.count_nonzero(labels[a : a + k] != IGNORE_INDEX) for a, k in spans)
    return np.fromiter(counts, dtype=np.int64, count=n.shape[0])
