"""``LivePieces``: the pieces a packer has placed and not yet emitted, as one int64 table.

One row per piece (:data:`FIELDS`) and, beside the table, the per-token arrays the piece is cut from
(``source[key][offset : offset + length]``). ``at`` is the piece's index in the token buffer of the
window being packed (:mod:`cpdata.worker.token_buffer`), -1 for a piece not in it. Keys grow with
arrival, so a pack's pieces are one ``searchsorted`` away and a window adds its pieces with one
``concatenate``: no object per piece. Also here: a window's rows (:func:`window_rows`), its buffer
(:func:`window_buffer`) and the carried pieces as the ``Pack`` state stores them (:func:`carry_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from cpdata.nodes.window import DocumentWindow
from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.worker.targets import UNLABELED, piece_arrays
from cpdata.worker.token_buffer import BufferPool, TokenBuffer, concatenate_arrays, concatenate_spaced

__all__ = ["CARRY_COLUMNS", "FIELDS", "LivePieces", "carried_room", "carry_arrays", "carry_state", "pick",
           "piece_sources", "window_buffer", "window_rows"]  # fmt: skip

FIELDS: tuple[str, ...] = ("key", "index", "start", "length", "next_label", "slot", "offset", "at")

Source = Mapping[str, np.ndarray]


def pick(items: Sequence[Any], at: list[int]) -> tuple[Any, ...]:
    """``items[i]`` for every ``i`` of ``at``, as a tuple (one C call instead of a Python loop)."""
    if len(at) > 1:
        return itemgetter(*at)(items)  # type: ignore[no-any-return]
    return tuple(items[i] for i in at)


class LivePieces:
    """Placed, not yet emitted pieces: ``table`` int64 ``[p, 8]`` (:data:`FIELDS`) and ``sources`` ``[p]``."""

    __slots__ = ("table", "sources", "_alive")

    def __init__(self) -> None:
        self.table = np.zeros((0, len(FIELDS)), dtype=np.int64)
        self.sources: Sequence[Source] = ()
        self._alive = np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return int(self._alive.sum())

    def live(self) -> tuple[np.ndarray, Sequence[Source]]:
        """The rows not yet taken, in key order: ``([c, 8], sources)``; never written again (a snapshot keeps it)."""
        if not self._alive.all():
            keep = np.flatnonzero(self._alive)
            self.table = self.table[keep]
            self.sources = pick(self.sources, keep.tolist())
            self._alive = np.ones(keep.size, dtype=bool)
        return self.table, self.sources

    def add(self, rows: np.ndarray, sources: Sequence[Source]) -> None:
        """Append a window's pieces (``rows`` int64 ``[p, 8]``, keys above every key held); the pieces held
        before leave the token buffer (``at`` = -1)."""
        table, held = self.live()
        self.table = np.concatenate([table, rows]) if table.size else rows
        self.table[: table.shape[0], 7] = -1
        self.sources = (*held, *sources)
        self._alive = np.ones(self.table.shape[0], dtype=bool)

    def take(self, keys: np.ndarray) -> tuple[np.ndarray, tuple[Source, ...]]:
        """Remove the pieces of ``keys`` (int64 ``[k]``): their rows ``[k, 8]`` and sources, in ``keys``' order."""
        pos = np.searchsorted(self.table[:, 0], keys)
        if keys.size and (pos.max() >= self.table.shape[0] or not np.array_equal(self.table[pos, 0], keys)
                          or not self._alive[pos].all()):  # fmt: skip
            raise KeyError(f"pieces {keys.tolist()[:8]} are not all held")
        self._alive[pos] = False
        return self.table[pos], pick(self.sources, pos.tolist())


# ----------------------------------------------------------------------------- windows and state

_I32 = np.iinfo(np.int32)
CARRY_COLUMNS = ("key", "index", "start", "length", "next_label", "slot")


def carry_arrays(pieces: Sequence[dict[str, np.ndarray]]) -> dict[str, Any]:
    """The token arrays of ``p`` carried pieces as a few columns (for a state): per array name and dtype
    (``G`` groups) the arrays concatenated in piece order, int32 when int64 values fit, as bytes (any dtype
    fits a tensor); ``mask`` bool ``[p, G]`` says which pieces hold which group."""
    groups: dict[tuple[str, str], list[int]] = {}
    for j, arrays in enumerate(pieces):
        for name, a in arrays.items():
            groups.setdefault((name, a.dtype.str), []).append(j)
    mask = np.zeros((len(pieces), len(groups)), dtype=bool)
    names, dtypes, stored, data = [], [], [], []
    for g, ((name, dtype), members) in enumerate(groups.items()):
        mask[members, g] = True
        values = np.concatenate([pieces[j][name] for j in members]) if members else np.zeros(0, dtype=dtype)
        if values.dtype == np.int64 and values.size and _I32.min <= values.min() and values.max() <= _I32.max:
            values = values.astype(np.int32)
        names.append(name)
        dtypes.append(dtype)
        stored.append(values.dtype.str)
        data.append(np.ascontiguousarray(values).view(np.uint8))
    return {"names": names, "dtypes": dtypes, "stored": stored, "data": data, "mask": mask}


