"""Collate pack plans into batch tensors: the full pack, or one CP rank's tokens only.

A batch is ``B`` pack plans of equal capacity ``S``. Its *stream* is the
row-major concatenation of their slots: ``B*S`` positions, stream slot ``k``
starting at ``slot_starts[k]``. Each pack's tail padding belongs to its last
slot (TE's rule, :func:`cpdata.layout.maps.thd_slot_lens`); a pack without pieces
is one padding slot of real length 0. Every output is a pure function of the
plans: the keys, dtypes and pad values of :mod:`cpdata.worker.keys`
(meanings: docs/batch-contents.md). A piece's last target is
``piece.next_label`` (-100 unless the document continues in a later pack), so
no target crosses a document boundary; ``position_ids`` continue through the
slot's padding, clamped to ``S - 1``; ``document_ids`` index the stream's
``seq_lens``.

Shapes: ``qkv_format="bshd"`` gives token tensors ``[B, S]`` (one pack per
row; metadata still describes the row-major stream, so with ``B=1`` it is the
pack's own); ``"thd"`` gives the flat ``[B*S]`` stream.

:func:`collate_rank` returns the same tensors restricted to one rank's
positions (columns for BSHD, stream positions for THD) without building the
full pack: the rank's positions (increasing, as every layout's row is) split
into each slot's real tokens and pads by one ``searchsorted`` of the slot
bounds, each position's slot and buffer offset are ``repeat`` calls of per-slot
values, and the tokens are gathered from the batch's token buffer
(:mod:`cpdata.worker.token_buffer`: the packing window's arrays, concatenated once per
window, or the batch's pieces concatenated), which ends with pad elements so
pads need no second pass and follows each piece with its last token's target
so next-token labels are one ``take``. Cost per rank: O(local tokens + slots)
(plus O(real tokens) per batch when its pieces are concatenated; rows in any
other order are sorted first); at 128K tokens and cp=8 the output is ~8x less
than the full pack. :func:`collate_pack` is the one rank of ``cp_size=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cpdata.errors import check_int
from cpdata.worker.keys import (
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    PADDING_MASK,
    POSITION_IDS,
)
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream import Stream, build_stream, slot_tables, stream_slot_lens

__all__ = [
    "QKV_FORMATS", "build_stream", "check_padding_token_id", "check_qkv_format", "collate_pack", "collate_rank",
    "collate_rank_into", "collate_ranks", "fill_rank", "pack_metadata", "rank_spec_key", "rank_specs", "spec_items",
    "stream_slot_lens",
]  # fmt: skip

QKV_FORMATS: tuple[str, ...] = ("bshd", "thd")


def check_qkv_format(qkv_format: str) -> None:
    """Raise ``ValueError`` for anything but ``"bshd"`` or ``"thd"``."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"unknown qkv_format {qkv_format!r}; choose one of {list(QKV_FORMATS)}")


def check_padding_token_id(padding_token_id: object, vocab_size: int | None = None) -> int:
    """``padding_token_id`` as an int in ``[0, vocab_size)``; ``TypeError``/``ValueError`` naming the fix otherwise.

    Pads are left out of attention (``padding_mask``, ``cu_seqlens``) and of the
    loss (label -100), so any id the embedding can look up works; a tokenizer
    without a pad token (GPT-2, Llama) can use its EOS id.
    """
    fix = "pass an id the embedding can look up, e.g. padding_token_id=tokenizer.eos_token_id (pads are masked out)"
    if padding_token_id is None:
        raise TypeError(f"padding_token_id is None (the tokenizer defines no pad token); {fix}")
    check_int("padding_token_id", padding_token_id, fix=f"; {fix}")
    if padding_token_id < 0:
        raise ValueError(
            f"padding_token_id={padding_token_id} is negative and would index outside the embedding "
            f"(-100 belongs in labels, not input_ids); {fix}"
        )
    if vocab_size is not None and padding_token_id >= vocab_size:
        raise ValueError(f"padding_token_id={padding_token_id} is >= vocab_size={vocab_size}; {fix}")
    return int(padding_token_id)


