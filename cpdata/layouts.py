"""CP layouts: which global token positions each context-parallel rank owns.

Every layout is one integer map. ``rank_indices(...)[r]`` holds the global
positions (``0 .. pack_len-1``) of rank ``r``'s tokens in rank ``r``'s local
order, so ``local = global[rows[r]]``; the rows together are a permutation of
``range(pack_len)`` and all have ``pack_len // cp_size`` entries. The inverse
(``inverse_indices``) turns the rank-major concatenation of all shards back into
global order: ``global = concat(shards)[inverse]``.

| layout        | rank r owns                                        | doc / pack multiple |
|---------------|----------------------------------------------------|---------------------|
| ``identity``  | everything (cp = 1)                                | 1 / 1               |
| ``contiguous``| ``[r*L, (r+1)*L)``                                 | 1 / cp              |
| ``round_robin``| chunks r and 2cp-1-r of the whole pack (torch ``context_parallel``) | 1 / 2cp |
| ``thd``       | chunks r and 2cp-1-r of every document slot (TE THD) | 2cp / 2cp         |
| ``balanced``  | per-document head-tail, remainder from the middle dealt round-robin | 1 / cp |

``seq_lens`` are the document slots laid out in the pack, in order; the pack's
tail (``pack_len - sum(seq_lens)``) is padding. For ``thd`` the last slot
absorbs that tail, as Transformer Engine requires (tokens past
``cu_seqlens_padded[-1]`` break its partition).

All functions are pure, vectorized numpy and picklable: they run on dataloader
workers. Cost: O(pack_len) time and memory, a few ms at 128K tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "LAYOUTS",
    "alignment",
    "causal_work",
    "check_layout",
    "inverse_indices",
    "rank_indices",
    "thd_slot_lens",
]

LAYOUTS: tuple[str, ...] = ("balanced", "contiguous", "identity", "round_robin", "thd")


def check_layout(layout: str, cp_size: int) -> None:
    """Validate a layout name and CP size; raise ``ValueError`` naming the fix."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {list(LAYOUTS)}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)):
        raise TypeError(f"cp_size must be an int, got {type(cp_size).__name__} {cp_size!r}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got cp_size={cp_size}; use cp_size=1 to turn context parallelism off")
    if layout == "identity" and cp_size != 1:
        raise ValueError(
            f"layout 'identity' gives every token to one rank and needs cp_size=1, got cp_size={cp_size}; "
            "pick 'contiguous', 'round_robin', 'thd' or 'balanced' for cp_size > 1"
        )


def alignment(layout: str, cp_size: int) -> tuple[int, int]:
    """``(doc_multiple, pack_multiple)`` the packer must honour for ``layout``.

    Each document slot is padded to a multiple of ``doc_multiple``; the pack
    length must be a multiple of ``pack_multiple``.
    """
    check_layout(layout, cp_size)
    if layout == "thd":
        return 2 * cp_size, 2 * cp_size
    if layout == "round_robin":
        return 1, 2 * cp_size
    if layout in ("contiguous", "balanced"):
        return 1, cp_size
    return 1, 1


def _as_lengths(seq_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if isinstance(pack_len, bool) or not isinstance(pack_len, (int, np.integer)) or pack_len < 0:
        raise ValueError(f"pack_len must be a non-negative int, got {pack_len!r}")
    if lens.size and lens.min() < 0:
        bad = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"seq_lens must be >= 0, got seq_lens[{bad}]={int(lens[bad])}")
    total = int(lens.sum())
    if total > pack_len:
        raise ValueError(
            f"seq_lens sum to {total} tokens, more than pack_len={pack_len}; "
            "raise the capacity or pack fewer documents"
        )
    return lens


