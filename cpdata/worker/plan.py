"""Records passed between the worker stages: documents, pieces and pack plans.

A *document* is one source item: 1-D ``input_ids`` plus optional per-token arrays of the same length.
The packer cuts documents into *pieces* and lays a pack's pieces out as *slots*: slot ``i`` holds piece
``i`` then ``slot_lens[i] - len(piece)`` pads (the layout's alignment); the pack's tail
``capacity - sum(slot_lens)`` is padding too."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cpdata.worker.keys import INPUT_IDS
from cpdata.worker.targets import piece_arrays
from cpdata.worker.token_buffer import TokenBuffer

__all__ = ["DocPiece", "Document", "PackPlan", "PieceColumns"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Document:
    """One validated source document."""

    index: int
    """Position of the document in the full source, before DP sharding."""
    arrays: Mapping[str, np.ndarray]
    """``"input_ids"`` (int64 ``[n]``) and any other per-token arrays, each ``[n]``."""

    @property
    def length(self) -> int:
        return int(self.arrays[INPUT_IDS].shape[0])


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
    """Target of the piece's last token: the next document token when the document continues in
    another piece, else -100."""
    length: int = field(init=False, compare=False)
    """Tokens in the piece, read once at construction."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", int(self.arrays[INPUT_IDS].shape[0]))


class PieceColumns(Sequence[DocPiece]):
    """The pieces of one pack as columns: a read-only sequence of :class:`DocPiece` made on access.

    Args:
        table: int64 ``[n, 4]``: every piece's ``(index, start, length, next_label)`` (made read-only).
        sources: ``n`` mappings of per-token arrays; piece ``i`` is ``sources[i][key][o : o + length]``
            with ``o = offsets[i]``.
        offsets: int64 ``[n]``.
        buffer: a :class:`~cpdata.worker.token_buffer.TokenBuffer` holding every piece's tokens (the packing
            window's; left out of pickles), piece ``i`` at ``buffer.ids[at[i]:]``; or None.
        at: int64 ``[n]`` with ``buffer``.
    """

    __slots__ = ("table", "sources", "offsets", "buffer", "at")

    def __init__(
        self,
        table: np.ndarray,
        sources: Sequence[Mapping[str, np.ndarray]],
        offsets: np.ndarray,
        buffer: TokenBuffer | None = None,
        at: np.ndarray | None = None,
    ) -> None:
        table.flags.writeable = offsets.flags.writeable = False
        self.table, self.sources, self.offsets = table, tuple(sources), offsets
        self.buffer, self.at = (buffer, at) if at is not None else (None, None)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (PieceColumns, (self.table, self.sources, self.offsets))

    @classmethod
    def of(cls, pieces: Sequence[DocPiece]) -> PieceColumns:
        """Columns of ``pieces`` (a :class:`PieceColumns` is returned as is)."""
        if isinstance(pieces, PieceColumns):
            return pieces
        n = len(pieces)
        flat = itertools.chain.from_iterable((p.index, p.start, p.length, p.next_label) for p in pieces)
        table = np.fromiter(flat, dtype=np.int64, count=4 * n).reshape(n, 4)
        sources = [{k: np.asarray(a).reshape(-1) for k, a in p.arrays.items()} for p in pieces]
        return cls(table, sources, np.zeros(n, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        index, start, length, next_label = self.table[i].tolist()
        arrays = piece_arrays(self.sources[i], int(self.offsets[i]), length, True)  # labels as given
        return DocPiece(index=index, start=start, arrays=arrays, next_label=next_label)

    def __eq__(self, other: object) -> bool:
        """Equal columns and, piece by piece, equal arrays (keys, dtypes, values)."""
        if not isinstance(other, PieceColumns):
            return NotImplemented
        if not np.array_equal(self.table, other.table):
            return False
        for a, b in zip(self, other, strict=True):
            if a.arrays.keys() != b.arrays.keys():
                return False
            for k, x in a.arrays.items():
                y = b.arrays[k]
                if x.dtype != y.dtype or not np.array_equal(x, y):
                    return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PieceColumns({len(self)} pieces)"


@dataclass(frozen=True, kw_only=True, slots=True)
class PackPlan:
    """The documents of one pack and where they sit; downstream stages are pure functions of it."""

    pieces: Sequence[DocPiece]
    """Pieces in slot order: a tuple of :class:`DocPiece`, or :class:`PieceColumns` (packers)."""
    slot_lens: np.ndarray
    """int64 ``[n_slots]``: piece length rounded up to the layout's document multiple."""
    capacity: int
    """Tokens in the pack (``pack_len``), a multiple of the layout's pack multiple."""
    index: int = 0
    """The pack's id (a schedule's ``(step * dp_size + dp_rank) * micro_batches + micro_batch``, a
    precomputed plan's row, the live packer's sequence number); ``batch.info["pack_indices"]``."""
    extras: Mapping[str, object] = field(default_factory=dict)
    """Free-form metadata (e.g. packer stats); never tensors of the batch."""
    owners: np.ndarray | None = None
    """int64 ``[n_slots, 2]``: under a ``world`` layout dealt by steps (``StreamPlan(world_step=G)``), each slot's
    first rank and ranks (negative: counted down, :func:`cpdata.layout.world_owners.owner_ranks`), as the packer
    dealt them (:func:`cpdata.layout.world_owners.owned_runs`); None: the layout deals the pack from its slot
    lengths."""
    piece_columns: PieceColumns = field(init=False, repr=False, compare=False)
    """The pieces as columns."""
    columns: np.ndarray = field(init=False, repr=False, compare=False)
    """int64 ``[n_slots, 4]``: every piece's ``(index, start, length, next_label)`` (read-only)."""
    seq_lens: np.ndarray = field(init=False, repr=False, compare=False)
    """int64 ``[n_slots]`` real tokens per slot (``columns[:, 2]``)."""

    def __post_init__(self) -> None:
        cols = PieceColumns.of(self.pieces)
        object.__setattr__(self, "piece_columns", cols)
        object.__setattr__(self, "columns", cols.table)
        object.__setattr__(self, "seq_lens", cols.table[:, 2])

    @property
    def real_tokens(self) -> int:
        return int(self.seq_lens.sum())
