"""K/V exchange plans: which keys each CP rank needs from each other rank (pure numpy, any layout).

Under a document-causal mask a query at global position ``q`` of slot ``d``
attends to the keys ``slot_start(d) <= k <= q``. Rank ``dst`` therefore needs,
from every other rank ``src``, the keys of every slot it holds a query of, up
to that slot's last query on ``dst``, that ``src`` owns::

    need(src -> dst) = { k owned by src : slot(k) = d, k <= max{q on dst : slot(q) = d} }

Padding is no document: a slot's positions from its real end on (``real_ends``;
the pack's tail, a document padded to a layout's multiple) are queries that see
their own key only, so they need nothing and count as no query of their slot
(and no real query reaches a pad key: keys are needed up to a real query).
Without ``real_ends`` every position is real (the old document-causal mask).

An all-gather delivers ``(cp-1)/cp * S`` keys to every rank; with short
documents most of them are masked out. The plan moves only the needed ones
(one ``all_to_all_single``, :mod:`cpdata.device.kv_exchange`).

Algorithm (no assumption on the layout: any ``[cp, L]`` permutation rows):

1. *runs*: maximal stretches of global positions whose rank-major index steps
   by one (one ``diff`` over the inverse map, O(S)), cut where a rank's row
   starts;
2. *pieces*: the runs cut at every slot boundary and real end (of every bshd
   row), sorted by global start: each piece has one owner and, in each row, one
   slot, and is all real or all padding;
3. ``last[slot, rank]``: the last real position of each slot on each rank
   (``maximum.at`` over the real pieces);
4. ``need[piece, dst]``: how many of the piece's keys ``dst`` needs: a prefix
   of the piece (keys are needed up to a position), the longest over the rows.

Everything after step 1 is O(pieces * cp * rows) on small arrays: ``balanced``
has ~4cp pieces per document, ``thd`` 2cp, ``contiguous`` one per document and
rank boundary. bshd batches of ``B`` rows share one layout over the columns, so
the plan is the union of the rows' needs (every row's keys travel together).

A rank's view (:class:`RankExchange`) is a few runs of host ints: what it sends
(runs of its local indices, grouped by destination rank) and what it receives
(runs of global positions, grouped by source rank), both in increasing global
position within each pair, so the ``i``-th key ``src`` sends to ``dst`` is the
``i``-th key ``dst`` receives from ``src``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdata.errors import check_int, is_int
from cpdata.layout.maps import inverse_indices

__all__ = [
    "ExchangePlan", "RankExchange", "exchange_plan", "exchange_plan_of_inverse", "exchange_plan_of_runs",
    "expand_runs", "kv_recv_fraction",
]  # fmt: skip

_I64 = np.int64


def expand_runs(runs: np.ndarray) -> np.ndarray:
    """int64 ``[sum(lengths)]``: ``arange(start, start + length)`` of every ``(start, length)`` row of
    ``runs`` (int64 ``[n, 2]``), concatenated in order."""
    starts, sizes = runs[:, 0], runs[:, 1]
    offsets = sizes.cumsum()
    total = int(offsets[-1]) if offsets.size else 0
    if total == 0:
        return np.zeros(0, dtype=_I64)
    return (starts - offsets + sizes).repeat(sizes) + np.arange(total, dtype=_I64)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RankExchange:
    """What one CP rank sends and receives in the K/V exchange (host ints only; travels in ``ShardLayout``).

    Attributes:
        cp_size: CP ranks of the plan.
        cp_rank: the rank this view belongs to.
        send_counts: keys sent to each rank (``cp_size`` ints, 0 to itself): the all-to-all's input splits.
        send_runs: int64 ``[n, 2]``: ``(local index start, length)`` runs of the keys sent, grouped by
            destination rank in rank order, increasing global position inside each group.
        recv_counts: keys received from each rank (``cp_size`` ints, 0 from itself): the output splits.
        recv_runs: int64 ``[m, 2]``: ``(global position start, length)`` runs of the keys received, grouped
            by source rank in rank order, increasing inside each group.

    Positions are stream positions (thd: the flat stream; bshd: columns, shared by the rows).
    """

    cp_size: int
    cp_rank: int
    send_counts: tuple[int, ...]
    send_runs: np.ndarray
    recv_counts: tuple[int, ...]
    recv_runs: np.ndarray

    @property
    def n_send(self) -> int:
        """Keys this rank sends in all."""
        return sum(self.send_counts)

    @property
    def n_recv(self) -> int:
        """Keys this rank receives in all."""
        return sum(self.recv_counts)

    def send_index(self) -> np.ndarray:
        """int64 ``[n_send]``: the local index of every key sent, in send order."""
        return expand_runs(self.send_runs)

    def recv_positions(self) -> np.ndarray:
        """int64 ``[n_recv]``: the global position of every key received, in receive order."""
        return expand_runs(self.recv_runs)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExchangePlan:
    """Every rank's K/V needs of one batch, as pieces (see the module docstring).

    Attributes:
        cp_size: CP ranks.
        local_len: tokens per rank ``L``.
        starts: int64 ``[n]``: global start of each piece, increasing.
        lengths: int64 ``[n]``: its tokens (>= 1).
        owners: int64 ``[n]``: the rank owning it.
        local_starts: int64 ``[n]``: the owner's local index of its first token (the rest follow by one).
        need: int64 ``[n, cp]``: keys of the piece (a prefix of it) each rank needs from its owner; 0 on
            the owner's own column.
    """

    cp_size: int
    local_len: int
    starts: np.ndarray
    lengths: np.ndarray
    owners: np.ndarray
    local_starts: np.ndarray
    need: np.ndarray

    def recv_counts(self) -> np.ndarray:
        """int64 ``[cp, cp]``: ``[dst, src]`` keys ``dst`` receives from ``src`` (one ``bincount``)."""
        cp = self.cp_size
        pair = self.owners.repeat(cp).reshape(-1, cp) * cp + np.arange(cp, dtype=_I64)  # [n, cp]: src * cp + dst
        counts = np.bincount(pair.reshape(-1), weights=self.need.reshape(-1), minlength=cp * cp)
        return counts.astype(_I64).reshape(cp, cp).T.copy()

    def rank(self, r: int) -> RankExchange:
        """Rank ``r``'s :class:`RankExchange`."""
        cp = self.cp_size
        if not is_int(r) or not 0 <= r < cp:
            raise ValueError(f"rank must be an int in [0, cp_size={cp}), got {r!r}")
        mine = np.flatnonzero(self.owners == r)
        sent = self.need[mine]  # [pieces of r, cp]
        send_counts = sent.sum(axis=0).tolist()
        flat = sent.T.ravel()  # by destination, increasing positions inside
        keep = np.flatnonzero(flat)
        send_runs = np.empty((keep.size, 2), dtype=_I64)
        if keep.size:
            send_runs[:, 0] = self.local_starts[mine[keep % mine.size]]
            send_runs[:, 1] = flat[keep]
        got = self.need[:, r]
        at = np.flatnonzero(got)
        owners = self.owners[at]
        recv_counts = np.bincount(owners, weights=got[at], minlength=cp).tolist()
        at = at[owners.argsort(kind="stable")]  # by source rank, increasing positions inside
        recv_runs = np.empty((at.size, 2), dtype=_I64)
        recv_runs[:, 0], recv_runs[:, 1] = self.starts[at], got[at]
        return RankExchange(cp_size=cp, cp_rank=int(r), send_counts=tuple(send_counts), send_runs=send_runs,
                            recv_counts=tuple(int(c) for c in recv_counts), recv_runs=recv_runs)  # fmt: skip


