"""The stream of a batch: per-slot tables and the token buffer every rank gathers from.

A batch is ``B`` pack plans of equal capacity ``S``; its stream is the
row-major concatenation of their slots (``B*S`` positions, each pack's tail
absorbed by its last slot, an empty pack one padding slot of real length 0).
:func:`build_stream` reads the plans' columns (:class:`~cpdata.plan.PieceColumns`)
once: O(slots) tables (:func:`build_streams`: the tables of ``k`` batches with one
set of numpy calls), and the pieces' tokens stay where the packing window
concatenated them (:mod:`cpdata.token_buffer`); only pieces in no common buffer
are concatenated, per batch. :mod:`cpdata.collate` builds the full pack or one
rank's tokens from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from cpdata.keys import IGNORE_INDEX
from cpdata.layouts import thd_slot_lens
from cpdata.plan import PackPlan
from cpdata.stream_buffer import batch_tokens
from cpdata.token_buffer import TokenBuffer

__all__ = [
    "SlotTables", "Stream", "build_stream", "build_streams", "segment_table", "slot_tables", "stream_metadata", "stream_slot_lens",
]  # fmt: skip

_PAD_SLOT = np.array([[-1, 0, 0, IGNORE_INDEX]], dtype=np.int64)  # plan columns of an empty pack's one pad slot
_ZERO_SLOT = np.zeros(1, dtype=np.int64)  # its raw slot length (the tail makes it the whole pack)
_END = np.iinfo(np.int64).max  # a segment bound past every stream position


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
    """Per-slot tables of one batch and the token buffer its ranks gather from (internal).

    ``K`` stream slots, ``T`` real tokens, in a :class:`~cpdata.token_buffer.TokenBuffer`
    of ``W >= T`` tokens (the packing window's, or the batch's own pieces concatenated).
    Stream position ``p`` of slot ``k`` reads buffer index ``p + src_shift[k]``; a pad
    position reads index ``W`` (:attr:`pad_at`).
    """

    rows: int
    row_len: int
    slot_starts: np.ndarray  # int64 [K], stream offset of each slot
    slot_lens: np.ndarray  # int64 [K], tail absorbed
    real_lens: np.ndarray  # int64 [K]
    real_ends: np.ndarray  # int64 [K], slot_starts + real_lens
    layout_lens: np.ndarray  # int64 [K'], the slot lengths the layouts take (:func:`stream_slot_lens`)
    src_starts: np.ndarray  # int64 [K], buffer index of each slot's first token
    src_shift: np.ndarray  # int64 [K], buffer index minus stream position
    pos_shift: np.ndarray  # int64 [K], position id minus stream position
    buffer: TokenBuffer
    padding_token_id: int
    extras: dict[str, np.ndarray]  # the batch's extra keys -> the buffer's [W + 1] arrays (loss mask last)
    derived_mask: np.ndarray | None  # bool [K]: slots whose loss mask is labels != -100 (no mask of their own)
    total: int  # T
    segments: np.ndarray | None = None  # int64 [6K + 1]: :func:`segment_table` (None: computed per gather)
    pads_pass_end: bool = True  # whether some slot's pad position ids pass S - 1 (False: no clamp needed)
    metadata: dict[str, np.ndarray] | None = None  # :func:`stream_metadata` of the slots (None: computed per use)
    max_slot_len: int = 0  # the longest slot (tail absorbed), 0 when not computed

    @property
    def pad_at(self) -> int:
        """``W``: the buffer index pad positions read."""
        return self.buffer.total


def build_stream(plans: Sequence[PackPlan], padding_token_id: int, slots: SlotTables | None = None) -> Stream:
    """The per-slot tables of a batch and the token buffer every rank of it gathers from.

    :func:`build_streams` of one batch. ``slots``: :func:`slot_tables` of the same plans when
    already computed (the ``Collate`` node's, carried by its :class:`~cpdata.nodes.collate.CollatedPack`).
    """
    return build_streams([(plans, padding_token_id, slots)])[0]


def build_streams(batches: Sequence[tuple[Sequence[PackPlan], int, SlotTables | None]]) -> list[Stream]:
    """The :class:`Stream` of each of ``k`` batches ``(plans, padding_token_id, slots or None)``.

    Read from the plans' columns (:class:`~cpdata.plan.PieceColumns`): each
    batch's slot tables (:func:`slot_tables`, unless given) and token buffer
    (:func:`~cpdata.stream_buffer.batch_tokens`: the packing window's as is,
    or the pieces concatenated); then the per-slot columns, the segment
    tables and the stream metadata of all ``k`` batches (``N`` slots in all)
    with one set of numpy calls over the concatenated slots, running sums
    restarted at each batch. Each stream's columns are views of the block's
    arrays. Cost: O(N) in ~25 numpy calls per block plus O(k) Python.
    """
    tables = [slot_tables(plans) if slots is None else slots for plans, _, slots in batches]
    tokens = [batch_tokens(plans) for plans, _, _ in batches]
    counts = [t.slot_lens.shape[0] for t in tables]  # K_b >= 1 (an empty plan holds one padding slot)
    k, n = len(batches), sum(counts)
    src = [_per_slot(t.counts, b.at, 0) for t, b in zip(tables, tokens, strict=True)]
    if k == 1:
        table, slot_lens, src_starts = tables[0].table, tables[0].slot_lens, src[0]
    else:
        table = np.concatenate([t.table for t in tables])
        slot_lens, src_starts = np.concatenate([t.slot_lens for t in tables]), np.concatenate(src)
    starts, real_lens = table[:, 1], table[:, 2]
    first = np.fromiter(accumulate(counts, initial=0), dtype=np.int64, count=k + 1)  # batch b: slots [first[b], first[b + 1])
    sizes, head = (np.asarray(counts, dtype=np.int64), first[:-1]) if k > 1 else (None, None)
    batch_of = np.repeat(np.arange(k, dtype=np.int64), sizes) if k > 1 else None  # int64 [N]: each slot's batch
    slot_starts = slot_lens.cumsum()
    slot_starts -= slot_lens
    if batch_of is not None:
        slot_starts -= slot_starts[head][batch_of]
    seg = np.empty(6 * n + k, dtype=np.int64)
    pad_at = [b.buffer.total for b in tokens]  # W of each batch: the buffer index its pads read
    if batch_of is None:  # one batch: its segment table by strided slices
        seg_ats = [0]
        seg[0 : 2 * n : 2], seg[2 * n] = slot_starts, _END
        np.add(slot_starts, real_lens, out=seg[1 : 2 * n : 2])
        np.subtract(src_starts, slot_starts, out=seg[2 * n + 1 : 4 * n + 1 : 2])
        seg[2 * n + 2 : 4 * n + 1 : 2] = pad_at[0]
        np.subtract(starts, slot_starts, out=seg[4 * n + 1 :: 2])
        seg[4 * n + 2 :: 2] = seg[4 * n + 1 :: 2]
    else:  # batch b's segment table: seg[seg_at[b] : seg_at[b] + 6 K_b + 1]
        seg_at = 6 * head
        seg_at += np.arange(k, dtype=np.int64)
        seg[seg_at + 2 * sizes] = _END
        at = 2 * np.arange(n, dtype=np.int64)  # each slot's first segment, then its second, its third
        at += (seg_at - 2 * head)[batch_of]
        step = (2 * sizes)[batch_of]
        seg[at] = slot_starts
        seg[at + 1] = slot_starts + real_lens
        at += step
        at += 1
        seg[at] = src_starts - slot_starts
        seg[at + 1] = np.asarray(pad_at, dtype=np.int64)[batch_of]
        at += step
        seg[at] = seg[at + 1] = starts - slot_starts
        seg_ats = seg_at.tolist()
    metadata, totals, longest = _metadata_block(real_lens, slot_lens, first, batch_of)
    reach = np.maximum.reduceat(starts + slot_lens, head).tolist() if k > 1 else [int((starts + slot_lens).max())]
    out, firsts = [], first.tolist()
    for b, (plans, padding_token_id, _) in enumerate(batches):
        t, tok, c, o = tables[b], tokens[b], counts[b], seg_ats[b]
        s = seg[o : o + 6 * c + 1]
        out.append(Stream(
            rows=len(plans), row_len=t.capacity, slot_starts=slot_starts[firsts[b] : firsts[b + 1]],
            slot_lens=t.slot_lens, real_lens=t.table[:, 2], real_ends=s[1 : 2 * c : 2], layout_lens=t.layout_lens,
            src_starts=src[b], src_shift=s[2 * c + 1 : 4 * c + 1 : 2], pos_shift=s[4 * c + 1 :: 2],
            buffer=tok.buffer, padding_token_id=padding_token_id,
            extras={key: tok.buffer.extras[key] for key in tok.keys},
            derived_mask=None if tok.no_mask is None else _per_slot(t.counts, tok.no_mask, True),
            total=totals[b], segments=s, pads_pass_end=reach[b] > t.capacity,
            metadata=metadata[b], max_slot_len=longest[b],
        ))  # fmt: skip
    return out

def segment_table(stream: Stream) -> np.ndarray:
    """int64 ``[6K + 1]``: the stream's ``2K`` segments, each slot's real tokens then its pads, in stream order.

    ``[:2K]`` the first stream position of each (``slot_starts`` and ``real_ends`` interleaved), then
    a bound past every position; ``[2K + 1 : 4K + 1]`` buffer index minus stream position (``src_shift``,
    then ``W`` for the pads: past every real element); ``[4K + 1:]`` position id minus stream position
    (``pos_shift`` twice). :attr:`Stream.segments` when :func:`build_stream` made the stream.
    """
    if stream.segments is not None:
        return stream.segments
    k = stream.slot_starts.shape[0]
    seg = np.empty(6 * k + 1, dtype=np.int64)
    seg[0 : 2 * k : 2], seg[1 : 2 * k : 2], seg[2 * k] = stream.slot_starts, stream.real_ends, _END
    seg[2 * k + 1 : 4 * k + 1 : 2], seg[2 * k + 2 : 4 * k + 1 : 2] = stream.src_shift, stream.pad_at
    seg[4 * k + 1 :: 2], seg[4 * k + 2 :: 2] = stream.pos_shift, stream.pos_shift
    return seg


def _per_slot(counts: list[int], values: np.ndarray, pad: object) -> np.ndarray:
    """Per-piece ``values`` ``[n]`` (plan after plan, ``counts`` pieces each) as a per-slot column ``[K]``:
    ``pad`` for the padding slot of an empty plan."""
    if all(counts):
        return values
    parts, at = [], 0
    for c in counts:
        parts.append(values[at : at + c] if c else np.asarray([pad], dtype=values.dtype))
        at += c
    return np.concatenate(parts)


def stream_metadata(real_lens: np.ndarray, slot_lens: np.ndarray) -> dict[str, np.ndarray]:
    """``cu_seqlens``, ``cu_seqlens_padded`` (int32 ``[K + 1]``), ``seq_lens``, ``seq_lens_padded`` (int32
    ``[K]``) and ``max_seqlen`` (0-d int32) of int64 ``[K]`` real and slot lengths."""
    return _metadata_block(real_lens, slot_lens, np.asarray([0, real_lens.shape[0]], dtype=np.int64), None)[0][0]


def _metadata_block(real_lens: np.ndarray, slot_lens: np.ndarray, first: np.ndarray, batch_of: np.ndarray | None
                    ) -> tuple[list[dict[str, np.ndarray]], list[int], list[int]]:  # fmt: skip
    """:func:`stream_metadata` of each batch of a block, then each batch's real tokens and longest slot.

    int64 ``[N]`` real and slot lengths of the block's slots, batch ``b`` holding slots
    ``[first[b], first[b + 1])`` (``first`` int64 ``[k + 1]``, ``first[0] = 0``, every batch a slot when
    ``k > 1``), ``batch_of`` int64 ``[N]`` each slot's batch (None when ``k = 1``). The cumulative sums run
    over the block once and restart at each batch; each dict's arrays are views of two block arrays
    (int32 ``[2, N]`` lengths and ``[2, N + k]`` cumulative sums).
    """
    n, k = real_lens.shape[0], first.shape[0] - 1
    lens = np.empty((2, n), dtype=np.int32)  # real, slot
    lens[0], lens[1] = real_lens, slot_lens
    cu = np.zeros((2, n + k), dtype=np.int32)  # batch b: columns [first[b] + b, first[b + 1] + b]
    if batch_of is None:
        lens.cumsum(axis=1, out=cu[:, 1:])
        totals = [int(real_lens.sum())]
        top = lens.max(axis=1, keepdims=True).tolist() if n else [[0], [0]]
    else:
        head = first[:-1]
        cum = lens.cumsum(axis=1, dtype=np.int64)
        cum -= np.repeat(cum[:, head] - lens[:, head], np.diff(first), axis=1)
        at = np.arange(1, n + 1, dtype=np.int64)
        at += batch_of
        cu.reshape(-1)[np.concatenate((at, at + (n + k)))] = cum.reshape(-1)
        totals = cum[0, first[1:] - 1].tolist()
        top = np.maximum.reduceat(lens, head, axis=1).tolist()
    out, bounds, (cu_real, cu_slot), (real, slot) = [], first.tolist(), cu, lens
    for b in range(k):
        i, j = bounds[b], bounds[b + 1]
        out.append({
            "cu_seqlens": cu_real[i + b : j + b + 1],
            "cu_seqlens_padded": cu_slot[i + b : j + b + 1],
            "seq_lens": real[i:j],
            "seq_lens_padded": slot[i:j],
            "max_seqlen": np.asarray(top[0][b], dtype=np.int32),
        })  # fmt: skip
    return out, totals, top[1]
