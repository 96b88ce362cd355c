"""The stream of a batch: per-slot tables and the token buffer every rank gathers from.

A batch is ``B`` pack plans of equal capacity ``S``; its stream is the
row-major concatenation of their slots (``B*S`` positions, each pack's tail
absorbed by its last slot, an empty pack one padding slot of real length 0).
:func:`build_streams` reads the plans' columns (:class:`~cpdata.plan.PieceColumns`)
once: the slots of ``k`` batches are checked (:func:`slot_block`) and turned
into per-slot tables with one set of numpy calls over their concatenation,
and the pieces' tokens stay where the packing window concatenated them
(:mod:`cpdata.token_buffer`); only pieces in no common buffer are
concatenated, per batch. :mod:`cpdata.collate` builds the full pack or one
rank's tokens from a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.keys import IGNORE_INDEX
from cpdata.layouts import thd_slot_lens
from cpdata.plan import PackPlan
from cpdata.stream_buffer import batch_tokens
from cpdata.token_buffer import TokenBuffer

__all__ = [
    "SlotBlock", "SlotTables", "Stream", "StreamBlock", "build_stream", "build_streams", "segment_table", "slot_block",
    "slot_tables", "stream_metadata", "stream_slot_lens",
]  # fmt: skip

_PAD_SLOT = np.array([[-1, 0, 0, IGNORE_INDEX]], dtype=np.int64)  # plan columns of an empty pack's one pad slot
_ZERO_SLOT = np.zeros(1, dtype=np.int64)  # its raw slot length (the tail makes it the whole pack)
_END = np.iinfo(np.int64).max  # a segment bound past every stream position


@dataclass(frozen=True, slots=True)
class SlotBlock:
    """The checked slots of ``k`` batches, batch after batch: ``N`` slots of ``P`` plans (an empty plan one
    padding slot), no tokens.

    Attributes:
        table: int64 ``[N, 4]``: each slot's piece ``(index, start, length, next_label)``.
        slot_lens: int64 ``[N]``: slot lengths, every pack's tail absorbed by its last slot.
        layout_lens: int64 ``[N]``: ``slot_lens`` but each batch's last slot as the plan gives it
            (:meth:`layout_lens_of`).
        counts: ``P`` ints: pieces per plan.
        plan_first: ``k + 1`` ints: batch ``b`` holds plans ``[plan_first[b], plan_first[b + 1])``.
        first: ``k + 1`` ints: batch ``b`` holds slots ``[first[b], first[b + 1])``.
        capacities: ``k`` ints: each batch's ``S``.
        padded: whether some plan is empty (its slot is no piece's).
    """

    table: np.ndarray
    slot_lens: np.ndarray
    layout_lens: np.ndarray
    counts: list[int]
    plan_first: list[int]
    first: list[int]
    capacities: list[int]
    padded: bool

    def layout_lens_of(self, b: int) -> np.ndarray:
        """int64 ``[K']``: :func:`stream_slot_lens` of batch ``b`` (a view)."""
        end = self.first[b + 1] - (not self.counts[self.plan_first[b + 1] - 1])  # an empty last plan: no slot
        return self.layout_lens[self.first[b] : end]


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
    """The plans' slot tables, checked: :func:`slot_block` of one batch."""
    block = slot_block([plans])
    return SlotTables(block.capacities[0], block.table, block.slot_lens, block.layout_lens_of(0), block.counts)


def slot_block(batches: Sequence[Sequence[PackPlan]]) -> SlotBlock:
    """The slots of ``k`` batches of plans, checked: one pass over the plans, then a few numpy calls per block.

    Raises:
        TypeError, ValueError: a single plan instead of a sequence, no plan, plans of other capacities in
            one batch, ``slot_lens`` not one per piece, a piece longer than its slot, negative slot lengths
            or slots summing past the capacity (the errors of :func:`cpdata.layouts.thd_slot_lens`), each
            naming the first bad plan.
    """
    tables, slots, counts, caps, ends, flat = [], [], [], [], [], []  # ends: each plan's last slot, plus one
    plan_first, first, at = [0], [0], 0
    for plans in batches:
        if isinstance(plans, PackPlan):
            raise TypeError("collate takes a sequence of PackPlan (one per row), got a single PackPlan; wrap it: [plan]")
        if len(plans) == 0:
            raise ValueError("collate needs at least one PackPlan, got an empty sequence")
        capacity = plans[0].capacity
        for b, plan in enumerate(plans):
            if plan.capacity != capacity:
                raise ValueError(
                    f"all plans of a batch need the same capacity; plan {b} has {plan.capacity}, plan 0 has {capacity}"
                )
            table, slot_lens = plan.columns, plan.slot_lens
            if type(slot_lens) is not np.ndarray or slot_lens.dtype != np.int64:
                slot_lens = np.asarray(slot_lens)
            n = table.shape[0]
            if slot_lens.shape != (n,):
                raise ValueError(
                    f"plan {plan.index}: slot_lens has shape {slot_lens.shape}, expected ({n},) (one slot per piece)"
                )
            counts.append(n)
            tables.append(table if n else _PAD_SLOT)  # empty pack: one pad slot
            slots.append(slot_lens if n else _ZERO_SLOT)
            at += n or 1
            ends.append(at)
        flat.extend(plans)
        caps.append(capacity)
        plan_first.append(len(counts))
        first.append(at)
    table = tables[0] if len(tables) == 1 else np.concatenate(tables)
    raw = (slots[0] if len(slots) == 1 else np.concatenate(slots)).astype(np.int64, copy=False)
    short = raw < table[:, 2]
    if short.any():
        p, i = _plan_piece(counts, int(np.flatnonzero(short)[0]))
        raise ValueError(
            f"plan {flat[p].index}: piece {i} has {int(table[:, 2][short][0])} tokens but its slot only "
            f"{int(raw[short][0])}; slot_lens must be >= the piece lengths"
        )
    last = np.asarray(ends, dtype=np.int64)
    last -= 1
    ends = raw.cumsum()[last]
    tails = np.subtract(caps[0] if min(caps) == max(caps) else np.repeat(caps, np.diff(plan_first)), ends)
    tails[1:] += ends[:-1]  # each plan's tail padding: its capacity minus the sum of its slots
    slot_lens = raw.copy()
    slot_lens[last] += tails
    if tails.min() < 0:  # (a negative slot is shorter than its piece: refused above)
        for plan in flat:
            thd_slot_lens(plan.slot_lens, plan.capacity)  # its error for the first bad plan
    layout_lens = slot_lens.copy()
    batch_last = last[np.asarray(plan_first[1:], dtype=np.int64) - 1]
    layout_lens[batch_last] = raw[batch_last]
    return SlotBlock(table, slot_lens, layout_lens, counts, plan_first, first, caps, min(counts) == 0)


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
    position reads index ``W`` (:attr:`pad_at`). The per-slot columns are views of
    :attr:`segments`.
    """

    rows: int
    row_len: int
    slot_lens: np.ndarray  # int64 [K], tail absorbed
    segments: np.ndarray  # int64 [6K + 1]: :func:`segment_table`
    buffer: TokenBuffer
    padding_token_id: int
    extras: dict[str, np.ndarray]  # the batch's extra keys -> the buffer's [W + 1] arrays (loss mask last)
    derived_mask: np.ndarray | None  # bool [K]: slots whose loss mask is labels != -100 (no mask of their own)
    pads_pass_end: bool  # whether some slot's pad position ids pass S - 1 (False: no clamp needed)
    metadata: dict[str, np.ndarray]  # :func:`stream_metadata` of the slots

    @property
    def slot_starts(self) -> np.ndarray:
        """int64 ``[K]``: stream offset of each slot."""
        return self.segments[0 : 2 * self.slot_lens.shape[0] : 2]

    @property
    def real_ends(self) -> np.ndarray:
        """int64 ``[K]``: ``slot_starts + real_lens``."""
        return self.segments[1 : 2 * self.slot_lens.shape[0] : 2]

    @property
    def real_lens(self) -> np.ndarray:
        """int64 ``[K]``: real tokens of each slot."""
        return self.real_ends - self.slot_starts

    @property
    def src_shift(self) -> np.ndarray:
        """int64 ``[K]``: buffer index minus stream position of each slot's real tokens."""
        k = self.slot_lens.shape[0]
        return self.segments[2 * k + 1 : 4 * k + 1 : 2]

    @property
    def src_starts(self) -> np.ndarray:
        """int64 ``[K]``: buffer index of each slot's first token."""
        return self.src_shift + self.slot_starts

    @property
    def pos_shift(self) -> np.ndarray:
        """int64 ``[K]``: position id minus stream position of each slot."""
        return self.segments[4 * self.slot_lens.shape[0] + 1 :: 2]

    @property
    def total(self) -> int:
        """``T``: the real tokens."""
        return int(self.real_lens.sum())

    @property
    def max_slot_len(self) -> int:
        """The longest slot (tail absorbed)."""
        return int(self.slot_lens.max())

    @property
    def pad_at(self) -> int:
        """``W``: the buffer index pad positions read."""
        return self.buffer.total


@dataclass(frozen=True, slots=True)
class StreamBlock:
    """The streams of ``k`` batches and the block arrays they are views of (``N`` slots in all).

    Attributes:
        streams: each batch's :class:`Stream`.
        slots: the batches' :class:`SlotBlock`.
        offsets: int64 ``[N]``: each slot's offset in the block's concatenated streams (batch ``b``'s
            stream starts at ``offsets[slots.first[b]]``, after ``B*S`` positions of each batch before it).
        src_starts: int64 ``[N]``: buffer index of each slot's first token (in its batch's buffer).
        real_tokens: ``k`` ints: ``T`` of each batch.
        max_seqlen: ``k`` ints: each batch's longest piece.
        max_slot_len: ``k`` ints: each batch's longest slot (tail absorbed).
    """

    streams: list[Stream]
    slots: SlotBlock
    offsets: np.ndarray
    src_starts: np.ndarray
    real_tokens: list[int]
    max_seqlen: list[int]
    max_slot_len: list[int]


def build_stream(plans: Sequence[PackPlan], padding_token_id: int) -> Stream:
    """The per-slot tables of a batch and the token buffer every rank of it gathers from: :func:`build_streams`
    of one batch."""
    return build_streams([(plans, padding_token_id)]).streams[0]


def build_streams(batches: Sequence[tuple[Sequence[PackPlan], int]]) -> StreamBlock:
    """The :class:`StreamBlock` of ``k`` batches ``(plans, padding_token_id)``.

    Read from the plans' columns (:class:`~cpdata.plan.PieceColumns`): the
    slots of all batches (:func:`slot_block`) and each batch's token buffer
    (:func:`~cpdata.stream_buffer.batch_tokens`: the packing window's as is,
    or the pieces concatenated); then the per-slot columns, the segment
    tables and the stream metadata of all ``k`` batches with one set of numpy
    calls over the concatenated slots, running sums restarted at each batch.
    Each stream's columns are views of the block's arrays. Cost: O(N) in ~30
    numpy calls per block plus O(k + plans) Python.

    Raises:
        TypeError, ValueError: the checks of :func:`slot_block` and :func:`~cpdata.stream_buffer.batch_tokens`.
    """
    slots = slot_block([plans for plans, _ in batches])
    tokens = [batch_tokens(plans) for plans, _ in batches]
    k, n, firsts, caps = len(batches), slots.table.shape[0], slots.first, slots.capacities
    pf = slots.plan_first
    if slots.padded:  # an empty plan's padding slot reads no piece
        src = [_per_slot(slots.counts[pf[b] : pf[b + 1]], tok.at, 0) for b, tok in enumerate(tokens)]
    else:
        src = [tok.at for tok in tokens]
    src_starts = src[0] if k == 1 else np.concatenate(src)
    table, slot_lens = slots.table, slots.slot_lens
    starts, real_lens = table[:, 1], table[:, 2]
    first = np.asarray(firsts, dtype=np.int64)  # batch b: slots [first[b], first[b + 1])
    offsets = slot_lens.cumsum()
    offsets -= slot_lens
    seg = np.empty(6 * n + k, dtype=np.int64)  # batch b's segment table: seg[6 first[b] + b :][: 6 K_b + 1]
    pad_at = [tok.buffer.total for tok in tokens]  # W of each batch: the buffer index its pads read
    if k == 1:  # one batch: its segment table by strided slices
        batch_of, slot_starts = None, offsets
        seg[0 : 2 * n : 2], seg[2 * n] = slot_starts, _END
        np.add(slot_starts, real_lens, out=seg[1 : 2 * n : 2])
        np.subtract(src_starts, slot_starts, out=seg[2 * n + 1 : 4 * n + 1 : 2])
        seg[2 * n + 2 : 4 * n + 1 : 2] = pad_at[0]
        np.subtract(starts, slot_starts, out=seg[4 * n + 1 :: 2])
        seg[4 * n + 2 :: 2] = seg[4 * n + 1 :: 2]
        reach = [int((starts + slot_lens).max())]
    else:
        head, sizes = first[:-1], first[1:] - first[:-1]
        batch_of = np.repeat(np.arange(k, dtype=np.int64), sizes)  # int64 [N]: each slot's batch
        slot_starts = offsets - offsets[head][batch_of]
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
        reach = np.maximum.reduceat(starts + slot_lens, head).tolist()
    metadata, totals, longest, widest = _metadata_block(real_lens, slot_lens, first, batch_of)
    out = []
    for b, (plans, padding_token_id) in enumerate(batches):
        tok, i, j = tokens[b], firsts[b], firsts[b + 1]
        o = 6 * i + b
        out.append(Stream(
            rows=len(plans), row_len=caps[b], slot_lens=slot_lens[i:j], segments=seg[o : o + 6 * (j - i) + 1],
            buffer=tok.buffer, padding_token_id=padding_token_id,
            extras={key: tok.buffer.extras[key] for key in tok.keys} if tok.keys else {},
            derived_mask=None if tok.no_mask is None else _per_slot(slots.counts[pf[b] : pf[b + 1]], tok.no_mask, True),
            pads_pass_end=reach[b] > caps[b], metadata=metadata[b],
        ))  # fmt: skip
    return StreamBlock(out, slots, offsets, src_starts, totals, longest, widest)


def segment_table(stream: Stream) -> np.ndarray:
    """int64 ``[6K + 1]``: the stream's ``2K`` segments, each slot's real tokens then its pads, in stream order.

    ``[:2K]`` the first stream position of each (``slot_starts`` and ``real_ends`` interleaved), then
    a bound past every position; ``[2K + 1 : 4K + 1]`` buffer index minus stream position (``src_shift``,
    then ``W`` for the pads: past every real element); ``[4K + 1:]`` position id minus stream position
    (``pos_shift`` twice). :attr:`Stream.segments`, built by :func:`build_streams`.
    """
    return stream.segments


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
                    ) -> tuple[list[dict[str, np.ndarray]], list[int], list[int], list[int]]:  # fmt: skip
    """:func:`stream_metadata` of each batch of a block, then each batch's real tokens, longest piece and
    longest slot.

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
        cum -= (cum[:, head] - lens[:, head])[:, batch_of]
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
    return out, totals, top[0], top[1]
