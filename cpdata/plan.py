"""Records passed between the worker stages: documents, pieces and pack plans.

A *document* is one item of the user's source: ``{"input_ids": 1-D ints, ...}``
plus optional per-token arrays of the same length (``labels``, ``loss_mask``,
extras). The packer cuts documents into *pieces* (a whole document, or a part of
it when ``overflow="split"``/``"truncate"`` or in ``concat`` mode) and lays the
pieces of one pack out as *slots*: slot ``i`` holds piece ``i`` followed by
``slot_lens[i] - len(piece)`` padding tokens (the layout's per-document
alignment). The pack's tail ``capacity - sum(slot_lens)`` is padding too.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DIGEST_SAMPLES", "DocPiece", "Document", "PackPlan", "plan_digest"]

DIGEST_SAMPLES = 8
"""Token ids per piece that :func:`plan_digest` hashes (evenly spaced, first and last included)."""
_SAMPLE_AT = np.arange(DIGEST_SAMPLES, dtype=np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class Document:
    """One validated source document."""

    index: int
    """Position of the document in the full source, before DP sharding."""
    arrays: Mapping[str, np.ndarray]
    """``"input_ids"`` (int64 ``[n]``) and any other per-token arrays, each ``[n]``."""

    @property
    def length(self) -> int:
        return int(self.arrays["input_ids"].shape[0])


@dataclass(frozen=True, kw_only=True, slots=True)
class DocPiece:
    """A contiguous part of one document placed in one slot of a pack."""

    index: int
    """Source index of the document the piece comes from."""
    start: int
    """Offset of the piece inside its document; position ids continue from it."""
    arrays: Mapping[str, np.ndarray]
    """Per-token arrays sliced to the piece, each ``[n]``."""
    next_label: int = -100
    """Target of the piece's last token: the next document token when the
    document continues in another piece, else -100 (no target across a
    document end)."""
    length: int = field(init=False, compare=False)
    """Tokens in the piece (``len(arrays["input_ids"])``), read once at construction."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", int(self.arrays["input_ids"].shape[0]))


@dataclass(frozen=True, kw_only=True, slots=True)
class PackPlan:
    """The documents of one pack and where they sit.

    Attributes are fixed by the packer; everything downstream (collate, layout,
    shard) is a pure function of the plan.
    """

    pieces: tuple[DocPiece, ...]
    """Pieces in slot order."""
    slot_lens: np.ndarray
    """int64 ``[n_slots]``: piece length rounded up to the layout's document multiple."""
    capacity: int
    """Tokens in the pack (``pack_len``), a multiple of the layout's pack multiple."""
    index: int = 0
    """Sequence number of the pack in this DP rank's stream (0-based)."""
    extras: Mapping[str, object] = field(default_factory=dict)
    """Free-form metadata (e.g. packer stats snapshot); never tensors of the batch."""
    columns: np.ndarray = field(init=False, repr=False, compare=False)
    """int64 ``[n_slots, 4]``: every piece's ``(index, start, length, next_label)``, read once at
    construction (read-only); collate and the digest work on these columns."""
    seq_lens: np.ndarray = field(init=False, repr=False, compare=False)
    """int64 ``[n_slots]`` real tokens per slot (``columns[:, 2]``)."""

    def __post_init__(self) -> None:
        n = len(self.pieces)
        flat = itertools.chain.from_iterable((p.index, p.start, p.length, p.next_label) for p in self.pieces)
        columns = np.fromiter(flat, dtype=np.int64, count=4 * n).reshape(n, 4)
        columns.flags.writeable = False
        object.__setattr__(self, "columns", columns)
        object.__setattr__(self, "seq_lens", columns[:, 2])

    @property
    def real_tokens(self) -> int:
        return int(self.seq_lens.sum())


def plan_digest(plan: PackPlan, layout: str, cp_size: int) -> int:
    """63-bit digest of everything that decides a rank's shard of ``plan``.

    CP ranks of one DP group must compute equal digests; the device-side
    consistency check all-reduces it. Covers layout, cp size, capacity, pack
    index, slot lengths, piece provenance (source index, start, length, next
    label) and the content of every piece, sampled: up to
    :data:`DIGEST_SAMPLES` token ids at evenly spaced positions (first and
    last included). Columnar: the provenance is read into four int64
    columns, the samples of every piece come from one gather over the
    concatenated ids (a memcpy of the pack's ids), and the hash covers
    ``n_pieces * 12`` int64s, instead of hashing every id (1.5 ms at 128K);
    ranks that read other data of the same shape (same lengths, other tokens)
    disagree on the sampled ids, while a change confined to unsampled
    positions goes unseen.
    """
    pieces, lens = plan.pieces, plan.seq_lens
    n = len(pieces)
    meta = np.empty((n, 4 + DIGEST_SAMPLES), dtype=np.int64)
    meta[:, :4] = plan.columns
    meta[:, 4:] = -1
    total = int(lens.sum())
    if total:  # every piece's samples by one gather from the concatenated ids
        ids = np.concatenate([p.arrays["input_ids"] for p in pieces])
        at = (np.cumsum(lens) - lens)[:, None] + (_SAMPLE_AT[None, :] * (lens[:, None] - 1)) // (DIGEST_SAMPLES - 1)
        real = lens > 0
        meta[real, 4:] = ids[at[real]]
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{layout}|{cp_size}|{plan.capacity}|{plan.index}".encode())
    h.update(np.ascontiguousarray(plan.slot_lens, dtype=np.int64).tobytes())
    h.update(meta.tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