def _runs(inverse: np.ndarray, cp: int, local: int) -> np.ndarray:
    """int64 ``[runs]``: the first position of every run of the layout, increasing: stretches whose
    rank-major index (``inverse``) steps by one, cut where a rank's row starts."""
    stream = inverse.shape[0]
    cut = np.empty(stream, dtype=bool)
    cut[0] = True
    np.not_equal(inverse[1:] - inverse[:-1], 1, out=cut[1:])
    at = np.flatnonzero(cut)
    if cp == 1:
        return at
    # a run may go on from one rank's last token to the next rank's first: cut where index r * L sits
    first = inverse[at]
    order = first.argsort(kind="stable")
    bounds = np.arange(local, stream, local, dtype=_I64)
    run = order[first[order].searchsorted(bounds, side="right") - 1]
    return _sorted_union(at, at[run] + (bounds - first[run]))


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sorted distinct values of ``a`` and ``b`` (int64; a sort, not numpy 2's hash-based ``unique``,
    which costs ~0.7 ms on 3K values)."""
    out = np.concatenate([a, b])
    out.sort()
    keep = np.empty(out.size, dtype=bool)
    keep[:1] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


def exchange_plan(rows: np.ndarray, slot_starts: np.ndarray, *, n_rows: int = 1,
                  real_ends: np.ndarray | None = None) -> ExchangePlan:  # fmt: skip
    """The K/V exchange of a layout under the document-causal mask of its slots.

    Args:
        rows: int ``[cp, L]``: every rank's global positions in local order (what
            :func:`cpdata.layout.maps.rank_indices` returns; any permutation of ``range(cp * L)``).
        slot_starts: int ``[K]``: the first stream position of every document slot, increasing, over the
            ``n_rows * cp * L`` positions of the batch's ``n_rows`` rows laid end to end (the stream's
            ``slot_starts``; ``cu_seqlens_padded[:-1]``). Each row's first position starts a slot; pads
            belong to their slot (they are queries and keys like any token).
        n_rows: bshd rows sharing the layout over their columns (1 for a thd stream or one pack).
        real_ends: int ``[K]``: where each slot's real tokens end (``slot_starts + real lengths``, the
            stream's ``real_ends``; ``cu_seqlens_padded[:-1] + diff(cu_seqlens)``); the positions from there
            to the next slot are padding, which needs no key. None: every position is real.

    Returns:
        The :class:`ExchangePlan`; ``plan.rank(r)`` is rank ``r``'s part.

    Deterministic (a function of the arguments alone: every CP rank computes the same plan).
    :func:`exchange_plan_of_inverse` takes the layout's inverse map instead (what a worker already holds).
    """
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(f"rows must be int [cp, L] with L >= 1, got shape {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= rows.size):
        raise ValueError(f"rows must hold positions in [0, {rows.size}) (a permutation of range(cp * L))")
    return exchange_plan_of_inverse(inverse_indices(rows), rows.shape[0], slot_starts, n_rows=n_rows,
                                    real_ends=real_ends)  # fmt: skip


def _checked_real_ends(real_ends: Any, slot_starts: np.ndarray, stream: int, n_rows: int) -> np.ndarray | None:
    """``real_ends`` as int64 ``[K]`` (each in ``[its slot's start, the next slot's start]``), or ``ValueError``."""
    if real_ends is None:
        return None
    ends = np.asarray(real_ends, dtype=_I64).reshape(-1)
    nxt = np.empty_like(slot_starts)
    nxt[:-1], nxt[-1:] = slot_starts[1:], n_rows * stream
    if ends.shape != slot_starts.shape or (ends < slot_starts).any() or (ends > nxt).any():
        raise ValueError(
            f"real_ends must give every one of the {slot_starts.size} slots the end of its real tokens, between "
            f"its start and the next slot's, got {ends[:16].tolist()}...; pass the stream's real_ends "
            "(cu_seqlens_padded[:-1] + diff(cu_seqlens))"
        )
    return ends


def _checked(inverse: Any, cp_size: Any, slot_starts: Any, n_rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(inverse, slot_starts)`` as int64 arrays, or ``ValueError`` naming the bad argument."""
    inverse = np.asarray(inverse, dtype=_I64).reshape(-1)
    cp, stream = check_int("cp_size", cp_size, min=1), inverse.shape[0]
    if stream == 0 or stream % cp:
        raise ValueError(f"the inverse map covers {stream} positions, not a positive multiple of cp_size={cp}")
    return inverse, _checked_slots(slot_starts, stream, n_rows)


