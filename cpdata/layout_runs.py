"""Run tables: every CP rank's row of a layout as runs of consecutive global positions.

A layout gives rank ``r`` a few runs per document (``thd``: two chunks;
``balanced``: head, up to two middle tokens, tail) in the rank's local order.
The table holds them as ``[cp, C]`` arrays (rank-major, local order inside a
rank; runs of size 0 where a document gives a rank nothing), plus the order of
all runs by global position. Everything the worker needs follows from the
table without sorting, searching or scattering tokens:

- a rank's row: ``arange(start, start + size)`` of its runs, concatenated
  (:meth:`RunTable.row`, O(local tokens));
- the inverse map: the runs taken in global order, each mapped to its offset
  in the rank-major concatenation (:meth:`RunTable.inverse`, O(pack tokens));
- the causal work per rank in closed form per run (:meth:`RunTable.causal_work`,
  O(runs)) when the runs know their document.

Cost at 32K tokens, ~49 documents, cp 4: the table is ~800 runs; building it
is a handful of numpy calls on ``[cp, documents, 4]`` arrays. The builders
take validated lengths; :func:`cpdata.layouts.layout_runs` validates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["RunTable", "balanced_runs", "contiguous_runs", "head_tail_runs", "segments"]


@functools.lru_cache(maxsize=8)
def _arange(n: int) -> np.ndarray:
    out = np.arange(n, dtype=np.int64)
    out.flags.writeable = False
    return out


def segments(starts: np.ndarray, sizes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every ``(s, n)`` pair: int64 ``[sum(sizes)]``, O(pairs + total).

    One ``repeat`` of the run offsets, one add of a cached ``arange`` (written
    into ``out`` when given).
    """
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64) if out is None else out
    offsets = np.cumsum(sizes) - sizes
    return np.add(np.repeat(starts - offsets, sizes), _arange(total), out=out)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunTable:
    """One layout of one pack as runs.

    Attributes:
        starts: int64 ``[cp, C]``, global first position of run ``j`` of rank ``r``,
            in the rank's local order.
        sizes: int64 ``[cp, C]``, tokens per run (0 allowed); every rank's sizes
            sum to ``local_len``.
        order: int64 ``[cp * C]``, flat indices of the runs sorted by global
            start (runs tile ``[0, pack_len)`` in that order).
        doc: int64 ``[C]``, the document (slot) of column ``j``'s runs (the
            same for every rank), -1 for padding past the documents; None for
            layouts that ignore documents.
        doc_starts: int64 ``[n_docs]``, global offset of each document; None with ``doc``.
    """

    starts: np.ndarray
    sizes: np.ndarray
    order: np.ndarray
    doc: np.ndarray | None = None
    doc_starts: np.ndarray | None = None

    @property
    def cp_size(self) -> int:
        return int(self.starts.shape[0])

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[local_len]``: global positions of ``rank``'s tokens in local order (into ``out``)."""
        return segments(self.starts[rank], self.sizes[rank], out)

    def rows(self) -> np.ndarray:
        """int64 ``[cp, local_len]``: every rank's row (one pass over all runs)."""
        return segments(self.starts.reshape(-1), self.sizes.reshape(-1)).reshape(self.cp_size, -1)

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of global token ``g`` in the rank-major
        concatenation (into ``out``)."""
        sizes = self.sizes.reshape(-1)
        local_offsets = np.cumsum(sizes) - sizes
        return segments(local_offsets[self.order], sizes[self.order], out)

    def causal_work(self, real_lens: np.ndarray) -> np.ndarray:
        """float64 ``[cp]``: causal document-masked attention work of each rank.

        A real token at offset ``o`` of its document attends to ``o + 1`` keys;
        padding costs 0. ``real_lens`` int ``[>= n_docs]``: real tokens of each
        document (the first ``n_docs`` are used). Needs ``doc``.
        """
        assert self.doc is not None and self.doc_starts is not None, "layout runs without documents"
        if self.doc_starts.size == 0:
            return np.zeros(self.cp_size, dtype=np.float64)
        doc = np.maximum(self.doc, 0)
        n = np.where(self.doc >= 0, np.asarray(real_lens, dtype=np.int64)[doc], 0)  # [C]
        offset = self.starts - self.doc_starts[doc]  # [cp, C]
        a = np.minimum(offset, n)
        b = np.minimum(offset + self.sizes, n)
        return (b * (b + 1) // 2 - a * (a + 1) // 2).sum(axis=1).astype(np.float64)


def contiguous_runs(cp_size: int, pack_len: int) -> RunTable:
    """``contiguous``/``identity``: rank ``r`` owns ``[r*L, (r+1)*L)``."""
    local = pack_len // cp_size
    starts = (np.arange(cp_size, dtype=np.int64) * local)[:, None]
    return RunTable(starts=starts, sizes=np.full_like(starts, local), order=np.arange(cp_size, dtype=np.int64))


@functools.lru_cache(maxsize=256)
def _head_tail_order(cp_size: int, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat run indices of a head-tail table in global order, and the document of each column.

    Chunk ``j`` of a document belongs to rank ``j`` (head, column ``2d``) for
    ``j < cp`` and to rank ``2cp-1-j`` (tail, column ``2d + 1``) after.
    """
    ranks = np.concatenate([np.arange(cp_size), np.arange(cp_size - 1, -1, -1)])
    kinds = np.repeat([0, 1], cp_size)
    order = ((ranks * (n_docs * 2))[None, :] + (np.arange(n_docs) * 2)[:, None] + kinds[None, :]).reshape(-1)
    doc = np.repeat(np.arange(n_docs, dtype=np.int64), 2)
    order.flags.writeable = doc.flags.writeable = False
    return order, doc


