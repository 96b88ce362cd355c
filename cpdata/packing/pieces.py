"""Documents to pieces: alignment and the overflow policy, vectorized over a window.

A document of ``n`` tokens takes a slot of ``ceil(n / m) * m`` (``m``: the layout's document multiple).
A slot over the capacity ``C`` follows the overflow policy (docs/packing-and-mixing.md): ``error``,
``split`` (pieces of ``C`` tokens), ``truncate`` or ``drop``. Empty documents are ``skipped``; documents
whose labels train nothing are left out (``untrained``). ``concat`` lays documents at the running offset
of the open pack and cuts at every multiple of ``C``; as ``C`` and every slot are multiples of ``m``, no
cut falls inside alignment padding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpdata.layout.maps import alignment
from cpdata.layout.runs import segments
from cpdata.packing.records import OVERFLOW_POLICIES, PackingConfig
from cpdata.worker.targets import NO_TRAINED_TARGET, UNLABELED

__all__ = ["COUNT_FIELDS", "Overlong", "OverlongDocumentError", "Pieces", "check_lengths", "cut_documents",
           "piece_continues"]  # fmt: skip

COUNT_FIELDS: tuple[str, ...] = (
    "documents",
    "skipped",
    "truncated",
    "dropped",
    "split",
    "truncated_tokens",
    "dropped_tokens",
    "untrained",
    "untrained_tokens",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Pieces:
    """The pieces cut from one window of documents, in document order (all ``[p]``)."""

    doc: np.ndarray
    """int64: position of the piece's document in the window."""
    start: np.ndarray
    """int64: offset of the piece inside its document."""
    length: np.ndarray
    """int64: real tokens."""
    slot: np.ndarray
    """int64: slot tokens (``length`` aligned, or the exact span of a piece cut at a pack boundary)."""
    continues: np.ndarray
    """bool: another piece of the same document follows this one."""

    def __len__(self) -> int:
        return int(self.doc.shape[0])


def _cut(keep: np.ndarray, origin: np.ndarray, slot: np.ndarray, real: np.ndarray, capacity: int) -> Pieces:
    """Cut document ``keep[d]`` (slot ``[origin[d], origin[d] + slot[d])``, every ``slot > 0``) at every
    multiple of ``capacity``."""
    first = origin // capacity
    n = (origin + slot - 1) // capacity - first + 1
    doc = np.repeat(np.arange(slot.shape[0], dtype=np.int64), n)
    j = segments(np.zeros_like(n), n)  # the piece's index in its document
    o = origin[doc]
    lo = np.maximum(o, (first[doc] + j) * capacity)
    hi = np.minimum(o + slot[doc], (first[doc] + j + 1) * capacity)
    length = np.minimum(hi, o + real[doc]) - lo
    assert (length > 0).all(), "a cut fell inside a document's alignment padding"
    return Pieces(doc=keep[doc], start=lo - o, length=length, slot=hi - lo, continues=j < n[doc] - 1)