def pack_metadata(plans: Sequence[PackPlan]) -> dict[str, np.ndarray]:
    """Stream metadata only (``cu_seqlens`` & co., see the module docstring); O(slots), a few numpy calls."""
    return slot_tables(plans).metadata()


Spec = tuple[tuple[int, ...], np.dtype]
"""``(shape, numpy dtype)`` of one tensor."""
SpecKey = tuple[tuple[int, ...], int, tuple[tuple[str, np.dtype], ...]]
"""What a rank's specs depend on: the token shape, the slot count ``K`` and the extras' ``(key, dtype)``."""


def rank_specs(stream: Stream, local_len: int, qkv_format: str) -> dict[str, Spec]:
    """``key -> (shape, dtype)`` of one rank's tensors, in batch order: token tensors ``[B, L]`` (bshd)
    or ``[L]`` (thd), then the stream metadata."""
    return dict(spec_items(*rank_spec_key(stream, local_len, qkv_format)))


def rank_spec_key(stream: Stream, local_len: int, qkv_format: str) -> SpecKey:
    """The :data:`SpecKey` of one rank's tensors (:func:`spec_items` turns it into the specs)."""
    check_qkv_format(qkv_format)
    shape = (stream.rows, local_len) if qkv_format == "bshd" else (local_len,)
    extras = tuple((key, arr.dtype) for key, arr in stream.extras.items()) if stream.extras else ()
    return shape, stream.slot_lens.shape[0], extras


_I64, _I32, _BOOL = np.dtype(np.int64), np.dtype(np.int32), np.dtype(bool)


@functools.lru_cache(maxsize=256)
def spec_items(shape: tuple[int, ...], k: int, extras: tuple[tuple[str, np.dtype], ...]) -> tuple[tuple[str, Spec], ...]:
    """:func:`rank_specs` as ``(key, spec)`` items, cached per :data:`SpecKey` (a pipeline repeats a few
    shapes; the slot count varies)."""
    tokens = ((INPUT_IDS, _I64), (LABELS, _I64), (POSITION_IDS, _I64), (PADDING_MASK, _BOOL), (DOCUMENT_IDS, _I64),
              *extras)  # fmt: skip
    return (*((key, (shape, dt)) for key, dt in tokens),
            ("cu_seqlens", ((k + 1,), _I32)), ("cu_seqlens_padded", ((k + 1,), _I32)), ("seq_lens", ((k,), _I32)),
            ("seq_lens_padded", ((k,), _I32)), ("max_seqlen", ((), _I32)))  # fmt: skip


@functools.lru_cache(maxsize=4)
def _pattern(n: int) -> np.ndarray:
    """int64 ``[n]``: ``0, 0, 1, 1, 2, 2, ...`` (read-only)."""
    out = np.arange(n, dtype=np.int64) // 2
    out.flags.writeable = False
    return out


def _slot_pattern(n: int) -> np.ndarray:
    """int64 ``[n]``: the slot of each of ``n`` segments (each slot's real tokens, then its pads), sliced
    from one cached per power of two."""
    return _pattern(1 << max(n - 1, 63).bit_length())[:n]