def _checked_slots(slot_starts: Any, stream: int, n_rows: Any) -> np.ndarray:
    """``slot_starts`` as int64 ``[K]`` over ``n_rows`` rows of ``stream`` positions, or ``ValueError``."""
    check_int("n_rows", n_rows, min=1, fix=" (bshd rows sharing the layout)")
    starts = np.asarray(slot_starts, dtype=_I64).reshape(-1)
    row_firsts = np.arange(n_rows, dtype=_I64) * stream
    firsts_at = starts.searchsorted(row_firsts)
    if (starts.size == 0 or (starts[1:] <= starts[:-1]).any() or starts[-1] >= n_rows * stream
            or firsts_at[-1] >= starts.size or (starts[firsts_at] != row_firsts).any()):  # fmt: skip
        raise ValueError(
            f"slot_starts must be increasing stream positions in [0, {n_rows * stream}) with every row's "
            f"first position (multiples of {stream}) among them, got {starts[:16].tolist()}...; pass the "
            "batch's cu_seqlens_padded[:-1]"
        )
    return starts


def exchange_plan_of_inverse(inverse: np.ndarray, cp_size: int, slot_starts: np.ndarray, *, n_rows: int = 1,
                             checked: bool = False, real_ends: np.ndarray | None = None) -> ExchangePlan:  # fmt: skip
    """:func:`exchange_plan` from the layout's inverse map (int64 ``[cp * L]``, ``inverse[g]`` = the rank-major
    index of global position ``g``: :func:`cpdata.layout.maps.inverse_indices`, a batch's ``gather_index``).

    ``checked=True``: ``inverse`` is an int64 inverse map and ``slot_starts`` (``real_ends``) a stream's int64
    slot offsets (real ends; the worker's, already checked), so their checks are skipped.

    Cost: one pass over the inverse (a subtraction, a compare, ``flatnonzero``), then ~25 numpy calls on
    ``[pieces, cp]`` arrays (``balanced`` ~4cp pieces per document, ``thd`` 2cp, ``contiguous`` ~1).
    """
    if not checked:
        inverse, slot_starts = _checked(inverse, cp_size, slot_starts, n_rows)
        real_ends = _checked_real_ends(real_ends, slot_starts, inverse.shape[0], n_rows)
    cp, stream = int(cp_size), inverse.shape[0]
    local = stream // cp
    starts = _sorted_union(_runs(inverse, cp, local), _cuts(slot_starts, real_ends, stream, n_rows))
    owners, local_starts = np.divmod(inverse[starts], local)
    return _pieces_plan(starts, owners, local_starts, cp, local, slot_starts, n_rows, real_ends)


