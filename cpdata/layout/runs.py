"""Run tables: a layout as runs of consecutive global positions, in global order.

Every layout gives each document (table row ``d``) ``G`` runs that tile it in global order (``thd``: its ``2cp``
chunks; ``balanced``: ``cp`` heads, ``2cp`` one-token middles of which the first ``m`` are real, ``cp`` tails),
each with its rank and *inverse shift* (its rank-major position minus its global start). A rank's runs are in
increasing global order, so its row, the inverse map and the causal work per rank follow without sorting or
scattering. ``balanced`` deals its padding one token at a time after the runs (a strided tail).
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["RunBlock", "RunTable", "Table", "contiguous_runs", "first_of_runs", "segments"]


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


def _per_run(x: np.ndarray, g: int) -> np.ndarray:
    """int64 ``[N, g]``: ``x`` ``[N]`` repeated across each row's ``g`` runs, contiguous (a broadcast
    ``x[:, None]`` operand costs numpy one inner loop per row, a contiguous one a single loop)."""
    return x.repeat(g).reshape(-1, g)


def _per_pack(lens: np.ndarray, counts: np.ndarray | None) -> list[np.ndarray]:
    """``lens`` int64 ``[N]`` split into the packs' ``counts`` int64 ``[P]`` slots (None: one pack)."""
    return [lens] if counts is None else np.split(lens, np.cumsum(counts)[:-1])