def check_lengths(lengths: np.ndarray, config: PackingConfig) -> None:
    """With ``overflow="error"``: raise ``ValueError`` naming every document longer than the capacity at once.

    Run when the lengths are known up front, so an overlong document fails the build, not a step hours
    in. O(n) numpy; nothing for the other policies."""
    if config.overflow != "error":
        return
    lengths = np.asarray(lengths, dtype=np.int64)
    m, cap = config.doc_multiple, config.capacity
    slots = -(-lengths // m) * m
    over = np.flatnonzero(slots > cap)
    if not over.size:
        return
    first, longest = int(over[0]), int(over[np.argmax(lengths[over])])
    pack_multiple = alignment(config.layout, config.cp_size)[1]
    enough = -(-int(slots[longest]) // pack_multiple) * pack_multiple  # a capacity the layout accepts
    overlong = Overlong(first, int(lengths[first]), int(slots[first]), m, cap)
    all_of = (f"{over.size} of {lengths.size} documents are longer than the capacity (first: "
              f"{over[:8].tolist()}; longest: document {longest} with {int(lengths[longest])} tokens); "
              f"raise the capacity (to {enough} for all)")  # fmt: skip
    raise ValueError(overlong.message(hint="", all_of=all_of))


_STREAM_HINT = (
    "This source does not state its lengths up front, so each document is checked when it is read; "
    "to name every overlong document at once, check the lengths first (cpdata.plan_lengths(lengths, "
    "capacity=..., layout=..., cp_size=...) raises naming them all), or give the pipeline a source "
    "whose lengths are known (cpdata.open_dataset(path), a datasets.Dataset, a list): it is checked "
    "when the pipeline is built"
)


@dataclass(frozen=True, slots=True)
class Overlong:
    """The numbers of a document longer than the capacity: stream ``index``, ``tokens``, aligned ``slot``."""

    index: int
    tokens: int
    slot: int
    multiple: int
    capacity: int

    def message(self, where: str | None = None, hint: str = _STREAM_HINT,
                all_of: str = "raise the capacity") -> str:  # fmt: skip
        """The error naming ``where`` (default: the index), ``all_of`` (the count, when known), ``hint``."""
        others = [p for p in OVERFLOW_POLICIES if p != "error"]
        return (
            f"{where or f'document {self.index}'} has {self.tokens} tokens ({self.slot} after aligning to a "
            f"multiple of {self.multiple}), more than capacity={self.capacity}; {all_of} or pass overflow= "
            f"one of {others} (choices: {list(OVERFLOW_POLICIES)})" + (f". {hint}" if hint else "")
        )


class OverlongDocumentError(ValueError):
    """A document longer than the capacity under ``overflow="error"``, met while reading a stream.

    ``overlong`` carries the numbers, so a stage that knows the document's origin (a mix) can name it."""

    def __init__(self, message: str, *, overlong: Overlong | None = None) -> None:
        super().__init__(message)
        self.overlong = overlong


def cut_documents(
    lengths: np.ndarray,
    config: PackingConfig,
    *,
    source_index: np.ndarray,
    fill: int = 0,
    first_target: np.ndarray | None = None,
) -> tuple[Pieces, dict[str, int]]:
    """One window of documents (int64 ``[k]`` ``lengths``) as pieces, aligned and under the overflow policy,
    and the window's :data:`COUNT_FIELDS` counters; ``doc`` indexes ``lengths``.

    ``source_index`` (int64 ``[k]``) names documents in errors; ``fill``: ``concat``'s slot tokens already in
    the open pack; ``first_target``: each document's :func:`cpdata.worker.targets.first_target` (None: all
    unlabeled)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cap, m = config.capacity, config.doc_multiple
    slot = -(-lengths // m) * m
    empty = lengths == 0
    over = slot > cap
    counts = dict.fromkeys(COUNT_FIELDS, 0)
    counts.update(documents=int(lengths.shape[0]), skipped=int(empty.sum()))
    kept, untrained = lengths, np.zeros(lengths.shape[0], dtype=bool)
    if over.any():
        first = int(np.flatnonzero(over)[0])
        if config.overflow == "error":
            overlong = Overlong(int(source_index[first]), int(lengths[first]), int(slot[first]), m, cap)
            raise OverlongDocumentError(overlong.message(), overlong=overlong)
        if config.overflow == "drop":
            counts.update(dropped=int(over.sum()), dropped_tokens=int(lengths[over].sum()))
            empty = empty | over
        elif config.overflow == "truncate":
            kept = np.where(over, cap, lengths)
    if first_target is not None and int(np.max(first_target, initial=UNLABELED)) >= NO_TRAINED_TARGET:
        # some document has labels (else nothing is untrained); a truncated document's last kept token loses
        # its target (the next token was cut off)
        first_target = np.asarray(first_target, dtype=np.int64)
        last = np.where(kept < lengths, kept - 1, kept)
        untrained = ~empty & ((first_target == NO_TRAINED_TARGET) | ((first_target >= 0) & (first_target >= last)))
        counts.update(untrained=int(untrained.sum()), untrained_tokens=int(lengths[untrained].sum()))
        empty = empty | untrained
    if config.overflow == "truncate":  # a document left out as untrained is not counted as truncated
        cut = over & ~untrained
        counts.update(truncated=int(cut.sum()), truncated_tokens=int((lengths[cut] - cap).sum()))
        lengths, slot = kept, np.where(over, cap, slot)
    keep = np.flatnonzero(~empty)
    if config.algorithm == "concat":
        origin = fill + np.cumsum(slot[keep]) - slot[keep]
    else:
        origin = np.zeros(keep.shape[0], dtype=np.int64)
    pieces = _cut(keep, origin, slot[keep], lengths[keep], cap)
    counts["split"] = int(np.count_nonzero(pieces.continues & (pieces.start == 0)))
    return pieces, counts


def piece_continues(doc_index: np.ndarray, doc_start: np.ndarray, doc_len: np.ndarray) -> np.ndarray:
    """bool ``[n_pieces]``: the piece's document goes on in the piece starting where it ends (O(n log n))."""
    order = np.lexsort((doc_start, doc_index))
    d, s, n = doc_index[order], doc_start[order], doc_len[order]
    follows = np.zeros(order.shape[0], dtype=bool)
    follows[:-1] = (d[1:] == d[:-1]) & (s[1:] == s[:-1] + n[:-1])
    out = np.empty_like(follows)
    out[order] = follows
    return out
