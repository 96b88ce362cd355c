"""Collate pack plans into batch tensors: the full pack, or one CP rank's tokens only; ``CollatedPack``,
the record between ``Collate`` and ``ShardForRank``.

A batch's stream is its ``B`` plans' slots row after row (``B*S`` positions), each pack's tail in its
last slot (TE's rule), an empty pack one padding slot; keys and pad values: :mod:`cpdata.worker.keys`.
No target crosses a document end (a piece's last target is its ``next_label``); ``position_ids``
continue through a slot's padding, clamped to ``S - 1``. bshd gives ``[B, S]`` rows, thd the flat
stream; the metadata describe the row-major stream either way.

:func:`collate_rank` gathers one rank's positions from the batch's token buffer without building the
pack: O(local tokens + slots), ~cp times less; :func:`collate_pack` is the rank of every position."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.errors import check_choice, check_int
from cpdata.worker.keys import (
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    METADATA_KEYS,
    PADDING_MASK,
    POSITION_IDS,
    STANDARD_TOKEN_KEYS,
)
from cpdata.worker.plan import PackPlan
from cpdata.worker.stream import Stream, build_streams
from cpdata.worker.stream_slots import pack_metadata

__all__ = ["QKV_FORMATS", "CollatedPack", "check_padding_token_id", "check_qkv_format", "collate_pack",
           "collate_rank", "fill_rank", "rank_spec_key", "rank_specs", "spec_items"]  # fmt: skip

QKV_FORMATS: tuple[str, ...] = ("bshd", "thd")


def check_qkv_format(qkv_format: str) -> None:
    """Raise ``ValueError`` for anything but ``"bshd"`` or ``"thd"``."""
    check_choice("qkv_format", qkv_format, QKV_FORMATS)


def check_padding_token_id(padding_token_id: object, vocab_size: int | None = None) -> int:
    """``padding_token_id`` as an int in ``[0, vocab_size)``; ``TypeError``/``ValueError`` otherwise.

    Pads are masked out of attention and loss, so any id the embedding looks up works (EOS for GPT-2)."""
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


Spec = tuple[tuple[int, ...], np.dtype]
"""``(shape, numpy dtype)`` of one tensor."""
SpecKey = tuple[tuple[int, ...], int, tuple[tuple[str, np.dtype], ...]]
"""What a rank's specs depend on: token shape, slot count ``K`` and the extras' ``(key, dtype)``."""


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
    """:func:`rank_specs` as ``(key, spec)`` items, cached per :data:`SpecKey`."""
    tokens = [*((key, _BOOL if key == PADDING_MASK else _I64) for key in STANDARD_TOKEN_KEYS), *extras]
    metadata = zip(METADATA_KEYS, ((k + 1,), (k + 1,), (k,), (k,), ()), strict=True)
    return (*((key, (shape, dt)) for key, dt in tokens), *((key, (size, _I32)) for key, size in metadata))


def _gather(stream: Stream, positions: np.ndarray, out: dict[str, np.ndarray]) -> None:
    """Write the token tensors at non-decreasing stream ``positions`` int64 ``[N]`` into ``out``.

    One ``searchsorted`` splits the positions into the ``2K`` segments of
    :attr:`~cpdata.worker.stream.Stream.segments`; each per-segment value is one ``repeat``. Pads read past
    the real elements (the padding mask), ``mode="clip"`` landing on the pad elements; next-token targets
    read ``ids[src + 1]`` unless pieces carry labels. ~12 numpy calls and 8 passes over the positions."""
    k2, out_ids = 2 * stream.slot_lens.shape[0], out[INPUT_IDS]
    shape, tab = out_ids.shape, stream.segments
    cuts = positions.searchsorted(tab[: k2 + 1])  # [2K + 1], the last N
    counts = cuts[1:] - cuts[:-1]
    per_slot = counts[0::2] + counts[1::2]  # positions in each slot
    out[DOCUMENT_IDS][...] = np.arange(k2 // 2, dtype=np.int64).repeat(per_slot).reshape(shape)
    src = tab[k2 + 1 : 2 * k2 + 1].repeat(counts)
    src += positions
    src = src.reshape(shape)
    buffer, w = stream.buffer, stream.buffer.total  # pads read ids[W]
    ids = buffer.ids
    pad = np.greater_equal(src, w, out=out[PADDING_MASK])  # only pads read past the real elements
    ids[: w + 1].take(src, out=out_ids, mode="clip")
    if stream.padding_token_id != ids[w]:
        np.copyto(out_ids, stream.padding_token_id, where=pad)
    # without labels, next-token targets: the element after each piece is its next_label, pads read ids[W + 1]
    labels = (ids[1:] if buffer.labels is None else buffer.labels).take(src, out=out[LABELS], mode="clip")
    position_ids = np.add(tab[2 * k2 + 1 :].repeat(counts).reshape(shape), positions.reshape(shape),
                          out=out[POSITION_IDS])  # fmt: skip
    if stream.pads_pass_end:  # some slot's pads would pass S - 1
        np.minimum(position_ids, stream.row_len - 1, out=position_ids, where=pad)
    for key, arr in stream.extras.items():
        arr.take(src, out=out[key], mode="clip")
    if stream.derived_mask is not None:  # pieces without a loss mask: labels != -100
        derived = stream.derived_mask.repeat(per_slot).reshape(shape)
        np.copyto(out[LOSS_MASK], np.not_equal(labels, IGNORE_INDEX), where=derived)


def fill_rank(
    stream: Stream, rows_r: np.ndarray, qkv_format: str, out: dict[str, np.ndarray], increasing: bool | None = None
) -> None:  # fmt: skip
    """Fill ``out`` (laid out by :func:`rank_specs`) with one rank's tensors at a trusted int64 ``[L]``
    ``rows_r``; metadata are the stream's own.

    ``increasing``: whether ``rows_r`` never decreases (every layout's row does); None checks it. Other
    rows are gathered sorted and put back (an ``argsort``)."""
    positions = rows_r
    if qkv_format == "bshd" and stream.rows > 1:  # every row's columns, as positions of the B*S stream
        positions = (np.arange(stream.rows, dtype=np.int64)[:, None] * stream.row_len + rows_r).reshape(-1)
    if increasing is None:
        increasing = bool((positions[1:] >= positions[:-1]).all())
    if increasing:
        _gather(stream, positions, out)
    else:
        keys = [*STANDARD_TOKEN_KEYS, *stream.extras]  # what _gather writes
        order = np.argsort(positions, kind="stable")
        part = {key: np.empty(positions.shape, dtype=out[key].dtype) for key in keys}
        _gather(stream, positions[order], part)
        back = np.argsort(order)  # position i was gathered at back[i]
        for key in keys:
            out[key][...] = part[key][back].reshape(out[key].shape)
    for key, value in stream.metadata.items():
        out[key][...] = value


def collate_pack(
    plans: Sequence[PackPlan], *, padding_token_id: int = 0, qkv_format: str = "bshd"
) -> dict[str, np.ndarray]:
    """The full batch: token tensors ``[B, S]`` (bshd) or ``[B*S]`` (thd) plus stream metadata."""
    return collate_rank(plans, None, padding_token_id=padding_token_id, qkv_format=qkv_format)


def collate_rank(
    plans: Sequence[PackPlan],
    rows_r: np.ndarray | None,
    *,
    padding_token_id: int = 0,
    qkv_format: str = "bshd",
) -> dict[str, np.ndarray]:
    """One rank's tensors: ``collate_pack(...)[key][..., rows_r]`` for token keys, bit for bit, plus the
    full (global) stream metadata; :func:`fill_rank` into new arrays.

    ``rows_r``: int ``[L]`` this rank's global positions in local order: columns of every row (bshd, result
    ``[B, L]``) or stream positions (thd, result ``[L]``) of the ``B`` ``plans`` (equal capacity ``S``);
    checked. None: every position (:func:`collate_pack`)."""
    check_qkv_format(qkv_format)
    stream = build_streams([(plans, padding_token_id)]).streams[0]
    row_len = stream.row_len if qkv_format == "bshd" else stream.rows * stream.row_len
    if rows_r is None:
        rows_r, increasing = np.arange(row_len, dtype=np.int64), True
    else:
        rows_r, increasing = np.asarray(rows_r), None
        if rows_r.ndim != 1 or not np.issubdtype(rows_r.dtype, np.integer):
            raise ValueError(
                f"rows_r must be a 1-D integer array, got shape {rows_r.shape} dtype {rows_r.dtype}"
            )
        if rows_r.size and (rows_r.min() < 0 or rows_r.max() >= row_len):
            raise ValueError(
                f"rows_r must lie in [0, {row_len}) for qkv_format={qkv_format!r} "
                f"({stream.rows} x {stream.row_len} tokens), got range [{rows_r.min()}, {rows_r.max()}]"
            )
        rows_r = rows_r.astype(np.int64, copy=False)
    specs = rank_specs(stream, rows_r.shape[0], qkv_format)
    out = {key: np.empty(shape, dtype=dt) for key, (shape, dt) in specs.items()}
    fill_rank(stream, rows_r, qkv_format, out, increasing)
    return out


@dataclass(frozen=True, kw_only=True)
class CollatedPack:
    """``B`` plans of equal capacity, ready to collate."""

    plans: tuple[PackPlan, ...]
    """One per row (bshd) or concatenated (thd)."""
    pack_len: int
    """Tokens per plan (the capacity ``S``)."""
    qkv_format: str
    """``"bshd"`` (``[B, S]`` rows) or ``"thd"`` (flat ``[B*S]`` stream)."""
    padding_token_id: int
    """``input_ids`` value on pads."""

    @functools.cached_property
    def metadata(self) -> dict[str, np.ndarray]:
        """Stream metadata (``cu_seqlens`` & co.), computed on first read (``ShardForRank`` computes a block's
        at once and never reads this one)."""
        return pack_metadata(self.plans)

    @property
    def row_shape(self) -> tuple[int, int]:
        """``(B, S)``."""
        return (len(self.plans), self.pack_len)

    def tensors(self) -> dict[str, np.ndarray]:
        """The full batch, built now: O(B*S)."""
        return collate_pack(self.plans, padding_token_id=self.padding_token_id, qkv_format=self.qkv_format)