def _gather(stream: Stream, positions: np.ndarray, out: dict[str, np.ndarray]) -> None:
    """Write the token tensors at non-decreasing stream ``positions`` int64 ``[N]`` into ``out`` (arrays of
    ``N`` elements, C order: ``[L]`` or ``[B, L]``).

    The positions fall into ``2K`` segments, each slot's real tokens then its
    pads (one ``searchsorted`` of the ``2K`` segment bounds, O(K log N)); every
    per-position value constant on a segment (slot, buffer index minus
    position, position id minus position) is one ``repeat`` of a ``[2K]``
    column (:attr:`cpdata.worker.stream.Stream.segments`): no ``take`` of a per-slot
    table and no pass over the ``B*S`` stream. Real tokens read buffer index
    ``position + src_shift``, pads ``position + W``: past the real elements,
    which is the padding mask, and ``mode="clip"`` reads the pad elements
    (``ids[W]``, and the -100/0 that end the targets and extras). Next-token
    targets read the ids one further (``ids[src + 1]``); pieces with their own
    labels read those instead. Pad position ids are clamped to ``S - 1`` only
    when some slot's pads would pass it (a piece continuing a long document).

    Cost: ~12 numpy calls, whose fixed overhead dominates short packs (the methods, not the
    ``np.take``-style wrappers, and slice assignment rather than ``np.copyto``: each cheaper per call),
    plus 8 passes over the positions (one two-row ``repeat`` of both shifts is slower than two); figures
    in docs/benchmarks.md.
    """
    k2, out_ids = 2 * stream.slot_lens.shape[0], out[INPUT_IDS]
    shape, tab = out_ids.shape, stream.segments
    cuts = positions.searchsorted(tab[: k2 + 1])  # [2K + 1], the last N
    counts = cuts[1:] - cuts[:-1]
    out[DOCUMENT_IDS][...] = _slot_pattern(k2).repeat(counts).reshape(shape)
    src = tab[k2 + 1 : 2 * k2 + 1].repeat(counts)
    src += positions
    src = src.reshape(shape)
    buffer, w = stream.buffer, stream.pad_at
    ids = buffer.ids
    pad = np.greater_equal(src, w, out=out[PADDING_MASK])  # only pads read past the real elements
    ids[: w + 1].take(src, out=out_ids, mode="clip")
    if stream.padding_token_id != ids[w]:
        np.copyto(out_ids, stream.padding_token_id, where=pad)
    labels = out[LABELS]
    if buffer.labels is None:  # next-token targets: the element after each piece is its next_label
        ids[1:].take(src, out=labels, mode="clip")  # pads read ids[W + 1] = -100
    else:
        buffer.labels.take(src, out=labels, mode="clip")
    position_ids = np.add(tab[2 * k2 + 1 :].repeat(counts).reshape(shape), positions.reshape(shape),
                          out=out[POSITION_IDS])  # fmt: skip
    if stream.pads_pass_end:  # some slot's pads would pass S - 1
        np.minimum(position_ids, stream.row_len - 1, out=position_ids, where=pad)
    for key, arr in stream.extras.items():
        arr.take(src, out=out[key], mode="clip")
    if stream.derived_mask is not None:  # pieces without a loss mask: labels != -100
        derived = stream.derived_mask.repeat(2).repeat(counts).reshape(shape)
        np.copyto(out[LOSS_MASK], np.not_equal(labels, IGNORE_INDEX), where=derived)


def collate_rank_into(stream: Stream, rows_r: np.ndarray, qkv_format: str, out: dict[str, np.ndarray]) -> None:
    """Fill ``out`` (laid out by :func:`rank_specs`) with one rank's tensors: ``rows_r`` int ``[L]``
    as for :func:`collate_rank` (checked)."""
    fill_rank(stream, _checked_rows(stream, rows_r, qkv_format), qkv_format, out)


def fill_rank(
    stream: Stream, rows_r: np.ndarray, qkv_format: str, out: dict[str, np.ndarray], increasing: bool | None = None
) -> None:  # fmt: skip
    """:func:`collate_rank_into` for a trusted int64 ``[L]`` ``rows_r`` (a layout's row); the stream
    metadata are the stream's own (:attr:`Stream.metadata <cpdata.worker.stream.Stream>`).

    ``increasing``: whether ``rows_r`` never decreases (every layout's row does, see
    :mod:`cpdata.layout.runs`); None checks it (one O(L) pass). Other rows are gathered in
    increasing order and put back in theirs (an ``argsort``: O(L log L)).
    """
    positions = rows_r
    if qkv_format == "bshd" and stream.rows > 1:  # every row's columns, as positions of the B*S stream
        positions = (np.arange(stream.rows, dtype=np.int64)[:, None] * stream.row_len + rows_r).reshape(-1)
    if increasing is None:
        increasing = bool((positions[1:] >= positions[:-1]).all())
    if increasing:
        _gather(stream, positions, out)
    else:
        keys = _token_keys(stream)
        order = np.argsort(positions, kind="stable")
        part = {key: np.empty(positions.shape, dtype=out[key].dtype) for key in keys}
        _gather(stream, positions[order], part)
        for key in keys:
            put = np.empty_like(part[key])
            put[order] = part[key]
            out[key][...] = put.reshape(out[key].shape)
    for key, value in stream.metadata.items():
        out[key][...] = value


