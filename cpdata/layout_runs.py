"""Run tables: a layout as runs of consecutive global positions, in global order.

Every layout gives each document (row ``d`` of the table) ``G`` runs that
tile it in global order (``thd``: its ``2cp`` chunks; ``balanced``: ``cp``
heads, ``2cp`` one-token middle runs of which the first ``m`` are real, ``cp``
tails), each with its rank and its *inverse shift* (its position in the
rank-major concatenation of all shards minus its global start). Each rank's
runs are in increasing global order, so a rank's row is its runs in table
order. ``balanced`` deals its padding one token at a time after the runs (a
strided tail, not one run per pad token). Everything the worker needs follows
without sorting, searching or scattering:

- the inverse map: ``repeat(inv_shifts, sizes) + arange`` (:meth:`RunTable.inverse`, O(pack tokens));
- a rank's row: its ``D * w`` runs picked by index, then the same (:meth:`RunTable.row`, O(local tokens));
- the causal work per rank in closed form per run (:meth:`RunTable.causal_work`, O(runs)).

Cost: the builders are ~15 numpy calls whatever the pack size, most on
``[D]`` vectors: the parts of the ``[D, G]`` tables that are not linear in a
document's length come from a table cached per ``(cp, local length)`` and
indexed by one key per document, so a builder does one ``take``, one outer
product and two adds on the ``[D, G]`` tables. The builders take validated
lengths; :func:`cpdata.layouts.layout_runs` validates.
"""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=64)
def _row_starts(n_docs: int, width: int) -> np.ndarray:
    """int64 ``[n_docs, 1]``: the flat index of each table row's first run."""
    out = np.arange(0, n_docs * width, width, dtype=np.int64)[:, None]
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