def _segments(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every (s, n) pair, vectorized."""
    sizes = sizes.astype(np.int64, copy=False)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = sizes > 0
    starts, sizes = starts[keep], sizes[keep]
    offsets = np.cumsum(sizes) - sizes
    return np.repeat(starts - offsets, sizes) + np.arange(total, dtype=np.int64)


def thd_slot_lens(seq_lens: Sequence[int] | np.ndarray, pack_len: int) -> np.ndarray:
    """Slot lengths as TE sees them: the last slot absorbs the pack's tail padding.

    With no slots, the whole pack is one (padding) slot.
    """
    lens = _as_lengths(seq_lens, pack_len).copy()
    if lens.size == 0:
        return np.array([pack_len], dtype=np.int64) if pack_len else lens
    lens[-1] += pack_len - int(lens.sum())
    return lens


def _head_tail_rows(starts: np.ndarray, chunk_sizes: np.ndarray, cp_size: int) -> list[np.ndarray]:
    """Rows of a per-segment head-tail split.

    ``chunk_sizes`` is ``[n_segments, 2*cp]``; segment ``s`` chunk ``j`` starts at
    ``starts[s] + sum(chunk_sizes[s, :j])``. Rank ``r`` takes chunks ``r`` and
    ``2cp-1-r`` of every segment, segment-major (TE's order).
    """
    chunk_starts = starts[:, None] + np.cumsum(chunk_sizes, axis=1) - chunk_sizes
    rows = []
    for r in range(cp_size):
        pick = [r, 2 * cp_size - 1 - r]
        rows.append(_segments(chunk_starts[:, pick].reshape(-1), chunk_sizes[:, pick].reshape(-1)))
    return rows


def _thd_rows(lens: np.ndarray, pack_len: int, cp_size: int) -> np.ndarray:
    slots = thd_slot_lens(lens, pack_len)
    bad = np.flatnonzero(slots % (2 * cp_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"layout 'thd' needs every document slot to be a multiple of 2*cp_size={2 * cp_size}; "
            f"slot {i} has {int(slots[i])} tokens (slots after tail absorption: {slots.tolist()[:16]}). "
            "Pad each document to that multiple (the packer does this for layout='thd')"
        )
    starts = np.cumsum(slots) - slots
    chunk = np.repeat((slots // (2 * cp_size))[:, None], 2 * cp_size, axis=1)
    return np.stack(_head_tail_rows(starts, chunk, cp_size))


def _balanced_rows(lens: np.ndarray, pack_len: int, cp_size: int) -> np.ndarray:
    """Per-document head-tail with the remainder in the middle, dealt round-robin; no document padding.

    A document of length n = 2cp*q + m is laid out as cp head chunks of q
    tokens, then its m leftover tokens (the middle), then cp tail chunks of q
    tokens. Rank r owns head chunk r and tail chunk 2cp-1-r (head-tail: equal
    causal work for every rank, whatever m) plus the middle tokens dealt to it
    by a round-robin pointer that continues across documents. Middle tokens sit
    at about position n/2, so whichever rank gets one pays about the average
    cost (putting the leftovers at a chunk edge instead biases work toward the
    ranks that own late chunks: 1.5-7 % imbalance on 90-token documents at cp 8,
    against ~1 % here). Counts end within one token of each other; the tail
    padding continues the pointer, so every rank ends with pack_len / cp tokens.
    Segments per rank per document: head, up to two middle tokens, tail.
    """
    two = 2 * cp_size
    base = lens // two
    rem = lens - base * two
    ptr = (np.cumsum(rem) - rem) % cp_size  # round-robin pointer at each document
    doc_start = np.cumsum(lens) - lens
    middle = doc_start + cp_size * base

    pad = pack_len - int(lens.sum())
    pad_rank = (int(rem.sum()) + np.arange(pad)) % cp_size
    pad_pos = np.arange(pack_len - pad, pack_len, dtype=np.int64)
    out = []
    for r in range(cp_size):
        k1 = (r - ptr) % cp_size  # this rank's first middle token (if k1 < rem), second at k1 + cp
        starts = np.stack(
            [doc_start + r * base, middle + k1, middle + k1 + cp_size, middle + rem + (cp_size - 1 - r) * base],
            axis=1,
        )
        sizes = np.stack([base, k1 < rem, k1 + cp_size < rem, base], axis=1).astype(np.int64)
        own = _segments(starts.reshape(-1), sizes.reshape(-1))
        out.append(np.concatenate([own, pad_pos[pad_rank == r]]))
    lengths = {len(o) for o in out}
    assert len(lengths) == 1, f"balanced layout dealt unequal shards {sorted(lengths)}"
    return np.stack(out)


def rank_indices(
    layout: str, cp_size: int, seq_lens: Sequence[int] | np.ndarray, pack_len: int
) -> np.ndarray:
    """Global positions owned by every CP rank, in each rank's local order.

    Args:
        layout: one of :data:`LAYOUTS`.
        cp_size: number of CP ranks (>= 1).
        seq_lens: document slot lengths laid out in the pack, in order
            (``sum <= pack_len``; the rest is tail padding).
        pack_len: tokens in the pack, a multiple of ``alignment(layout, cp)[1]``.

    Returns:
        int64 ``[cp_size, pack_len // cp_size]``; the rows form a permutation of
        ``range(pack_len)``.

    Example (``thd``, cp=2, slots [8, 4, 8]): rank 0 -> ``[0,1,6,7, 8,11, 12,13,18,19]``.
    """
    _, pack_multiple = alignment(layout, cp_size)
    lens = _as_lengths(seq_lens, pack_len)
    if pack_len % pack_multiple:
        raise ValueError(
            f"layout {layout!r} with cp_size={cp_size} needs pack_len to be a multiple of {pack_multiple}, "
            f"got pack_len={pack_len}; pad the pack to {pack_len + (-pack_len) % pack_multiple}"
        )
    local = pack_len // cp_size
    if layout in ("identity", "contiguous"):
        return np.arange(pack_len, dtype=np.int64).reshape(cp_size, local)
    if layout == "round_robin":
        c = pack_len // (2 * cp_size)
        chunks = np.full((1, 2 * cp_size), c, dtype=np.int64)
        return np.stack(_head_tail_rows(np.zeros(1, dtype=np.int64), chunks, cp_size))
    if layout == "thd":
        return _thd_rows(lens, pack_len, cp_size)
    return _balanced_rows(lens, pack_len, cp_size)


def inverse_indices(rows: np.ndarray) -> np.ndarray:
    """Inverse of a layout: ``concat(shards)[inverse] == global``.

    Args:
        rows: int64 ``[cp_size, local_len]`` from :func:`rank_indices`.

    Returns:
        int64 ``[cp_size * local_len]`` with ``inverse[g]`` = position of global
        token ``g`` in the rank-major concatenation. O(n) scatter, no sort.
    """
    flat = np.asarray(rows, dtype=np.int64).reshape(-1)
    inverse = np.empty_like(flat)
    inverse[flat] = np.arange(flat.size, dtype=np.int64)
    return inverse


def causal_work(rows: np.ndarray, doc_positions: np.ndarray) -> np.ndarray:
    """Causal document-masked attention work per rank.

    A real token at position p of its document attends to p+1 keys; pads cost 0.

    Args:
        rows: ``[cp_size, local_len]`` from :func:`rank_indices`.
        doc_positions: int ``[pack_len]``, each token's position inside its
            document, -1 for padding.

    Returns:
        float64 ``[cp_size]`` work per rank.
    """
    cost = np.where(doc_positions >= 0, doc_positions + 1, 0).astype(np.float64)
    return cost[np.asarray(rows)].sum(axis=1)
