"""K/V exchange plans: which keys each CP rank needs from each other rank (pure numpy, any layout).

Under the document-causal mask rank ``dst`` needs from ``src`` the keys ``src`` owns of every slot ``dst`` holds
a real query of, up to that slot's last query on ``dst`` (padding, from a slot's ``real_ends`` on, sees only its
own key). The plan cuts the layout into *pieces*: runs of consecutive rank-major indices, cut again at every slot
start and real end; a piece's need from each rank is a prefix of it. An all-gather delivers ``(cp-1)/cp * S``
keys to every rank; the plan moves only the needed ones (one ``batch_isend_irecv`` with the ranks concerned,
:mod:`cpdata.device.kv_exchange`). The ``i``-th key ``src`` sends to ``dst`` is the ``i``-th ``dst`` receives.
A span table's plan comes from its runs (:func:`world_exchange`), its keys split by node by :func:`node_recv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdata.errors import check_int, is_int
from cpdata.layout.maps import inverse_indices
from cpdata.layout.runs import first_of_runs, segments
from cpdata.layout.spans import SpanTable

__all__ = [
    "ExchangePlan", "RankExchange", "exchange_plan", "exchange_plan_of_inverse", "exchange_plan_of_runs",
    "kv_recv_fraction", "node_recv", "world_exchange",
]  # fmt: skip

@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RankExchange:
    """What one CP rank sends and receives in the K/V exchange (host ints; travels in ``ShardLayout``).

    ``send_counts`` / ``recv_counts``: keys to / from each rank (the all-to-all's splits); ``send_runs`` /
    ``recv_runs``: int64 ``[n, 2]`` ``(local index | global position, length)`` runs, grouped by rank, increasing
    positions inside each group (thd: stream positions; bshd: columns, shared by the rows).
    """

    cp_size: int
    cp_rank: int
    send_counts: tuple[int, ...]
    send_runs: np.ndarray
    recv_counts: tuple[int, ...]
    recv_runs: np.ndarray

    @property
    def n_send(self) -> int:
        return sum(self.send_counts)

    @property
    def n_recv(self) -> int:
        return sum(self.recv_counts)

    def send_index(self) -> np.ndarray:
        """int64 ``[n_send]``: the local index of every key sent, in send order."""
        return segments(self.send_runs[:, 0], self.send_runs[:, 1])

    def recv_positions(self) -> np.ndarray:
        """int64 ``[n_recv]``: the global position of every key received, in receive order."""
        return segments(self.recv_runs[:, 0], self.recv_runs[:, 1])


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExchangePlan:
    """Every rank's K/V needs of one batch, as pieces: int64 ``[n]`` ``starts`` (increasing), ``lengths``,
    ``owners``, ``local_starts`` (the owner's local index of the first token), and ``need`` int64 ``[n, cp]``: the
    prefix of the piece each rank needs from its owner (0 on the owner's column)."""

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
        pair = self.owners.repeat(cp).reshape(-1, cp) * cp + np.arange(cp)  # [n, cp]: src * cp + dst
        counts = np.bincount(pair.reshape(-1), weights=self.need.reshape(-1), minlength=cp * cp)
        return counts.astype(np.int64).reshape(cp, cp).T.copy()

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
        send_runs = np.stack([self.local_starts[mine[keep % max(mine.size, 1)]], flat[keep]], axis=1)
        got = self.need[:, r]
        at = np.flatnonzero(got)
        owners = self.owners[at]
        recv_counts = np.bincount(owners, weights=got[at], minlength=cp).tolist()
        at = at[owners.argsort(kind="stable")]  # by source rank, increasing positions inside
        recv_runs = np.stack([self.starts[at], got[at]], axis=1)
        return RankExchange(cp_size=cp, cp_rank=int(r), send_counts=tuple(send_counts), send_runs=send_runs,
                            recv_counts=tuple(int(c) for c in recv_counts), recv_runs=recv_runs)  # fmt: skip


def _runs(inverse: np.ndarray, cp: int, local: int) -> np.ndarray:
    """int64 ``[runs]``: the first position of every run of the layout, increasing: stretches whose
    rank-major index (``inverse``) steps by one, cut where a rank's row starts."""
    stream = inverse.shape[0]
    cut = np.ones(stream, dtype=bool)
    np.not_equal(inverse[1:] - inverse[:-1], 1, out=cut[1:])
    at = np.flatnonzero(cut)
    if cp == 1:
        return at
    # a run may go on from one rank's last token to the next rank's first: cut where index r * L sits
    first = inverse[at]
    order = first.argsort(kind="stable")
    bounds = np.arange(local, stream, local, dtype=np.int64)
    run = order[first[order].searchsorted(bounds, side="right") - 1]
    return _sorted_union(at, at[run] + (bounds - first[run]))


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sorted distinct values of ``a`` and ``b`` (int64; a sort: numpy 2's hash-based ``unique`` is slower
    on a few thousand values)."""
    out = np.concatenate([a, b])
    out.sort()
    return out[first_of_runs(out)]


def exchange_plan(rows: np.ndarray, slot_starts: np.ndarray, *, n_rows: int = 1,
                  real_ends: np.ndarray | None = None) -> ExchangePlan:  # fmt: skip
    """The K/V exchange of a layout (``rows`` int ``[cp, L]``) under the document-causal mask of its slots.

    ``slot_starts`` int ``[K]``: every slot's first position over ``n_rows`` bshd rows end to end, each row
    starting one (``cu_seqlens_padded[:-1]``); ``real_ends`` int ``[K]``: where each slot's real tokens end
    (``cu_seqlens_padded[:-1] + diff(cu_seqlens)``; None: no padding). Every CP rank computes the same plan.
    """
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(f"rows must be int [cp, L] with L >= 1, got shape {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= rows.size):
        raise ValueError(f"rows must hold positions in [0, {rows.size}) (a permutation of range(cp * L))")
    return exchange_plan_of_inverse(inverse_indices(rows), rows.shape[0], slot_starts, n_rows=n_rows,
                                    real_ends=real_ends)  # fmt: skip


def _checked_slots(slot_starts: Any, real_ends: Any, stream: int, n_rows: Any
                   ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """``(slot_starts, real_ends)`` as int64 ``[K]`` over ``n_rows`` rows of ``stream`` positions (each real end
    in ``[its slot's start, the next slot's start]``), or ``ValueError``."""
    check_int("n_rows", n_rows, min=1, fix=" (bshd rows sharing the layout)")
    starts = np.asarray(slot_starts, dtype=np.int64).reshape(-1)
    row_firsts = np.arange(n_rows, dtype=np.int64) * stream
    firsts_at = starts.searchsorted(row_firsts)
    if (starts.size == 0 or (starts[1:] <= starts[:-1]).any() or starts[-1] >= n_rows * stream
            or firsts_at[-1] >= starts.size or (starts[firsts_at] != row_firsts).any()):  # fmt: skip
        raise ValueError(
            f"slot_starts must be increasing stream positions in [0, {n_rows * stream}) with every row's "
            f"first position (multiples of {stream}) among them, got {starts[:16].tolist()}...; pass the "
            "batch's cu_seqlens_padded[:-1]"
        )
    if real_ends is None:
        return starts, None
    ends = np.asarray(real_ends, dtype=np.int64).reshape(-1)
    nxt = np.append(starts[1:], n_rows * stream)
    if ends.shape != starts.shape or (ends < starts).any() or (ends > nxt).any():
        raise ValueError(
            f"real_ends must give every one of the {starts.size} slots the end of its real tokens, between "
            f"its start and the next slot's, got {ends[:16].tolist()}...; pass the stream's real_ends "
            "(cu_seqlens_padded[:-1] + diff(cu_seqlens))"
        )
    return starts, ends


def exchange_plan_of_inverse(inverse: np.ndarray, cp_size: int, slot_starts: np.ndarray, *, n_rows: int = 1,
                             checked: bool = False, real_ends: np.ndarray | None = None) -> ExchangePlan:  # fmt: skip
    """:func:`exchange_plan` from the layout's inverse map (int64 ``[cp * L]``, a batch's ``gather_index``).

    ``checked=True``: the arguments are the worker's int64 arrays, already checked; their checks are skipped.
    """
    if not checked:
        inverse = np.asarray(inverse, dtype=np.int64).reshape(-1)
        cp, stream = check_int("cp_size", cp_size, min=1), inverse.shape[0]
        if stream == 0 or stream % cp:
            raise ValueError(f"the inverse map covers {stream} positions, not a positive multiple of cp_size={cp}")
        slot_starts, real_ends = _checked_slots(slot_starts, real_ends, stream, n_rows)
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
    """:func:`exchange_plan` of a layout given as runs (O(runs + slots)): run ``i`` covers ``[run_starts[i],
    run_starts[i + 1])`` on rank ``run_owners[i]`` from local index ``run_local_starts[i]`` (runs need not be
    maximal). ``checked``: the arguments are a layout's own int64 arrays, their checks skipped."""
    if not checked:
        run_starts, run_owners, run_local_starts = (np.asarray(a, dtype=np.int64).reshape(-1)
                                                    for a in (run_starts, run_owners, run_local_starts))
        cp_size, local_len = check_int("cp_size", cp_size, min=1), check_int("local_len", local_len, min=1)
        _check_runs(run_starts, run_owners, run_local_starts, cp_size, local_len)
        slot_starts, real_ends = _checked_slots(slot_starts, real_ends, cp_size * local_len, n_rows)
    starts = _sorted_union(run_starts, _cuts(slot_starts, real_ends, cp_size * local_len, n_rows))
    run = run_starts.searchsorted(starts, side="right") - 1
    return _pieces_plan(starts, run_owners[run], run_local_starts[run] + (starts - run_starts[run]), cp_size,
                        local_len, slot_starts, n_rows, real_ends)  # fmt: skip


def world_exchange(table: SpanTable, real_lens: np.ndarray | None = None) -> ExchangePlan:
    """The K/V exchange plan of one pack's deal, from its runs (no pass over the tokens); ``real_lens`` int64
    ``[D]`` (None: the slots are all real, the pack's tail is padding). Empty slots hold no key: left out."""
    lens = table.lens
    real = lens if real_lens is None else np.asarray(real_lens, dtype=np.int64)[: lens.shape[0]]
    kept = lens > 0
    starts, ends = table.doc_starts[kept], (table.doc_starts + real)[kept]
    if not starts.shape[0]:
        starts = ends = np.zeros(1, np.int64)
    local = table.pack_len // table.cp_size
    return exchange_plan_of_runs(*table.spans(), cp_size=table.cp_size, local_len=local, slot_starts=starts,
                                 real_ends=ends)  # fmt: skip


def node_recv(plan: ExchangePlan, node_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(intra, inter)`` int64 ``[cp]``: keys each rank receives from ranks of its own node, and of others
    (rank ``r`` lies in node ``r // node_size``)."""
    counts = plan.recv_counts()  # [dst, src]
    node = np.arange(plan.cp_size) // node_size
    same = node[:, None] == node[None, :]
    return (counts * same).sum(axis=1), (counts * ~same).sum(axis=1)


def _check_runs(starts: np.ndarray, owners: np.ndarray, local: np.ndarray, cp: int, local_len: int) -> None:
    """``ValueError`` unless the runs are increasing from 0 and each rank's tile its local order once."""
    stream = cp * local_len
    if not (starts.size and starts.shape == owners.shape == local.shape and starts[0] == 0
            and (starts[1:] > starts[:-1]).all() and starts[-1] < stream
            and owners.min() >= 0 and owners.max() < cp):  # fmt: skip
        raise ValueError(
            f"runs must be three equal-length int arrays: increasing global starts from 0 below cp_size * "
            f"local_len = {stream}, owners in [0, cp_size={cp}) and local starts; got {starts.size}, "
            f"{owners.size}, {local.size} runs"
        )
    lengths = np.diff(starts, append=stream)
    order = np.lexsort((local, owners))  # each rank's runs in local order must tile [0, L)
    expect = lengths[order].cumsum() - lengths[order] - np.repeat(np.arange(cp, dtype=np.int64) * local_len,
                                                                  np.bincount(owners, minlength=cp))
    if not np.array_equal(local[order], expect) or not (np.bincount(owners, lengths, cp) == local_len).all():
        raise ValueError(f"every rank's runs must tile its local order [0, local_len={local_len}) exactly once")


def _pieces_plan(starts: np.ndarray, owners: np.ndarray, local_starts: np.ndarray, cp: int, local: int,
                 slot_starts: np.ndarray, n_rows: int, real_ends: np.ndarray | None) -> ExchangePlan:  # fmt: skip
    """The plan of pieces (sorted global starts, each with one owner and, in every row, one slot, all real or
    all padding there)."""
    stream = cp * local
    ends = np.append(starts[1:], stream)
    # slot of every piece in every row (global slot ids), last position of every slot on every rank
    if n_rows == 1:
        slot = slot_starts.searchsorted(starts, side="right")[None]
    else:
        row_firsts = np.arange(n_rows, dtype=np.int64) * stream
        slot = slot_starts.searchsorted(row_firsts[:, None] + starts[None, :], side="right")  # [rows, n]
    slot -= 1
    key = slot * cp
    key += owners
    last = np.full(slot_starts.size * cp, -1, dtype=np.int64)  # [slot, rank] flat
    at_end = np.tile(ends - 1, n_rows) if n_rows > 1 else ends - 1
    if real_ends is not None:  # a pad piece is no query of its slot
        begin = (np.arange(n_rows, dtype=np.int64)[:, None] * stream + starts[None, :]).reshape(-1)
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