class RunTable:
    """One layout of one pack as runs in global order (read-only arrays; see the module docstring).

    Attributes:
        pack_len: tokens in the pack (a multiple of ``cp``).
        cp_size: CP ranks.
        sizes: int64 ``[D, G]``: tokens per run (0 allowed); row ``d`` tiles document ``d``, the rows tile
            ``[0, pack_len - tail)``.
        inv_shifts: int64 ``[D, G]``: a run's position in the rank-major concatenation minus its global start.
        ranks: int64 ``[D, G]`` or ``[G]`` (the same for every row): the rank owning each run.
        picks: int64 ``[cp, K, w]``: columns of rank ``r``'s ``w`` runs per row, ``K`` variants.
        pick_key: int64 ``[D]``: the variant of each row (None: variant 0 for every row).
        offsets: int64 ``[D, G]``: each run's first position inside its document (a row's runs tile it in
            column order, empty runs included); None for layouts that ignore documents.
        lens: int64 ``[D]``: the documents' slot lengths (None with ``offsets``).
        tail: padding tokens after the runs dealt round-robin one at a time (``balanced``; 0 elsewhere):
            each rank's row ends with its share, every ``cp``-th of them.
        dealt: round-robin index of the first tail token (rank ``dealt % cp`` takes it).
    """

    __slots__ = ("pack_len", "cp_size", "sizes", "inv_shifts", "ranks", "picks", "pick_key", "offsets", "lens",
                 "tail", "dealt")  # fmt: skip

    def __init__(self, pack_len: int, cp_size: int, sizes: np.ndarray, inv_shifts: np.ndarray, ranks: np.ndarray,
                 picks: np.ndarray, pick_key: np.ndarray | None = None, offsets: np.ndarray | None = None,
                 lens: np.ndarray | None = None, tail: int = 0, dealt: int = 0) -> None:  # fmt: skip
        self.pack_len, self.cp_size, self.sizes, self.inv_shifts = pack_len, cp_size, sizes, inv_shifts
        self.ranks, self.picks, self.pick_key, self.offsets, self.lens = ranks, picks, pick_key, offsets, lens
        self.tail, self.dealt = tail, dealt

    @property
    def doc(self) -> np.ndarray | None:
        """int64 ``[D]``: the document of each table row (row ``d`` is document ``d``); None without documents."""
        return None if self.offsets is None else _arange(self.sizes.shape[0])

    @property
    def doc_starts(self) -> np.ndarray | None:
        """int64 ``[D]``: global offset of each document; None without documents."""
        return None if self.lens is None else self.lens.cumsum() - self.lens

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[local_len]``: global positions of ``rank``'s tokens in local order (into ``out``)."""
        cp, p = self.cp_size, self.pack_len
        local = p // cp
        out = np.empty(local, dtype=np.int64) if out is None else out
        # rank's tail tokens: round-robin indices t in [dealt, dealt + tail) with t % cp == rank
        mine = (self.dealt + self.tail + cp - 1 - rank) // cp - (self.dealt + cp - 1 - rank) // cp
        n = local - mine
        if n:
            picks = self.picks[rank]
            if self.pick_key is None:  # the same columns in every row
                inv, sizes = self.inv_shifts.take(picks[0], axis=1), self.sizes.take(picks[0], axis=1)
            else:
                at = picks.take(self.pick_key, axis=0)
                at += _row_starts(*self.sizes.shape)  # [D, w] flat indices of the rank's runs
                inv, sizes = self.inv_shifts.take(at), self.sizes.take(at)
            # a run's row positions are rank * local + arange - its inverse shift
            inv = inv.reshape(-1).repeat(sizes.reshape(-1))
            np.subtract(_arange(p)[rank * local : rank * local + n], inv, out=out[:n])
        if mine:
            first = p - self.tail + (rank - self.dealt) % cp
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

        The runs in table order tile the pack up to its dealt tail: ``repeat`` their
        inverse shifts plus ``arange``. Tail token ``dealt + k`` of rank
        ``(dealt + k) % cp`` follows that rank's ``(pack_len - tail - dealt) / cp``
        run tokens and its ``(dealt + k) // cp`` earlier dealt tokens.
        """
        cp, p = self.cp_size, self.pack_len
        out = np.empty(p, dtype=np.int64) if out is None else out
        n = p - self.tail
        if n:
            np.add(self.inv_shifts.reshape(-1).repeat(self.sizes.reshape(-1)), _arange(p)[:n], out=out[:n])
        if self.tail:
            np.add(_dealt(cp, p // cp)[self.dealt : self.dealt + self.tail], (n - self.dealt) // cp, out=out[n:])
        return out

    def causal_work(self, real_lens: np.ndarray) -> np.ndarray:
        """float64 ``[cp]``: causal document-masked attention work of each rank.

        A real token at offset ``o`` of its document attends to ``o + 1`` keys;
        padding costs 0. ``real_lens`` int64 ``[>= D]``: real tokens of each
        document (the first ``D`` are used). Needs ``offsets``. The real tokens
        before offset ``e`` cost ``W(e) = e(e + 1) / 2``. When every slot is real
        a run of ``s`` tokens from ``o`` costs ``s(2o + s + 1) / 2``; else a row's
        runs tile its document in column order, so a run costs ``W(end)`` minus
        the ``W(end)`` of the run before it, ends clipped to the real length
        (for ranks that are the same in every row, after summing the rows). The
        doubled costs are integers, summed per rank exactly (below 2**53).
        """
        assert self.offsets is not None and self.lens is not None, "layout runs without documents"
        d = self.lens.shape[0]
        if d == 0:
            return np.zeros(self.cp_size, dtype=np.float64)
        real = np.asarray(real_lens, dtype=np.int64)[:d]
        if self.ranks.ndim == 2 and (real == self.lens).all():  # no run is cut (balanced: slots are pieces)
            twice = self.offsets * 2
            twice += self.sizes
            twice += 1
            twice *= self.sizes
        else:  # (thd pads every slot: not worth the check)
            ends = self.offsets + self.sizes
            np.minimum(ends, real[:, None], out=ends)
            twice = ends + 1
            twice *= ends  # 2 W(end) [D, G]
            if self.ranks.ndim == 1:
                twice = twice.sum(axis=0)
                np.subtract(twice[1:], twice[:-1], out=twice[1:])  # numpy buffers the overlap
            else:
                np.subtract(twice[:, 1:], twice[:, :-1], out=twice[:, 1:])
        ranks = self.ranks if self.ranks.ndim == 1 else self.ranks.reshape(-1)
        return np.bincount(ranks, twice.reshape(-1), minlength=self.cp_size) / 2


@functools.lru_cache(maxsize=16)
def _contiguous(cp_size: int, pack_len: int) -> RunTable:
    local = pack_len // cp_size
    ranks = _arange(cp_size)
    sizes = np.full((1, cp_size), local, dtype=np.int64)
    inv = np.zeros((1, cp_size), dtype=np.int64)
    picks = ranks.reshape(cp_size, 1, 1)
    _frozen(sizes, inv)
    return RunTable(pack_len, cp_size, sizes, inv, ranks, picks)


def contiguous_runs(cp_size: int, pack_len: int) -> RunTable:
    """``contiguous``/``identity``: rank ``r`` owns ``[r*L, (r+1)*L)`` (one table per shape, cached)."""
    return _contiguous(cp_size, pack_len)


@functools.lru_cache(maxsize=32)
def _head_tail_coefs(cp_size: int, local_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Constants of :func:`head_tail_runs` (column ``j``: chunk ``j``, rank ``j`` or ``2cp-1-j``).

    ``of_c`` int64 ``[3, 2cp]``: per chunk length, the inverse shift, size and offset in the
    document (``[j >= cp] - j``, 1, ``j``); ``base`` ``[2cp]``: ``rank * local_len``; ``ranks``
    ``[2cp]``; ``picks`` ``[cp, 1, 2]``: rank ``r``'s chunks ``r`` and ``2cp-1-r``.
    """
    cp = cp_size
    j = np.arange(2 * cp, dtype=np.int64)
    ranks = np.minimum(j, 2 * cp - 1 - j)
    of_c = np.stack([(j >= cp) - j, np.ones_like(j), j])[:, None, :]
    picks = np.stack([j[:cp], 2 * cp - 1 - j[:cp]], axis=1)[:, None, :]
    base = ranks * local_len
    _frozen(of_c, base, ranks, picks)
    return of_c, base, ranks, picks


