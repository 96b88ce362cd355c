"""The stream of a batch: per-slot tables, the token buffer every rank gathers from, the target count.

:func:`build_streams` checks the slots of ``k`` batches (:func:`~cpdata.worker.stream_slots.slot_block`)
and builds their tables with one set of numpy calls. A batch whose plans share a packing window's
buffer (holding its labels and extras in the promoted dtypes) gathers from it as is; any other
concatenates its pieces. :func:`target_counts` gives ``info["n_targets"]`` (the loss divisor at
``cp_size > 1``, so the step needs no collective): O(slots) without labels, O(tokens) with them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS, LABELS, LOSS_MASK
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream_slots import SlotBlock, metadata_block, slot_block
from cpdata.worker.token_buffer import TokenBuffer, concatenate_arrays

__all__ = ["BatchTokens", "Stream", "StreamBlock", "batch_tokens", "buffer_runs", "build_streams",
           "target_counts"]  # fmt: skip

_END = np.iinfo(np.int64).max  # a segment bound past every stream position


@dataclass(frozen=True, kw_only=True, slots=True)
class Stream:
    """Per-slot tables of one batch and the token buffer its ranks gather from (internal).

    ``K`` slots, ``T`` real tokens in a :class:`~cpdata.worker.token_buffer.TokenBuffer` of ``W >= T``.
    Position ``p`` of slot ``k`` reads buffer index ``p + src_shift[k]``; a pad reads index ``W``.

    ``segments`` int64 ``[6K + 1]``, over the ``2K`` segments (each slot's real tokens, then its pads):
    ``[:2K]`` each segment's first stream position, then a bound past every position; ``[2K + 1 : 4K + 1]``
    buffer index minus position (``src_shift``, then ``W`` for pads); ``[4K + 1:]`` position id minus
    position (``pos_shift`` twice). The per-slot properties are views of it."""

    rows: int
    row_len: int
    slot_lens: np.ndarray  # int64 [K], tail absorbed
    segments: np.ndarray  # int64 [6K + 1], see above
    buffer: TokenBuffer
    padding_token_id: int
    extras: dict[str, np.ndarray]  # the batch's extra keys -> the buffer's [W + 1] arrays (loss mask last)
    derived_mask: np.ndarray | None  # bool [K]: slots whose loss mask is labels != -100 (no mask of their own)
    pads_pass_end: bool  # whether some slot's pad position ids pass S - 1 (False: no clamp needed)
    metadata: dict[str, np.ndarray]  # :func:`~cpdata.worker.stream_slots.pack_metadata` of the slots

    @property
    def slot_starts(self) -> np.ndarray:
        """int64 ``[K]``: stream offset of each slot."""
        return self.segments[0 : 2 * self.slot_lens.shape[0] : 2]

    @property
    def real_ends(self) -> np.ndarray:
        """int64 ``[K]``: ``slot_starts + real_lens``."""
        return self.segments[1 : 2 * self.slot_lens.shape[0] : 2]


@dataclass(frozen=True, slots=True)
class StreamBlock:
    """The streams of ``k`` batches and the block arrays they view (``N`` slots in all).

    Attributes:
        offsets: int64 ``[N]``: each slot's offset in the block's streams back to back.
        src_starts: int64 ``[N]``: buffer index of each slot's first token.
    """

    streams: list[Stream]
    slots: SlotBlock
    offsets: np.ndarray
    src_starts: np.ndarray


def build_streams(batches: Sequence[tuple[Sequence[PackPlan], int]]) -> StreamBlock:
    """The :class:`StreamBlock` of ``k`` batches ``(plans, padding_token_id)``.

    Slots of all batches (:func:`slot_block`) and each batch's buffer (:func:`batch_tokens`), then the
    segment tables and metadata of all batches with one set of numpy calls, running sums restarted at each
    batch: O(N) in ~30 numpy calls per block plus O(k + plans) Python. Raises the errors of those two."""
    slots = slot_block([plans for plans, _ in batches])
    tokens = [batch_tokens(plans) for plans, _ in batches]
    k, n, firsts, caps = len(batches), slots.table.shape[0], slots.first, slots.capacities
    pf = slots.plan_first
    src = [_per_slot(slots.counts[pf[b] : pf[b + 1]], tok.at, 0) for b, tok in enumerate(tokens)]
    src_starts = src[0] if k == 1 else np.concatenate(src)
    table, slot_lens = slots.table, slots.slot_lens
    starts, real_lens = table[:, 1], table[:, 2]
    first = np.asarray(firsts, dtype=np.int64)  # batch b: slots [first[b], first[b + 1])
    offsets = slot_lens.cumsum()
    offsets -= slot_lens
    seg = np.empty(6 * n + k, dtype=np.int64)  # batch b's segment table: seg[6 first[b] + b :][: 6 K_b + 1]
    pad_at = [tok.buffer.total for tok in tokens]  # W of each batch: the buffer index its pads read
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
    metadata = metadata_block(real_lens, slot_lens, first, batch_of)
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
    return StreamBlock(out, slots, offsets, src_starts)


def _per_slot(counts: list[int], values: np.ndarray, pad: object) -> np.ndarray:
    """Per-piece ``values`` ``[n]`` as a per-slot column ``[K]``: ``pad`` for an empty plan's padding slot."""
    if all(counts):
        return values
    before = np.cumsum([0, *counts[:-1]])  # the pieces before each plan
    return np.insert(values, before[np.asarray(counts) == 0], pad)


@dataclass(frozen=True, slots=True)
class BatchTokens:
    """Where the ``n`` pieces of a batch (plan after plan) lie.

    Attributes:
        at: int64 ``[n]`` index of each piece's first token in ``buffer``.
        keys: the batch's extra per-token keys, sorted, ``loss_mask`` last.
        no_mask: bool ``[n]``: pieces without a loss mask of their own when some piece has one; else None.
    """

    buffer: TokenBuffer
    at: np.ndarray
    keys: list[str]
    no_mask: np.ndarray | None


def batch_tokens(plans: Sequence[PackPlan]) -> BatchTokens:
    """The :class:`BatchTokens` of ``plans``.

    Raises:
        ValueError: a piece lacks an extra array other pieces of the batch carry (``loss_mask`` excepted).
    """
    cols = [p.piece_columns for p in plans]
    sources = cols[0].sources if len(cols) == 1 else tuple(src for c in cols for src in c.sources)
    # every source one key, input_ids alone (no labels, no extras); a sum of key counts is cheaper than a max
    plain = sum(map(len, sources)) == len(sources) and all(sources)
    keys = [] if plain else _extra_keys(sources, cols)
    no_mask = None
    if LOSS_MASK in keys and not all(LOSS_MASK in src for src in sources):
        no_mask = np.fromiter((LOSS_MASK not in src for src in sources), dtype=bool, count=len(sources))
    buffer = cols[0].buffer
    shared = buffer is not None and all(c.buffer is buffer for c in cols[1:])
    if shared and (plain or _holds(buffer, sources, keys)):
        return BatchTokens(buffer, _column(cols, "at"), keys, no_mask)
    table = _column(cols, "table")
    offsets, lengths = _column(cols, "offsets").tolist(), table[:, 2]
    arrays = [{k: a[o : o + n] for k, a in src.items()}
              for src, o, n in zip(sources, offsets, lengths.tolist(), strict=True)]  # fmt: skip
    at = lengths.cumsum()
    at += np.arange(lengths.shape[0], dtype=np.int64)
    at -= lengths
    return BatchTokens(concatenate_arrays(arrays, lengths, np.ascontiguousarray(table[:, 3])), at, keys, no_mask)


def _column(cols: list, name: str) -> np.ndarray:
    return getattr(cols[0], name) if len(cols) == 1 else np.concatenate([getattr(c, name) for c in cols])


def _holds(buffer: TokenBuffer, sources: Sequence[Mapping[str, np.ndarray]], keys: list[str]) -> bool:
    """Whether ``buffer`` holds labels where pieces have them and ``keys`` in the pieces' promoted dtypes."""
    if buffer.labels is None and any(LABELS in src for src in sources):
        return False
    for key in keys:
        held = buffer.extras.get(key)
        if held is None or held.dtype != np.result_type(*[src[key].dtype for src in sources if key in src]):
            return False
    return True


def _extra_keys(sources: Sequence[Mapping[str, np.ndarray]], cols: list) -> list[str]:
    """The pieces' per-token keys beside ``input_ids`` and ``labels``, sorted, ``loss_mask`` last."""
    keys = sorted(set().union(*(src.keys() for src in sources)) - {INPUT_IDS, LABELS})
    for key in (k for k in keys if k != LOSS_MASK):  # a missing loss mask is derived from the labels
        missing = [i for i, src in zip(_column(cols, "table")[:, 0].tolist(), sources, strict=True) if key not in src]
        if missing:
            raise ValueError(
                f"per-token array {key!r} is missing from the pieces of documents {missing[:8]}; "
                "every document of a batch must carry the same extra arrays"
            )
    return sorted(keys, key=lambda k: k == LOSS_MASK)


def buffer_runs(streams: Sequence[Stream]) -> Iterator[tuple[int, int]]:
    """``(b, e)``: each run of consecutive batches ``[b, e)`` reading one token buffer."""
    e = 0
    for _, run in itertools.groupby(streams, key=lambda stream: id(stream.buffer)):
        b, e = e, e + len(list(run))
        yield b, e


def target_counts(block: StreamBlock) -> list[int]:
    """``k`` host ints: the targets of each batch of ``block``, batches sharing a buffer counted together."""
    slots, streams, starts = block.slots, block.streams, block.src_starts
    real, first = slots.table[:, 2], slots.first
    per_slot = np.empty(real.shape[0], dtype=np.int64)
    for b, e in buffer_runs(streams):
        buffer, part = streams[b].buffer, slice(first[b], first[e])
        at, n = starts[part], real[part]
        if buffer.labels is None:  # a slot's last target is the element after it; an empty slot has none
            per_slot[part] = np.where(n > 0, n - 1 + (buffer.ids.take(at + n) != IGNORE_INDEX), 0)
        else:
            spans = zip(at.tolist(), n.tolist(), strict=True)
            per_slot[part] = [np.count_nonzero(buffer.labels[a : a + k] != IGNORE_INDEX) for a, k in spans]
    return np.add.reduceat(per_slot, first[:-1]).tolist()  # (every batch has a slot)