def _within_packs(x: np.ndarray, counts: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Exclusive running sums of the rows of ``x`` int64 ``[k, N]`` restarted at every pack (int64 ``[k, N]``)
    and each pack's totals (int64 ``[k, P]``); ``counts`` int64 ``[P]`` (None: one pack)."""
    cs = np.zeros((x.shape[0], x.shape[1] + 1), dtype=np.int64)
    np.cumsum(x, axis=1, out=cs[:, 1:])
    if counts is None:
        return cs[:, :-1], cs[:, -1:]
    stops = counts.cumsum()
    firsts = cs[:, stops - counts]
    return cs[:, :-1] - firsts.repeat(counts, axis=1), cs[:, stops] - firsts


def first_of_runs(a: np.ndarray) -> np.ndarray:
    """bool mask of the first element of every run of equal values."""
    return np.concatenate([[True], a[1:] != a[:-1]]) if a.size else np.zeros(0, dtype=bool)


def segments(starts: np.ndarray, sizes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[sum(sizes)]``: ``arange(s, s + n)`` of every ``(s, n)`` pair, concatenated (into ``out``: a
    layout's row or inverse, whose ``arange`` is cached per length)."""
    offsets = sizes.cumsum()
    total = int(offsets[-1]) if offsets.size else 0
    if total == 0:
        return np.zeros(0, dtype=np.int64) if out is None else out
    steps = np.arange(total, dtype=np.int64) if out is None else _arange(total)
    return np.add((starts - offsets + sizes).repeat(sizes), steps, out=out)


class Table:
    """What every one-pack layout table derives from its ``lens`` (int64 ``[D]`` slot lengths, None without
    documents) and ``row(rank, out)``; its block (:class:`RunBlock`, :class:`~cpdata.layout.spans.SpanBlock`)
    gives the packs' causal work."""

    __slots__ = ()
    lens: np.ndarray | None
    pack_len: int
    cp_size: int

    @property
    def doc_starts(self) -> np.ndarray | None:
        """int64 ``[D]``: global offset of each document; None without documents."""
        lens = self.lens
        return None if lens is None else lens.cumsum() - lens

    def rows(self) -> np.ndarray:
        """int64 ``[cp, local_len]``: every rank's row, each written in place."""
        out = np.empty((self.cp_size, self.pack_len // self.cp_size), dtype=np.int64)
        for r in range(self.cp_size):
            self.row(r, out[r])
        return out


class RunBlock:
    """The runs of ``P`` packs of ``pack_len`` tokens, their ``N`` documents pack after pack (read-only arrays).

    ``counts`` int64 ``[P]`` documents per pack (None: one pack); int64 ``[N, G]`` ``sizes`` (tokens per run, 0
    allowed), ``inv_shifts``, ``ranks`` (or ``[G]``, the same for every row) and ``ends`` (in the document; None
    for layouts that ignore documents, with ``lens``); ``picks`` int64 ``[cp, K, w]``: the columns of rank ``r``'s
    ``w`` runs per row in variant ``pick_key[d]`` (None: 0); ``tails``, ``dealts``: each pack's (None: 0).
    """

    __slots__ = ("pack_len", "cp_size", "counts", "sizes", "inv_shifts", "ranks", "picks", "pick_key", "ends",
                 "lens", "tails", "dealts", "_flat", "_by_rank")  # fmt: skip

    def __init__(self, pack_len: int, cp_size: int, counts: np.ndarray | None, sizes: np.ndarray,
                 inv_shifts: np.ndarray, ranks: np.ndarray, picks: np.ndarray, pick_key: np.ndarray | None = None,
                 ends: np.ndarray | None = None, lens: np.ndarray | None = None, tails: list[int] | None = None,
                 dealts: list[int] | None = None) -> None:  # fmt: skip
        self.pack_len, self.cp_size, self.counts, self.sizes = pack_len, cp_size, counts, sizes
        self.inv_shifts, self.ranks, self.picks, self.pick_key = inv_shifts, ranks, picks, pick_key
        self.ends, self.lens, self.tails, self.dealts = ends, lens, tails, dealts
        self._flat = (inv_shifts.reshape(-1), sizes.reshape(-1))
        self._by_rank: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tables(self) -> list[RunTable]:
        """The ``P`` packs' tables (new views on every call; the block holds none, so no reference cycle)."""
        stops = [self.sizes.shape[0]] if self.counts is None else self.counts.cumsum().tolist()
        zeros = [0] * len(stops)
        return [RunTable(self, lo, hi, tail, dealt) for lo, hi, tail, dealt
                in zip([0, *stops[:-1]], stops, self.tails or zeros, self.dealts or zeros, strict=True)]  # fmt: skip

    def rank_runs(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Inverse shifts and sizes (int64 ``[N * w]``) of ``rank``'s runs, row after row, in row order
        (picked for every pack the first time, then kept)."""
        got = self._by_rank.get(rank)
        if got is None:
            picks = self.picks[rank]
            if self.pick_key is None:  # the same columns in every row
                inv, sizes = self.inv_shifts.take(picks[0], axis=1), self.sizes.take(picks[0], axis=1)
            else:
                at = picks.take(self.pick_key, axis=0)  # [N, w] columns, then flat indices:
                at += np.arange(0, self.sizes.size, self.sizes.shape[1]).repeat(at.shape[1]).reshape(at.shape)
                inv, sizes = self.inv_shifts.take(at), self.sizes.take(at)
            got = self._by_rank[rank] = (inv.reshape(-1), sizes.reshape(-1))
        return got

    def doc_counts(self) -> list[int]:
        """Documents of each pack that :meth:`causal_work` takes a real length for (a pack's table rows)."""
        return [self.sizes.shape[0]] if self.counts is None else self.counts.tolist()

    def causal_work(self, real: np.ndarray) -> np.ndarray:
        """float64 ``[P, cp]``: causal document-masked attention work of each rank of every pack (``real`` int64
        ``[N]``; with documents). A real token at offset ``o`` attends to ``o + 1`` keys, so a run costs
        ``W(end) - W(previous end)``, ``W(e) = e(e + 1) / 2`` (ends clipped to the real length): integers,
        doubled, summed exactly by one ``bincount`` over ``pack * cp + rank``."""
        ends, ranks, counts, cp_size = self.ends, self.ranks, self.counts, self.cp_size
        assert ends is not None, "layout runs without documents"
        n_packs, g = (1 if counts is None else counts.shape[0]), ends.shape[1]
        if ends.shape[0] == 0:  # (with one pack; a block of several has documents or [N, G] ranks)
            return np.zeros((n_packs, cp_size), dtype=np.float64)
        ends = np.minimum(ends, _per_run(real, g))
        twice = ends + 1
        twice *= ends  # 2 W(end) [N, G]
        if ranks.ndim == 1:
            if counts is None:
                twice = twice.sum(axis=0, keepdims=True)
            else:
                twice = np.add.reduceat(twice, np.cumsum(counts) - counts, axis=0)  # [P, G]
            keys = ranks if counts is None else _arange(n_packs, cp_size)[:, None] + ranks
        elif counts is None:
            keys = ranks
        else:
            keys = _arange(n_packs, cp_size).repeat(counts * g).reshape(-1, g) + ranks
        flat = twice.reshape(-1)
        cost = np.empty_like(flat)  # a run's 2 W(end) minus its row predecessor's
        np.subtract(flat[1:], flat[:-1], out=cost[1:])
        cost[:: twice.shape[1]] = twice[:, 0]  # each row's first run has none
        work = np.bincount(keys.reshape(-1), cost, minlength=n_packs * cp_size)  # keys: twice's shape
        return (work / 2).reshape(n_packs, cp_size)


class RunTable(Table):
    """One pack's layout: rows ``[lo, hi)`` of a :class:`RunBlock`.

    ``tail``: padding tokens after the runs, dealt round-robin one at a time (``balanced``; 0 elsewhere), the
    first to rank ``dealt % cp``; each rank's row ends with its share.
    """

    __slots__ = ("block", "lo", "hi", "pack_len", "cp_size", "tail", "dealt")

    def __init__(self, block: RunBlock, lo: int, hi: int, tail: int = 0, dealt: int = 0) -> None:
        self.block, self.lo, self.hi, self.tail, self.dealt = block, lo, hi, tail, dealt
        self.pack_len, self.cp_size = block.pack_len, block.cp_size

    @property
    def lens(self) -> np.ndarray | None:
        """int64 ``[D]``: the documents' slot lengths; None without documents."""
        lens = self.block.lens
        return None if lens is None else lens[self.lo : self.hi]

    def row(self, rank: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[local_len]``: global positions of ``rank``'s tokens in local order (into ``out``)."""
        cp, p = self.cp_size, self.pack_len
        local = p // cp
        out = np.empty(local, dtype=np.int64) if out is None else out
        # rank's tail tokens: round-robin indices t in [dealt, dealt + tail) with t % cp == rank
        mine = (self.dealt + self.tail + cp - 1 - rank) // cp - (self.dealt + cp - 1 - rank) // cp
        n = local - mine
        if n:
            inv, sizes = self.block.rank_runs(rank)
            w = self.block.picks.shape[2]
            lo, hi = self.lo * w, self.hi * w
            # a run's row positions are rank * local + arange - its inverse shift
            np.subtract(_arange(p)[rank * local : rank * local + n], inv[lo:hi].repeat(sizes[lo:hi]), out=out[:n])
        if mine:
            first = p - self.tail + (rank - self.dealt) % cp
            np.add(_arange(local, cp)[:mine], first, out=out[n:])
        return out

    def inverse(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[pack_len]``: ``inverse[g]`` = position of global token ``g`` in the rank-major
        concatenation (into ``out``). Tail token ``dealt + k`` follows its rank's
        ``(pack_len - tail - dealt) / cp`` run tokens and ``(dealt + k) // cp`` earlier dealt ones."""
        cp, p = self.cp_size, self.pack_len
        out = np.empty(p, dtype=np.int64) if out is None else out
        n = p - self.tail
        if n:
            inv, sizes = self.block._flat
            g = self.block.sizes.shape[1]
            lo, hi = self.lo * g, self.hi * g
            np.add(inv[lo:hi].repeat(sizes[lo:hi]), _arange(p)[:n], out=out[:n])
        if self.tail:
            np.add(_dealt(cp, p // cp)[self.dealt : self.dealt + self.tail], (n - self.dealt) // cp, out=out[n:])
        return out


@functools.lru_cache(maxsize=16)
def contiguous_runs(cp_size: int, pack_len: int) -> RunTable:
    """``contiguous``/``identity``: rank ``r`` owns ``[r*L, (r+1)*L)`` (one table per shape, cached)."""
    ranks = _arange(cp_size)
    sizes = np.full((1, cp_size), pack_len // cp_size, dtype=np.int64)
    inv = np.zeros((1, cp_size), dtype=np.int64)
    picks = ranks.reshape(cp_size, 1, 1)
    _frozen(sizes, inv)
    return RunBlock(pack_len, cp_size, None, sizes, inv, ranks, picks).tables()[0]