def head_tail_runs(slot_lens: np.ndarray, cp_size: int, with_docs: bool) -> RunTable:
    """Chunks ``r`` and ``2cp-1-r`` of every slot (``slot_lens`` int64 ``[S]``, each a multiple of 2cp).

    ``round_robin`` is this with one slot (the whole pack) and ``with_docs=False``;
    ``thd`` with the document slots (tail absorbed). Columns ``2d``, ``2d+1``:
    document ``d``'s head and tail chunk of each rank.
    """
    n_docs = slot_lens.size
    chunk = slot_lens // (2 * cp_size)
    doc_starts = np.cumsum(slot_lens) - slot_lens
    r = np.arange(cp_size, dtype=np.int64)[:, None]
    starts = np.empty((cp_size, n_docs, 2), dtype=np.int64)
    starts[:, :, 0] = doc_starts + r * chunk
    starts[:, :, 1] = doc_starts + (2 * cp_size - 1 - r) * chunk
    sizes = np.empty_like(starts)
    sizes[...] = chunk[None, :, None]
    order, doc = _head_tail_order(cp_size, n_docs)
    return RunTable(starts=starts.reshape(cp_size, -1), sizes=sizes.reshape(cp_size, -1), order=order,
                    doc=doc if with_docs else None, doc_starts=doc_starts if with_docs else None)  # fmt: skip


def balanced_runs(lens: np.ndarray, pack_len: int, cp_size: int) -> RunTable:
    """``balanced`` (see :func:`cpdata.layouts.rank_indices`): four runs per rank and document, then padding.

    Document ``d`` of ``n = 2cp*q + m`` tokens: rank ``r`` owns head chunk ``r``
    (``q`` tokens, column ``4d``), the middle tokens ``k1`` and ``k1 + cp`` when
    they exist (columns ``4d+1``, ``4d+2``; ``k1 = (r - ptr_d) % cp``, ``ptr_d``
    the round-robin pointer carried across documents), and tail chunk
    ``2cp-1-r`` (column ``4d+3``). The pack's padding continues the pointer one
    token at a time: one column of 1-token runs per ``cp`` pad tokens.
    """
    two, n_docs = 2 * cp_size, lens.size
    base = lens // two
    rem = lens - base * two
    dealt = int(rem.sum())
    ptr = (np.cumsum(rem) - rem) % cp_size
    doc_starts = np.cumsum(lens) - lens
    middle = doc_starts + cp_size * base
    r = np.arange(cp_size, dtype=np.int64)[:, None]
    k1 = (r - ptr) % cp_size  # [cp, n_docs]
    pad = pack_len - int(doc_starts[-1] + lens[-1] if n_docs else 0)
    own = 4 * n_docs
    width = own + -(-pad // cp_size)
    starts = np.empty((cp_size, width), dtype=np.int64)
    sizes = np.empty((cp_size, width), dtype=np.int64)
    s4, z4 = starts[:, :own].reshape(cp_size, n_docs, 4), sizes[:, :own].reshape(cp_size, n_docs, 4)
    s4[:, :, 0] = doc_starts + r * base
    s4[:, :, 1] = middle + k1
    s4[:, :, 2] = s4[:, :, 1] + cp_size
    s4[:, :, 3] = middle + rem + (cp_size - 1 - r) * base
    z4[:, :, 0] = base
    z4[:, :, 1] = k1 < rem
    z4[:, :, 2] = k1 + cp_size < rem
    z4[:, :, 3] = base
    # global order inside a document: heads of ranks 0..cp-1, middle tokens j (rank (ptr+j)%cp, column 1 + j//cp), tails
    j = np.arange(two)
    col = (np.arange(n_docs) * 4)[:, None]
    order = np.empty((n_docs, 4 * cp_size), dtype=np.int64)
    order[:, :cp_size] = np.arange(cp_size) * width + col
    order[:, cp_size : 3 * cp_size] = (ptr[:, None] + j) % cp_size * width + col + 1 + j // cp_size
    order[:, 3 * cp_size :] = np.arange(cp_size - 1, -1, -1) * width + col + 3
    order = order.reshape(-1)
    doc = np.full(width, -1, dtype=np.int64)
    doc[:own] = np.repeat(np.arange(n_docs, dtype=np.int64), 4)
    if pad:
        i = (r - dealt) % cp_size + cp_size * np.arange(width - own)
        starts[:, own:] = pack_len - pad + i
        sizes[:, own:] = i < pad
        k = np.arange(pad)
        order = np.concatenate([order, (dealt + k) % cp_size * width + own + k // cp_size])
    return RunTable(starts=starts, sizes=sizes, order=order, doc=doc, doc_starts=doc_starts)