def piece_sources(arrays: Any, lengths: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """The carried pieces' own token arrays, from a state's ``arrays``: :func:`carry_arrays`'s columns
    (tensors or numpy arrays), or the per-piece ``(arrays, widen)`` pairs of earlier states."""
    if isinstance(arrays, list):  # earlier states: one (narrowed arrays, names to widen) pair per piece
        return [{n: np.asarray(a).astype(np.int64) if n in widen else np.array(a) for n, a in narrow.items()}
                for narrow, widen in arrays]  # fmt: skip
    mask = np.asarray(arrays["mask"])
    out: list[dict[str, np.ndarray]] = [{} for _ in lengths]
    lengths_a = np.asarray(lengths, dtype=np.int64)
    for g, (name, dtype, stored) in enumerate(zip(arrays["names"], arrays["dtypes"], arrays["stored"], strict=True)):
        values = np.asarray(arrays["data"][g]).astype(np.uint8, copy=False).view(np.dtype(stored))  # (bytes)
        members = np.flatnonzero(mask[:, g])
        ends = lengths_a[members].cumsum().tolist()
        if ends and ends[-1] != values.shape[0]:
            raise ValueError(f"the carried arrays {name!r} hold {values.shape[0]} values, the pieces {ends[-1]}; "
                             "the state is damaged: restore from another checkpoint")  # fmt: skip
        for j, lo, hi in zip(members.tolist(), [0, *ends[:-1]], ends, strict=True):
            out[j][name] = values[lo:hi].astype(np.dtype(dtype))
    return out


def carry_state(carried: tuple[np.ndarray, Sequence[Source]], with_arrays: bool) -> dict[str, Any]:
    """Carried pieces as int64 columns, plus their token arrays unless the source can fetch them."""
    rows, sources = carried
    state: dict[str, Any] = {name: rows[:, i].copy() for i, name in enumerate(CARRY_COLUMNS)}
    arrays = None
    if with_arrays:
        cuts = zip(sources, rows[:, 6].tolist(), (rows[:, 6] + rows[:, 3]).tolist(), strict=True)
        arrays = carry_arrays([{k: a[lo:hi] for k, a in src.items()} for src, lo, hi in cuts])
    state["arrays"] = arrays
    return state


def window_buffer(window: DocumentWindow, rows: np.ndarray, sources: Sequence[Source], pool: BufferPool) -> TokenBuffer:
    """The token buffer of a window: its documents, each followed by -100, then the finished packs' pieces
    not in it (``at`` < 0), each followed by its ``next_label``; their ``at`` in ``rows`` is set to match.

    Over ``window.ids`` (the reader's concatenation) the pieces go to the room reserved after the documents,
    or, if they do not fit, stay out; else everything is concatenated into an array of ``pool``. Cost: one
    copy of the tokens of the pieces emitted now.
    """
    out = np.flatnonzero(rows[:, 7] < 0)
    lengths, ends = rows[out, 3], rows[out, 4]
    docs = int(window.lengths.sum()) + len(window)  # the documents' elements
    used = docs + int(lengths.sum()) + out.shape[0]
    ids = window.ids
    if ids is not None and used + 2 > ids.shape[0]:
        out, lengths, ends, used = out[:0], lengths[:0], ends[:0], docs
    cut = pick(sources, out.tolist())
    offsets = rows[out, 6]
    starts, stops = offsets.tolist(), (offsets + lengths).tolist()
    plain = ids is not None and max(map(len, cut), default=1) == 1 and window.ids_alone()
    items = [] if plain else [{k: a[o:e] for k, a in src.items()} for src, o, e in zip(cut, starts, stops, strict=True)]
    if ids is not None:
        ids = ids[: used + 2]
        piece_ids = [src[INPUT_IDS][o:e] for src, o, e in zip(cut, starts, stops, strict=True)]
        concatenate_spaced(piece_ids, ids[docs:used])  # each piece's ids, then one element
    at = lengths.cumsum()
    at += np.arange(docs, docs + lengths.shape[0], dtype=np.int64)
    at -= lengths
    rows[out, 7] = at
    return concatenate_arrays(
        () if plain else [*window.arrays, *items], np.concatenate([window.lengths, lengths]),
        np.concatenate([np.full(len(window), IGNORE_INDEX, dtype=np.int64), ends]), ids, pool,
    )  # fmt: skip


def carried_room(rows: np.ndarray) -> int:
    """Elements the carried pieces (rows ``[c, 8]``) take in a token buffer."""
    return int(rows[:, 3].sum()) + rows.shape[0]


def window_rows(arrays: list, lengths: np.ndarray, indices: np.ndarray, firsts: np.ndarray, pieces: Any,
                 keys: np.ndarray) -> tuple[np.ndarray, list]:  # fmt: skip
    """A window's pieces as :class:`LivePieces` rows ``[p, 8]`` and sources (``arrays[d]``: document ``d``'s).

    A piece refers to its document's arrays at ``offset = start`` and to the window's token buffer at
    ``at``; a piece cut short is not in the buffer (``at`` = -1: the next element is not its target), and
    with labels gets arrays of its own (:func:`cpdata.worker.targets.piece_arrays`, offset 0).
    """
    doc, start, length, continues = pieces.doc, pieces.start, pieces.length, pieces.continues
    end = start + length
    base = lengths.cumsum()
    base -= lengths
    base += np.arange(lengths.shape[0], dtype=np.int64)  # one element after each document
    rows = np.empty((doc.size, len(FIELDS)), dtype=np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = keys, indices[doc], start, length
    rows[:, 4], rows[:, 5], rows[:, 6], rows[:, 7] = IGNORE_INDEX, pieces.slot, start, base[doc] + start
    for j in np.flatnonzero(continues).tolist():
        rows[j, 4] = arrays[doc[j]][INPUT_IDS][end[j]]
    sources = list(pick(arrays, doc.tolist()))
    cut = ~continues & (end < lengths[doc]) & (length > 0)  # its last target is -100, not the buffer's next id
    rows[cut, 7] = -1
    cut &= firsts[doc] != UNLABELED
    for j in np.flatnonzero(cut).tolist():
        sources[j] = piece_arrays(sources[j], int(start[j]), int(length[j]), False)
        rows[j, 6] = 0
    return rows, sources
