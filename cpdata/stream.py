"""The stream of a batch: per-slot tables and the concatenated piece arrays every rank gathers from.

A batch is ``B`` pack plans of equal capacity ``S``; its stream is the
row-major concatenation of their slots (``B*S`` positions, each pack's tail
absorbed by its last slot, an empty pack one padding slot of real length 0).
:func:`build_stream` reads the plans' columns (:class:`~cpdata.plan.PieceColumns`)
once: O(slots) tables plus one ``concatenate`` per per-token key (O(real
tokens)). :mod:`cpdata.collate` builds the full pack or one rank's tokens from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from cpdata.keys import IGNORE_INDEX, INPUT_IDS, LABELS, LOSS_MASK
from cpdata.layouts import thd_slot_lens
from cpdata.plan import PackPlan

__all__ = ["SlotTables", "Stream", "build_stream", "slot_tables", "stream_metadata", "stream_slot_lens"]

_PAD_SLOT = np.array([[-1, 0, 0, IGNORE_INDEX]], dtype=np.int64)  # plan columns of an empty pack's one pad slot
_ZERO_SLOT = np.zeros(1, dtype=np.int64)  # its raw slot length (the tail makes it the whole pack)


@dataclass(frozen=True, slots=True)
class SlotTables:
    """The slots of a batch's stream (``K`` slots, an empty pack one padding slot): no tokens.

    Attributes:
        capacity: tokens per plan ``S``.
        table: int64 ``[K, 4]``: each slot's piece ``(index, start, length, next_label)``.
        slot_lens: int64 ``[K]``: slot lengths, every pack's tail absorbed by its last slot.
        layout_lens: int64 ``[K']``: :func:`stream_slot_lens` (the last pack's tail not absorbed).
        counts: ``B`` ints: pieces per plan.
    """

    capacity: int
    table: np.ndarray
    slot_lens: np.ndarray
    layout_lens: np.ndarray
    counts: list[int]

    def metadata(self) -> dict[str, np.ndarray]:
        """The stream metadata of these slots (:func:`stream_metadata`)."""
        return stream_metadata(self.table[:, 2], self.slot_lens)


def slot_tables(plans: Sequence[PackPlan]) -> SlotTables:
    """The plans' slot tables, checked: a few numpy calls per batch, whatever the number of slots.

    Raises:
        TypeError, ValueError: a single plan instead of a sequence, no plan, plans of other capacities,
            ``slot_lens`` not one per piece, a piece longer than its slot, negative slot lengths or slots
            summing past the capacity (the errors of :func:`cpdata.layouts.thd_slot_lens`).
    """
    if isinstance(plans, PackPlan):
        raise TypeError("collate takes a sequence of PackPlan (one per row), got a single PackPlan; wrap it: [plan]")
    if len(plans) == 0:
        raise ValueError("collate needs at least one PackPlan, got an empty sequence")
    capacity = plans[0].capacity
    tables, slots, counts = [], [], []
    for b, plan in enumerate(plans):
        if plan.capacity != capacity:
            raise ValueError(
                f"all plans of a batch need the same capacity; plan {b} has {plan.capacity}, plan 0 has {capacity}"
            )
        table, slot_lens = plan.columns, plan.slot_lens
        if type(slot_lens) is not np.ndarray or slot_lens.dtype != np.int64:
            slot_lens = np.asarray(slot_lens)
        if slot_lens.shape != (table.shape[0],):
            raise ValueError(
                f"plan {plan.index}: slot_lens has shape {slot_lens.shape}, expected ({table.shape[0]},) "
                "(one slot per piece)"
            )
        counts.append(table.shape[0])
        tables.append(table if table.shape[0] else _PAD_SLOT)  # empty pack: one pad slot
        slots.append(slot_lens if table.shape[0] else _ZERO_SLOT)
    table = tables[0] if len(tables) == 1 else np.concatenate(tables)
    raw = (slots[0] if len(slots) == 1 else np.concatenate(slots)).astype(np.int64, copy=False)
    short = raw < table[:, 2]
    if short.any():
        b, i = _plan_piece(counts, int(np.flatnonzero(short)[0]))
        raise ValueError(
            f"plan {plans[b].index}: piece {i} has {int(table[:, 2][short][0])} tokens but its slot only "
            f"{int(raw[short][0])}; slot_lens must be >= the piece lengths"
        )
    cum = raw.cumsum()
    slot_lens = raw.copy()
    if len(counts) == 1:  # one pack: its last slot absorbs the tail
        tail = capacity - int(cum[-1])
        slot_lens[-1] += tail
        bad = tail < 0
    else:
        last = np.fromiter(accumulate(max(c, 1) for c in counts), dtype=np.int64, count=len(counts)) - 1
        ends = cum[last]
        tails = capacity - ends  # each pack's tail padding
        tails[1:] += ends[:-1]
        slot_lens[last] += tails
        bad = bool(tails.min() < 0)
    if bad:  # (a negative slot is shorter than its piece: refused above)
        for plan in plans:
            thd_slot_lens(plan.slot_lens, capacity)  # its error for the first bad plan
    if not counts[-1]:
        layout_lens = slot_lens[:-1].copy()
    elif len(counts) == 1:
        layout_lens = raw.copy()
    else:
        layout_lens = slot_lens.copy()
        layout_lens[-1] = raw[-1]
    return SlotTables(capacity, table, slot_lens, layout_lens, counts)


def _plan_piece(counts: list[int], k: int) -> tuple[int, int]:
    """``(plan, piece)`` of stream slot ``k`` (plans of ``counts`` pieces, an empty one holding one slot)."""
    for b, c in enumerate(counts):
        if k < max(c, 1):
            return b, k
        k -= max(c, 1)
    raise IndexError(k)


def stream_slot_lens(plans: Sequence[PackPlan]) -> np.ndarray:
    """int64 ``[K]`` slot lengths of the stream, as :func:`cpdata.layouts.rank_indices` takes them.

    Every pack's tail is absorbed into its own last slot except the final
    pack's, which ``rank_indices`` treats per layout (so one plan gives exactly
    ``plan.slot_lens``).
    """
    return slot_tables(plans).layout_lens


@dataclass(frozen=True, kw_only=True, slots=True)
class Stream:
    """Per-slot tables and concatenated piece arrays of one batch (internal).

    ``K`` stream slots, ``T`` real tokens. Concatenated arrays end with pad
    elements, so a pad position can gather from index ``T`` directly.
    """

    rows: int
    row_len: int
    slot_starts: np.ndarray  # int64 [K], stream offset of each slot
    slot_lens: np.ndarray  # int64 [K], tail absorbed
    real_lens: np.ndarray  # int64 [K]
    real_ends: np.ndarray  # int64 [K], slot_starts + real_lens
    layout_lens: np.ndarray  # int64 [K'], the slot lengths the layouts take (:func:`stream_slot_lens`)
    src_shift: np.ndarray  # int64 [K], concatenated-array index minus stream position
    pos_shift: np.ndarray  # int64 [K], position id minus stream position
    next_labels: np.ndarray  # int64 [K], target of each slot's last real token
    ids: np.ndarray  # int64 [T + 2], input_ids then two pads (room for the next-token lookup)
    extras: dict[str, np.ndarray]  # per extra key [T + 1], last element 0
    labels: np.ndarray  # int64 [T + 1], every piece's targets: its own labels, else next-token targets; -100 last
    total: int  # T


def build_stream(plans: Sequence[PackPlan], padding_token_id: int, slots: SlotTables | None = None) -> Stream:
    """The per-slot tables and concatenated piece arrays every rank of the batch gathers from.

    Read from the plans' columns (:class:`~cpdata.plan.PieceColumns`): the
    slot tables with a few numpy calls per batch (:func:`slot_tables`), then
    one slice per piece and key and one ``concatenate`` per key. ``slots``:
    :func:`slot_tables` of the same plans when already computed (the
    ``Collate`` node's, carried by its :class:`~cpdata.nodes.collate.CollatedPack`).
    """
    tables = slot_tables(plans) if slots is None else slots
    capacity, table, slot_lens = tables.capacity, tables.table, tables.slot_lens
    starts, real_lens, next_labels = table[:, 1], table[:, 2], table[:, 3]
    slot_starts = slot_lens.cumsum()
    slot_starts -= slot_lens
    src_starts = real_lens.cumsum()
    src_starts -= real_lens
    total = int(real_lens.sum())
    pieces = _Pieces.of(plans)
    plain = all(len(src) == 1 for src in pieces.sources)  # input_ids alone: no labels, no extras
    extra_keys = [] if plain else _extra_keys(pieces)
    ids = _concat(pieces, INPUT_IDS, total, 2, padding_token_id, np.dtype(np.int64))
    labels = _targets(ids, total, src_starts + real_lens - 1, real_lens > 0, next_labels)
    if not plain and any(LABELS in src for src in pieces.sources):
        at = 0
        for src, off, n in zip(pieces.sources, pieces.offsets, pieces.lengths, strict=True):
            if LABELS in src:
                labels[at : at + n] = src[LABELS][off : off + n]
            at += n
    stream = Stream(
        rows=len(plans),
        row_len=capacity,
        slot_starts=slot_starts,
        slot_lens=slot_lens,
        real_lens=real_lens,
        real_ends=slot_starts + real_lens,
        layout_lens=tables.layout_lens,
        src_shift=src_starts - slot_starts,
        pos_shift=starts - slot_starts,
        next_labels=next_labels,
        ids=ids,
        extras={key: _concat(pieces, key, total, 1, 0, None) for key in extra_keys if key != LOSS_MASK},
        labels=labels,
        total=total,
    )
    if LOSS_MASK in extra_keys:
        stream.extras[LOSS_MASK] = _loss_mask(stream, pieces)
    return stream


@dataclass(frozen=True, slots=True)
class _Pieces:
    """The batch's pieces in stream order: piece ``i`` is ``sources[i][key][offsets[i] : offsets[i] + lengths[i]]``."""

    sources: Sequence[Mapping[str, np.ndarray]]
    offsets: list[int]
    lengths: list[int]
    indices: list[int]  # source document of each piece (for errors)

    @classmethod
    def of(cls, plans: Sequence[PackPlan]) -> _Pieces:
        """The pieces of ``plans`` (an empty plan has none)."""
        cols = [p.piece_columns for p in plans]
        if len(cols) == 1:
            table, offsets, sources = cols[0].table, cols[0].offsets, cols[0].sources
        else:
            table = np.concatenate([c.table for c in cols])
            offsets = np.concatenate([c.offsets for c in cols])
            sources = tuple(src for c in cols for src in c.sources)
        return cls(sources, offsets.tolist(), table[:, 2].tolist(), table[:, 0].tolist())

    def parts(self, key: str) -> list[np.ndarray]:
        return [src[key][o : o + n] for src, o, n in zip(self.sources, self.offsets, self.lengths, strict=True)]


def _loss_mask(stream: Stream, pieces: _Pieces) -> np.ndarray:
    """``[T + 1]`` loss mask over the concatenated pieces: a piece's own, else its ``labels != -100``; pad 0."""
    given = [src[LOSS_MASK] for src in pieces.sources if LOSS_MASK in src]
    out = np.zeros(stream.total + 1, dtype=np.result_type(*given))
    labels = stream.labels
    at = 0
    for src, off, n in zip(pieces.sources, pieces.offsets, pieces.lengths, strict=True):
        if LOSS_MASK in src:
            out[at : at + n] = src[LOSS_MASK][off : off + n]
        else:
            out[at : at + n] = labels[at : at + n] != IGNORE_INDEX
        at += n
    return out


def _extra_keys(pieces: _Pieces) -> list[str]:
    sources = pieces.sources
    if sources and all(src.keys() == sources[0].keys() for src in sources):  # the usual case
        return sorted(set(sources[0]) - {INPUT_IDS, LABELS})
    keys = sorted(set().union(*(src.keys() for src in sources)) - {INPUT_IDS, LABELS}) if sources else []
    for key in keys:
        if key == LOSS_MASK:  # derived from the labels where missing
            continue
        missing = [i for i, src in zip(pieces.indices, sources, strict=True) if key not in src]
        if missing:
            raise ValueError(
                f"per-token array {key!r} is missing from the pieces of documents {missing[:8]}; "
                "every document of a batch must carry the same extra arrays"
            )
    return keys


def _concat(pieces: _Pieces, key: str, total: int, n_pad: int, pad: int, dtype: np.dtype | None) -> np.ndarray:
    """``key`` of every piece, concatenated, then ``n_pad`` pad elements."""
    parts = pieces.parts(key)
    dtype = dtype or (np.result_type(*parts) if parts else np.dtype(np.int64))
    out = np.empty(total + n_pad, dtype=dtype)
    if parts:
        np.concatenate(parts, out=out[:total], casting="unsafe")
    out[total:] = pad
    return out


def _targets(ids: np.ndarray, total: int, last: np.ndarray, real: np.ndarray, next_labels: np.ndarray) -> np.ndarray:
    """int64 ``[T + 1]`` next-token targets over the concatenated pieces (``ids`` ``[>= T + 1]``): each
    piece's last token (``last`` ``[K]``, where ``real``) targets its ``next_label``; the last element is -100."""
    labels = np.empty(total + 1, dtype=np.int64)
    labels[:total] = ids[1 : total + 1]
    if real.all():
        labels[last] = next_labels
    else:
        labels[last[real]] = next_labels[real]
    labels[total] = IGNORE_INDEX
    return labels


def stream_metadata(real_lens: np.ndarray, slot_lens: np.ndarray) -> dict[str, np.ndarray]:
    """``cu_seqlens``, ``cu_seqlens_padded`` (int32 ``[K + 1]``), ``seq_lens``, ``seq_lens_padded`` (int32
    ``[K]``) and ``max_seqlen`` (0-d int32) of int64 ``[K]`` real and slot lengths."""
    k = real_lens.shape[0]
    lens = np.empty((2, k), dtype=np.int32)  # real, slot
    lens[0], lens[1] = real_lens, slot_lens
    cu = np.zeros((2, k + 1), dtype=np.int32)
    lens.cumsum(axis=1, out=cu[:, 1:])
    return {
        "cu_seqlens": cu[0],
        "cu_seqlens_padded": cu[1],
        "seq_lens": lens[0],
        "seq_lens_padded": lens[1],
        "max_seqlen": np.asarray(lens[0].max() if k else 0, dtype=np.int32),
    }