def _token_keys(stream: Stream) -> list[str]:
    """The per-token keys :func:`_gather` writes, in :func:`rank_specs` order."""
    return [INPUT_IDS, LABELS, POSITION_IDS, PADDING_MASK, DOCUMENT_IDS, *stream.extras]


def _checked_rows(stream: Stream, rows_r: np.ndarray, qkv_format: str) -> np.ndarray:
    check_qkv_format(qkv_format)
    row_len = stream.row_len if qkv_format == "bshd" else stream.rows * stream.row_len
    rows_r = np.asarray(rows_r)
    if rows_r.ndim != 1 or not np.issubdtype(rows_r.dtype, np.integer):
        raise ValueError(f"rows_r must be a 1-D integer array, got shape {rows_r.shape} dtype {rows_r.dtype}")
    if rows_r.size and (rows_r.min() < 0 or rows_r.max() >= row_len):
        raise ValueError(
            f"rows_r must lie in [0, {row_len}) for qkv_format={qkv_format!r} "
            f"({stream.rows} x {stream.row_len} tokens), got range [{rows_r.min()}, {rows_r.max()}]"
        )
    return rows_r.astype(np.int64, copy=False)


def collate_pack(
    plans: Sequence[PackPlan], *, padding_token_id: int = 0, qkv_format: str = "bshd"
) -> dict[str, np.ndarray]:
    """The full batch: token tensors ``[B, S]`` (bshd) or ``[B*S]`` (thd) plus stream metadata.

    The one rank of ``cp_size=1``: :func:`collate_rank` at every position.
    """
    check_qkv_format(qkv_format)
    stream = build_stream(plans, padding_token_id)
    n = stream.row_len if qkv_format == "bshd" else stream.rows * stream.row_len
    specs = rank_specs(stream, n, qkv_format)
    out = {key: np.empty(shape, dtype=dt) for key, (shape, dt) in specs.items()}
    fill_rank(stream, np.arange(n, dtype=np.int64), qkv_format, out, increasing=True)
    return out


def collate_ranks(
    plans: Sequence[PackPlan],
    rows: Sequence[np.ndarray] | np.ndarray,
    *,
    padding_token_id: int = 0,
    qkv_format: str = "bshd",
) -> list[dict[str, np.ndarray]]:
    """:func:`collate_rank` for several ranks, sharing one stream (and token buffer)."""
    stream = build_stream(plans, padding_token_id)
    out = []
    for rows_r in rows:
        specs = rank_specs(stream, np.asarray(rows_r).shape[-1], qkv_format)
        tensors = {key: np.empty(shape, dtype=dt) for key, (shape, dt) in specs.items()}
        collate_rank_into(stream, rows_r, qkv_format, tensors)
        out.append(tensors)
    return out


def collate_rank(
    plans: Sequence[PackPlan],
    rows_r: np.ndarray,
    *,
    padding_token_id: int = 0,
    qkv_format: str = "bshd",
) -> dict[str, np.ndarray]:
    """One rank's tensors: ``collate_pack(...)[key][..., rows_r]`` for token keys, bit for bit.

    Args:
        plans: the ``B`` plans of the batch (equal capacity ``S``).
        rows_r: int ``[L]`` global positions of this rank, in local order:
            columns ``0..S-1`` of every row for bshd (result ``[B, L]``),
            stream positions ``0..B*S-1`` for thd (result ``[L]``).

    Returns:
        token tensors for ``rows_r`` plus the full (global) stream metadata.
    """
    return collate_ranks(plans, [rows_r], padding_token_id=padding_token_id, qkv_format=qkv_format)[0]