def _cuts(slot_starts: np.ndarray, real_ends: np.ndarray | None, stream: int, n_rows: int) -> np.ndarray:
    """int64: the columns where pieces must be cut, every row's slot starts and real ends (unsorted; the real
    ends at the stream's end dropped)."""
    cuts = slot_starts if real_ends is None else np.concatenate([slot_starts, real_ends[real_ends < n_rows * stream]])
    return cuts - cuts // stream * stream if n_rows > 1 else cuts


def exchange_plan_of_runs(run_starts: np.ndarray, run_owners: np.ndarray, run_local_starts: np.ndarray, *,
                          cp_size: int, local_len: int, slot_starts: np.ndarray, n_rows: int = 1,
                          checked: bool = False, real_ends: np.ndarray | None = None) -> ExchangePlan:  # fmt: skip
    """:func:`exchange_plan` of a layout given as runs, with no pass over its tokens (O(runs + slots)).

    A layout built from runs (``tile``-token blocks, per-document chunks) knows them already: run ``i``
    covers global positions ``[run_starts[i], run_starts[i + 1])`` (the last one up to ``cp * L``) and
    sits on rank ``run_owners[i]`` from its local index ``run_local_starts[i]`` on. Runs need not be
    maximal (adjacent runs that continue each other give the same keys, in more pieces).

    Args:
        run_starts: int ``[R]``, increasing, from 0.
        run_owners: int ``[R]`` in ``[0, cp_size)``.
        run_local_starts: int ``[R]``; each rank's runs tile ``[0, local_len)`` of its local order.
        cp_size: CP ranks.
        local_len: tokens per rank ``L``.
        slot_starts, n_rows, real_ends: as :func:`exchange_plan`.
        checked: the runs and slots are int64 arrays known to be valid (a layout's own): skip the checks
            (a lexsort and ~15 calls).
    """
    if checked:
        starts = _sorted_union(run_starts, _cuts(slot_starts, real_ends, cp_size * local_len, n_rows))
        run = run_starts.searchsorted(starts, side="right") - 1
        return _pieces_plan(starts, run_owners[run], run_local_starts[run] + (starts - run_starts[run]), cp_size,
                            local_len, slot_starts, n_rows, real_ends)  # fmt: skip
    starts_r = np.asarray(run_starts, dtype=_I64).reshape(-1)
    owners_r = np.asarray(run_owners, dtype=_I64).reshape(-1)
    local_r = np.asarray(run_local_starts, dtype=_I64).reshape(-1)
    cp, local = check_int("cp_size", cp_size, min=1), check_int("local_len", local_len, min=1)
    stream = cp * local
    if not (starts_r.size and starts_r.shape == owners_r.shape == local_r.shape and starts_r[0] == 0
            and (starts_r[1:] > starts_r[:-1]).all() and starts_r[-1] < stream
            and owners_r.min() >= 0 and owners_r.max() < cp):  # fmt: skip
        raise ValueError(
            f"runs must be three equal-length int arrays: increasing global starts from 0 below cp_size * "
            f"local_len = {stream}, owners in [0, cp_size={cp}) and local starts; got {starts_r.size}, "
            f"{owners_r.size}, {local_r.size} runs"
        )
    lengths = np.empty_like(starts_r)
    lengths[:-1], lengths[-1] = starts_r[1:] - starts_r[:-1], stream - starts_r[-1]
    order = np.lexsort((local_r, owners_r))  # each rank's runs in local order must tile [0, L)
    expect = lengths[order].cumsum() - lengths[order] - np.repeat(np.arange(cp, dtype=_I64) * local,
                                                                  np.bincount(owners_r, minlength=cp))
    if not np.array_equal(local_r[order], expect) or not (np.bincount(owners_r, lengths, cp) == local).all():
        raise ValueError(f"every rank's runs must tile its local order [0, local_len={local}) exactly once")
    slot_starts = _checked_slots(slot_starts, stream, n_rows)
    real_ends = _checked_real_ends(real_ends, slot_starts, stream, n_rows)
    starts = _sorted_union(starts_r, _cuts(slot_starts, real_ends, stream, n_rows))
    run = starts_r.searchsorted(starts, side="right") - 1
    return _pieces_plan(starts, owners_r[run], local_r[run] + (starts - starts_r[run]), cp, local, slot_starts,
                        n_rows, real_ends)  # fmt: skip