def head_tail_runs(slot_lens: np.ndarray, cp_size: int, with_docs: bool, pack_len: int | None = None) -> RunTable:
    """Chunks ``r`` and ``2cp-1-r`` of every slot (``slot_lens`` int64 ``[D]``, each a multiple of 2cp).

    ``round_robin`` is this with one slot (the whole pack) and ``with_docs=False``;
    ``thd`` with the document slots (tail absorbed). Slot ``d`` of ``c`` tokens
    per chunk, ``C`` chunk tokens before it: chunk ``j`` starts at ``2cp*C + j*c``
    and sits at ``2C + [j >= cp]*c`` in the row of its rank.
    """
    cp = cp_size
    if pack_len is None:
        pack_len = int(slot_lens.sum())
    of_c, base, ranks, picks = _head_tail_coefs(cp, pack_len // cp)
    c = slot_lens // (2 * cp)
    before = c.cumsum()
    before -= c  # C
    table = np.multiply(c[None, :, None], of_c)  # [3, D, 2cp]: inverse shifts, sizes, offsets
    inv = table[0]
    inv += base
    inv += ((2 - 2 * cp) * before)[:, None]
    return RunTable(pack_len, cp, table[1], inv, ranks, picks, offsets=table[2] if with_docs else None,
                    lens=slot_lens if with_docs else None)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _balanced_coefs(cp_size: int, local_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Constants of :func:`balanced_runs`: columns ``G = 4cp`` per document (heads ``c``, middles ``t``, tails ``i``).

    ``nonlinear`` int64 ``[4, 2cp*cp, G]``, indexed by ``key = (T % cp) * 2cp + m`` (``T`` tokens dealt
    before the document, ``m`` its remainder): what is not linear in ``q``, ``Q`` and ``T`` of the
    inverse shift (``rank * local`` plus the dealt tokens of that rank before the run, minus ``T // cp``,
    and ``-t``, ``-m``), the size (middles: ``t < m``), the offset in the document (middles ``min(t, m)``:
    the empty ones where the real ones end, so a row's runs tile it; tails ``m``) and the rank (middles ``(T + t) % cp``). ``of_q`` ``[3, 1, G]``: per ``q``, the inverse
    shift, size and offset. ``picks`` ``[cp, cp, 4]``: rank ``r``'s head, two middles and tail for
    each ``T % cp``.
    """
    cp, local = cp_size, local_len
    c = np.arange(cp, dtype=np.int64)
    t = np.arange(2 * cp, dtype=np.int64)
    i = c
    rho = np.repeat(c, 2 * cp)[:, None]  # T % cp of each key
    m = np.tile(t, cp)[:, None]  # remainder of each key
    u = rho + t  # dealt index of each middle minus cp * (T // cp)
    zero = np.zeros((rho.shape[0], cp), dtype=np.int64)
    nonlinear = np.stack([
        np.concatenate([local * c + (c < rho), local * (u % cp) + u // cp - t, local * (cp - 1 - i) + (rho + m + i) // cp - m], axis=1),
        np.concatenate([zero, (t < m).astype(np.int64), zero], axis=1),
        np.concatenate([zero, np.minimum(t, m), m + zero], axis=1),
        np.concatenate([c + zero, u % cp, cp - 1 - i + zero], axis=1),
    ])  # fmt: skip
    of_q = np.stack([
        np.concatenate([-c, np.full(2 * cp, 1 - cp), 1 - cp - i]),
        np.concatenate([np.ones(cp, dtype=np.int64), np.zeros(2 * cp, dtype=np.int64), np.ones(cp, dtype=np.int64)]),
        np.concatenate([c, np.full(2 * cp, cp), cp + i]),
    ])[:, None, :]  # fmt: skip
    k1 = (c[:, None] - c[None, :]) % cp  # [rank, T % cp]: the rank's first middle
    picks = np.stack([np.broadcast_to(c[:, None], (cp, cp)), cp + k1, 2 * cp + k1,
                      np.broadcast_to(4 * cp - 1 - c[:, None], (cp, cp))], axis=2)  # fmt: skip
    _frozen(nonlinear, of_q, picks)
    return nonlinear, of_q, picks


def balanced_runs(lens: np.ndarray, pack_len: int, cp_size: int) -> RunTable:
    """``balanced`` (see :func:`cpdata.layouts.rank_indices`): ``4cp`` runs per document, then padding.

    Document ``d`` of ``n = 2cp*q + m`` tokens, ``T`` remainder tokens dealt
    before it, ``Q`` head tokens per rank before it: rank ``r`` owns head chunk
    ``r`` (``q`` tokens), the middle tokens ``t < m`` with ``(T + t) % cp == r``
    and tail chunk ``2cp-1-r``. In rank ``r``'s row the document starts at
    ``2Q`` plus the ``r``-tokens among the first ``T`` dealt ones; a middle
    token ``u = T + t`` of the deal sits at ``2Q + q + u // cp``. The pack's
    padding continues the deal one token at a time (the table's ``tail``).
    """
    cp, d = cp_size, lens.shape[0]
    nonlinear, of_q, picks = _balanced_coefs(cp, pack_len // cp)
    q, m = np.divmod(lens, 2 * cp)
    dealt = m.cumsum()
    dealt -= m  # T
    heads = q.cumsum()
    heads -= q  # Q
    shift, rho = np.divmod(dealt, cp)
    key = rho * (2 * cp)
    key += m
    table = nonlinear.take(key, axis=1)  # [4, D, 4cp]: inverse shifts, sizes, offsets, ranks
    table[:3] += q[None, :, None] * of_q
    shift += (2 - 2 * cp) * heads - dealt  # (2 - 2cp) Q - T + T // cp
    table[0] += shift[:, None]
    total_dealt = int(dealt[-1] + m[-1]) if d else 0
    used = 2 * cp * int(heads[-1] + q[-1]) + total_dealt if d else 0
    return RunTable(pack_len, cp, table[1], table[0], table[3], picks, pick_key=rho, offsets=table[2], lens=lens,
                    tail=pack_len - used, dealt=total_dealt)  # fmt: skip
