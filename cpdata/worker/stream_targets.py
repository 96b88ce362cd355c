"""The target count of each batch: ``labels != -100`` over every row and every CP rank's part.

``batch.info["n_targets"]`` is what the loss divides by at ``cp_size > 1``; the worker knows it from the
slot table and the token buffer, so the step needs no collective for it. Without labels a slot of
``n`` real tokens holds ``n - 1`` targets plus one if the element after it (its ``next_label``) is not
-100: O(slots). With labels each slot's labels are counted: O(tokens + slots)."""

from __future__ import annotations

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX
from cpdata.worker.stream import StreamBlock
from cpdata.worker.token_buffer import TokenBuffer

__all__ = ["target_counts"]


def target_counts(block: StreamBlock) -> list[int]:
    """``k`` host ints: the targets of each batch of ``block``, batches sharing a buffer counted together."""
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
    """int64 ``[K]``: targets of slots whose ``n`` real tokens start at buffer index ``at``."""
    if buffer.labels is None:
        after = buffer.ids.take(at + n)  # the target of each slot's last token (an empty slot's: unused)
        return np.where(n > 0, n - 1 + (after != IGNORE_INDEX), 0)
    labels, spans = buffer.labels, zip(at.tolist(), n.tolist(), strict=True)
    counts = (np.count_nonzero(labels[a : a + k] != IGNORE_INDEX) for a, k in spans)
    return np.fromiter(counts, dtype=np.int64, count=n.shape[0])