def _pieces_plan(starts: np.ndarray, owners: np.ndarray, local_starts: np.ndarray, cp: int, local: int,
                 slot_starts: np.ndarray, n_rows: int, real_ends: np.ndarray | None) -> ExchangePlan:  # fmt: skip
    """The plan of pieces (sorted global starts, each with one owner and, in every row, one slot, all real or
    all padding there)."""
    stream = cp * local
    ends = np.empty_like(starts)
    ends[:-1], ends[-1] = starts[1:], stream
    # slot of every piece in every row (global slot ids), last position of every slot on every rank
    if n_rows == 1:
        slot = slot_starts.searchsorted(starts, side="right")[None]
    else:
        row_firsts = np.arange(n_rows, dtype=_I64) * stream
        slot = slot_starts.searchsorted(row_firsts[:, None] + starts[None, :], side="right")  # [rows, n]
    slot -= 1
    key = slot * cp
    key += owners
    last = np.full(slot_starts.size * cp, -1, dtype=_I64)  # [slot, rank] flat
    at_end = np.tile(ends - 1, n_rows) if n_rows > 1 else ends - 1
    if real_ends is not None:  # a pad piece is no query of its slot
        begin = (np.arange(n_rows, dtype=_I64)[:, None] * stream + starts[None, :]).reshape(-1)
        at_end = np.where(begin < real_ends[slot.reshape(-1)], at_end, -1)
    np.maximum.at(last, key.reshape(-1), at_end)
    reach = last.reshape(-1, cp)[slot]  # [rows, n, cp]: keys up to there are needed
    reach += 1
    np.minimum(reach, ends[None, :, None], out=reach)
    need = reach.max(axis=0) if n_rows > 1 else reach[0]
    need -= starts[:, None]
    np.maximum(need, 0, out=need)
    need[np.arange(starts.size), owners] = 0  # a rank's own keys are local
    return ExchangePlan(cp_size=cp, local_len=local, starts=starts, lengths=ends - starts, owners=owners,
                        local_starts=local_starts, need=need)  # fmt: skip


def kv_recv_fraction(plan: ExchangePlan) -> float:
    """Keys the busiest rank receives over what an all-gather delivers to it, ``(cp-1)/cp * S``
    (0.0 at cp = 1, where nothing moves)."""
    cp = plan.cp_size
    if cp == 1:
        return 0.0
    return float(plan.recv_counts().sum(axis=1).max()) / ((cp - 1) * plan.local_len)
