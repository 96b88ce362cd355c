"""Run tables: every CP rank's row of a layout as runs of consecutive global positions.

A layout gives rank ``r`` a few runs per document (``thd``: two chunks;
``balanced``: head, up to two middle tokens, tail) in the rank's local order.
The table holds them as ``[cp, C]`` arrays (rank-major, local order inside a
rank; runs of size 0 where a document gives a rank nothing) with each run's
*shift* (its global start minus its offset in the rank's row) and the order of
all runs by global position. ``balanced`` deals its padding token by token
after the runs (a strided tail, not one run per pad token). Everything the
worker needs follows from the table without sorting, searching or scattering:

- a rank's row: ``repeat(shift, size) + arange`` over its runs (:meth:`RunTable.row`,
  two numpy calls, O(local tokens));
- the inverse map: the same over all runs in global order, each shifted by
  ``rank * local_len - shift`` (:meth:`RunTable.inverse`, O(pack tokens));
- the causal work per rank in closed form per run (:meth:`RunTable.causal_work`,
  O(runs)) when the runs know their document.

Cost: the builders are ~10 (``thd``) and ~25 (``balanced``) numpy calls on
``[cp, documents, 2 or 4]`` arrays whatever the pack size; at 8K tokens (~12
documents) that fixed cost dominates, at 32K cp 4 (~49 documents, ~800 runs)
the O(pack) ``repeat`` of the inverse does (~30 us). The builders take
validated lengths; :func:`cpdata.layouts.layout_runs` validates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["RunTable", "balanced_runs", "contiguous_runs", "head_tail_runs", "segments"]


def _frozen(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


@functools.lru_cache(maxsize=16)
def _arange(n: int, step: int = 1) -> np.ndarray:
    """int64 ``[n]``: ``0, step, 2*step, ...`` (read-only, cached per pack length; callers slice it)."""
    out = np.arange(n, dtype=np.int64) * step
    _frozen(out)
    return out


@functools.lru_cache(maxsize=8)
def _dealt(cp_size: int, local_len: int) -> np.ndarray:
    """int64 ``[cp * local_len + 2cp]``: ``(t % cp) * local_len + t // cp``, the rank-major offset of the
    ``t``-th token dealt round-robin (up to the per-rank tokens before it)."""
    t = np.arange(cp_size * (local_len + 2), dtype=np.int64)
    out = t % cp_size * local_len + t // cp_size
    _frozen(out)
    return out


def segments(starts: np.ndarray, sizes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every ``(s, n)`` pair: int64 ``[sum(sizes)]``, O(pairs + total).

    One ``repeat`` of the run offsets, one add of a cached ``arange`` (written
    into ``out`` when given).
    """
    offsets = sizes.cumsum()
    total = int(offsets[-1]) if offsets.size else 0
    if total == 0:
        return np.zeros(0, dtype=np.int64) if out is None else out
    return np.add((starts - offsets + sizes).repeat(sizes), np.arange(total, dtype=np.int64), out=out)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunTable:
    """One layout of one pack as runs.

    Attributes:
        pack_len: tokens in the pack (a multiple of ``cp``).
        starts: int64 ``[cp, C]``, global first position of run ``j`` of rank ``r``,
            in the rank's local order.
        sizes: int64 ``[cp, C]``, tokens per run (0 allowed).
        shifts: int64 ``[cp, C]``, ``starts`` minus the run's offset in its rank's row.
        order: int64 ``[cp * C]``, flat indices of the runs sorted by global
            start (runs of size > 0 tile ``[0, pack_len - tail)`` in that order).
        tail: padding tokens at the end of the pack dealt round-robin one at a
            time after the runs (``balanced``; 0 elsewhere): each rank's row ends
            with its share, every ``cp``-th of them.
        dealt: round-robin index of the first tail token (rank ``dealt % cp`` takes it).
        doc: int64 ``[C]``, the document (slot) of column ``j``'s runs (the
            same for every rank); None for layouts that ignore documents.
        doc_starts: int64 ``[n_docs]``, global offset of each document; None with ``doc``.
        offsets: int64 ``[cp, C]``, each run's first position inside its document; None with ``doc``.
    """

    pack_len: int
    starts: np.ndarray
    sizes: np.ndarray
    shifts: np.ndarray
    order: np.ndarray
    tail: int = 0
    dealt: int = 0
    doc: np.ndarray | None = None
    doc_starts: np.ndarray | None = None
    offsets: np.ndarray | None = None

    @property
    def cp_size(self) -> int:
        return int(self.starts.shape[0])

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[local_len]``: global positions of ``rank``'s tokens in local order (into ``out``)."""
        cp = self.cp_size
        local = self.pack_len // cp
        out = np.empty(local, dtype=np.int64) if out is None else out
        # rank's tail tokens: round-robin indices t in [dealt, dealt + tail) with t % cp == rank
        mine = (self.dealt + self.tail + cp - 1 - rank) // cp - (self.dealt + cp - 1 - rank) // cp
        n = local - mine
        np.add(self.shifts[rank].repeat(self.sizes[rank]), _arange(self.pack_len)[:n], out=out[:n])
        if mine:
            first = self.pack_len - self.tail + (rank - self.dealt) % cp
            np.add(_arange(local, cp)[:mine], first, out=out[n:])
        return out

    def rows(self) -> np.ndarray:
        """int64 ``[cp, local_len]``: every rank's row."""
        out = np.empty((self.cp_size, self.pack_len // self.cp_size), dtype=np.int64)
        for r in range(self.cp_size):
            self.row(r, out[r])
        return out

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of global token ``g`` in the rank-major
        concatenation (into ``out``).

        A run of rank ``r`` lands at ``r * local_len + (start - shift)``, so its
        inverse shift is ``r * local_len - shift``; the runs in global order
        then give the map like :meth:`row`. Tail token ``dealt + k`` of rank
        ``(dealt + k) % cp`` follows that rank's ``(pack_len - tail - dealt) / cp``
        run tokens and its ``(dealt + k) // cp`` earlier dealt tokens.
        """
        cp, p = self.cp_size, self.pack_len
        out = np.empty(p, dtype=np.int64) if out is None else out
        local = p // cp
        inv_shifts = (_arange(cp, local)[:, None] - self.shifts).reshape(-1).take(self.order)
        n = p - self.tail
        np.add(inv_shifts.repeat(self.sizes.reshape(-1).take(self.order)), _arange(p)[:n], out=out[:n])
        if self.tail:
            np.add(_dealt(cp, local)[self.dealt : self.dealt + self.tail], (n - self.dealt) // cp, out=out[n:])
        return out

    def causal_work(self, real_lens: np.ndarray) -> np.ndarray:
        """float64 ``[cp]``: causal document-masked attention work of each rank.

        A real token at offset ``o`` of its document attends to ``o + 1`` keys;
        padding costs 0. ``real_lens`` int64 ``[>= n_docs]``: real tokens of each
        document (the first ``n_docs`` are used). Needs ``doc``. A run covering
        real offsets ``[a, e)`` costs ``(e - a)(e + a + 1) / 2``.
        """
        assert self.doc is not None and self.offsets is not None, "layout runs without documents"
        if self.doc.size == 0:
            return np.zeros(self.cp_size, dtype=np.float64)
        n = np.asarray(real_lens, dtype=np.int64).take(self.doc)  # [C]
        a = np.minimum(self.offsets, n)
        e = np.minimum(self.offsets + self.sizes, n)
        return (((e - a) * (e + a + 1)).sum(axis=1) // 2).astype(np.float64)


def contiguous_runs(cp_size: int, pack_len: int) -> RunTable:
    """``contiguous``/``identity``: rank ``r`` owns ``[r*L, (r+1)*L)``."""
    local = pack_len // cp_size
    starts = _arange(cp_size, local)[:, None]
    return RunTable(pack_len=pack_len, starts=starts, sizes=np.full_like(starts, local),
                    shifts=starts, order=_arange(cp_size))  # fmt: skip


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
    _frozen(order, doc)
    return order, doc


@functools.lru_cache(maxsize=16)
def _head_tail_coefs(cp_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 ``[cp, 1, 2]``: chunk index of rank ``r``'s head and tail (``r``, ``2cp-1-r``), that minus
    the chunks before it in the row (``r``, ``2cp-2-r``), and ones."""
    r = np.arange(cp_size, dtype=np.int64)
    chunk = np.stack([r, 2 * cp_size - 1 - r], axis=1)[:, None, :]
    before = chunk - np.array([0, 1])
    ones = np.ones_like(chunk)
    _frozen(chunk, before, ones)
    return chunk, before, ones


def head_tail_runs(slot_lens: np.ndarray, cp_size: int, with_docs: bool) -> RunTable:
    """Chunks ``r`` and ``2cp-1-r`` of every slot (``slot_lens`` int64 ``[S]``, each a multiple of 2cp).

    ``round_robin`` is this with one slot (the whole pack) and ``with_docs=False``;
    ``thd`` with the document slots (tail absorbed). Columns ``2d``, ``2d+1``:
    document ``d``'s head and tail chunk of each rank. Slot ``d`` of ``c``
    tokens per chunk starts at ``s``: rank ``r``'s runs start at ``s + r*c`` and
    ``s + (2cp-1-r)*c`` and sit at ``s/cp`` and ``s/cp + c`` in its row.
    """
    n_docs = slot_lens.size
    chunk, before, ones = _head_tail_coefs(cp_size)
    c = (slot_lens // (2 * cp_size))[:, None]  # [S, 1]
    ends = slot_lens.cumsum()
    doc_starts = ends - slot_lens
    s = doc_starts[:, None]
    offsets = (chunk * c).reshape(cp_size, -1)
    starts = offsets + doc_starts.repeat(2)
    shifts = (before * c + (s - s // cp_size)).reshape(cp_size, -1)
    order, doc = _head_tail_order(cp_size, n_docs)
    return RunTable(pack_len=int(ends[-1]) if n_docs else 0, starts=starts, sizes=(ones * c).reshape(cp_size, -1), shifts=shifts,
                    order=order, doc=doc if with_docs else None, doc_starts=doc_starts if with_docs else None,
                    offsets=offsets if with_docs else None)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _balanced_coefs(cp_size: int) -> dict[str, np.ndarray]:
    """Constant tables of :func:`balanced_runs` (columns: head, middle 1, middle 2, tail).

    ``ranks`` ``[cp, 1]``; ``deal`` ``[4]`` added to ``k1`` (head and tail never
    below a remainder < 2cp); per-column factors of ``q`` ``[cp, 1, 4]``, of
    the dealt token ``[4]``, of ``m`` ``[4]`` and of the head/tail size ``[4]``;
    ``rank_of`` ``[cp, 4cp]`` and ``column`` ``[4cp]``: the rank and column of
    a document's runs in global order, for each round-robin pointer.
    """
    cp = cp_size
    r = np.arange(cp, dtype=np.int64)
    j = np.arange(2 * cp)
    rank_of = np.concatenate([np.broadcast_to(r, (cp, cp)), (r[:, None] + j) % cp, np.broadcast_to(r[::-1], (cp, cp))],
                             axis=1)  # fmt: skip
    tables = {
        "ranks": r[:, None],
        "deal": np.array([2 * cp, 0, cp, 2 * cp]),
        "of_q": np.stack([r, np.full(cp, cp), np.full(cp, cp), 2 * cp - 1 - r], axis=1)[:, None, :],
        "of_k": np.array([0, 1, 1, 0]),
        "of_m": np.array([0, 0, 0, 1]),
        "edge": np.array([1, 0, 0, 1]),
        "rank_of": rank_of,
        "column": np.concatenate([np.zeros(cp), 1 + j // cp, np.full(cp, 3)]).astype(np.int64),
    }
    _frozen(*tables.values())
    return tables


def balanced_runs(lens: np.ndarray, pack_len: int, cp_size: int) -> RunTable:
    """``balanced`` (see :func:`cpdata.layouts.rank_indices`): four runs per rank and document, then padding.

    Document ``d`` of ``n = 2cp*q + m`` tokens: rank ``r`` owns head chunk ``r``
    (``q`` tokens, column ``4d``), the middle tokens ``k1`` and ``k1 + cp`` when
    they exist (columns ``4d+1``, ``4d+2``; ``k1 = (r - ptr_d) % cp``, ``ptr_d``
    the round-robin pointer carried across documents), and tail chunk
    ``2cp-1-r`` (column ``4d+3``). The pack's padding continues the pointer one
    token at a time (the table's ``tail``).
    """
    cp, n_docs = cp_size, lens.size
    k = _balanced_coefs(cp)
    q, m = np.divmod(lens, 2 * cp)
    ends, dealt_ends = lens.cumsum(), m.cumsum()
    doc_starts, dealt_before = ends - lens, dealt_ends - m
    k1 = (k["ranks"] - dealt_before) % cp  # [cp, D]
    deal = k1[:, :, None] + k["deal"]  # [cp, D, 4]: 2cp, k1, k1 + cp, 2cp
    sizes = ((deal < m[:, None]) + q[:, None] * k["edge"]).reshape(cp, -1)
    offsets = (q[:, None] * k["of_q"] + deal * k["of_k"] + m[:, None] * k["of_m"]).reshape(cp, -1)
    starts = offsets + doc_starts.repeat(4)
    shifts = starts - sizes.cumsum(axis=1) + sizes
    order = (k["rank_of"].take(dealt_before % cp, axis=0) * (4 * n_docs) + k["column"]
             + _doc_columns(n_docs, 4)).reshape(-1)  # fmt: skip
    used = int(ends[-1]) if n_docs else 0
    return RunTable(pack_len=pack_len, starts=starts, sizes=sizes, shifts=shifts, order=order, tail=pack_len - used,
                    dealt=int(dealt_ends[-1]) if n_docs else 0, doc=_doc_of_columns(n_docs, 4),
                    doc_starts=doc_starts, offsets=offsets)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _doc_of_columns(n_docs: int, per_doc: int) -> np.ndarray:
    """int64 ``[n_docs * per_doc]``: the document of each column."""
    out = np.arange(n_docs, dtype=np.int64).repeat(per_doc)
    _frozen(out)
    return out


@functools.lru_cache(maxsize=256)
def _doc_columns(n_docs: int, per_doc: int) -> np.ndarray:
    """int64 ``[n_docs, 1]``: the first column of each document."""
    out = np.arange(0, n_docs * per_doc, per_doc, dtype=np.int64)[:, None]
    _frozen(out)
    return out
