"""Who holds what of a world step's pieces: a placement's ranks, each role's tokens, tiles and keys, the windows
a spread piece may take and the best of them on given loads (:func:`best_window`), and the runs of a pack the step
dealt.

A piece spread over ``c`` ranks is cut in ``2c`` chunks (:func:`~cpdata.layout.spread.spread_chunks`); rank ``j``
of its window holds chunks ``j`` and ``2c - 1 - j`` (its *role*), counted up from the window's first rank or
down from its last (:data:`Placement`). The deal (:class:`~cpdata.layout.world_step.StepBins`) and the close
(:mod:`cpdata.packing.world_close`) price placements with :func:`role_costs`; the shard stage lays a pack out from
its slot owners with :func:`owned_runs`, never from a deal run again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from cpdata.layout.spread import chunk_recv, chunk_tiles, spread_chunks, spread_runs
from cpdata.layout.world_plan import chunk_need

__all__ = ["Placement", "best_window", "best_windows", "owned_runs", "owner_ranks", "role_costs", "window_index",
           "window_owners", "windows"]

Placement = tuple[int, int, int]
"""``(micro-batch, first rank, ranks)``: ranks ``first .. first + ranks - 1`` in TE THD's roles, or, where
``ranks`` is negative, ``first`` down to ``first + ranks + 1`` (the window's roles mirrored)."""


def owner_ranks(first: int, ranks: int) -> range:
    """The ranks of a placement ``(first, ranks)`` (:data:`Placement`), in THD role order: role ``j`` of a
    spread piece (chunks ``j`` and ``2c - 1 - j``) is the ``j``-th."""
    return range(first, first + ranks, 1 if ranks > 0 else -1)


def window_owners(first: int, c: int, mirrored: bool) -> tuple[int, int]:
    """``(first rank, signed ranks)`` of a :data:`Placement` on the window of ``c`` ranks from rank ``first``: in
    THD's orientation, or ``mirrored`` (roles counted down from the window's last rank: :func:`owner_ranks`)."""
    return (first + c - 1, -c) if mirrored else (first, c)


@functools.lru_cache(maxsize=4096)
def role_costs(s: int, c: int, local: int, tile: int, node_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # fmt: skip
    """int64 ``[c]`` each (read-only: one cached copy serves every call): ``(tokens, tiles, keys received)`` of
    each role of a document of ``s`` tokens spread over ``c`` ranks of ``local`` tokens, ``node_size`` a node
    (:func:`~cpdata.layout.spread.spread_chunks`); None where that width has no cut."""
    chunk = spread_chunks(s, c, local, node_size)
    if chunk is None:
        return None
    roles = tuple(np.array(v, dtype=np.int64) for v in (chunk_need(chunk), chunk_tiles(chunk, tile), chunk_recv(chunk)))
    for role in roles:
        role.flags.writeable = False
    return roles


def windows(world: int, node_size: int, c: int) -> list[int]:
    """First ranks of the windows of ``c`` consecutive ranks a spread piece may take: inside one node when it fits
    one, else from a node's first rank (whole nodes first)."""
    if c > node_size:
        return list(range(0, world - c + 1, node_size))
    return [a for a in range(world - c + 1) if a // node_size == (a + c - 1) // node_size]


@functools.lru_cache(maxsize=1024)
def window_index(world: int, node_size: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 ``[W]`` the windows' first ranks (:func:`windows`), ``[W, c]`` their ranks, and ``[2, c]`` the role
    at each position of a window, in THD's orientation and mirrored."""
    starts = np.array(windows(world, node_size, c), dtype=np.int64).reshape(-1)
    roles = np.stack([np.arange(c), np.arange(c)[::-1]])
    return starts, starts[:, None] + np.arange(c), roles


def best_window(cut: tuple[np.ndarray, np.ndarray, np.ndarray], room: np.ndarray, load: np.ndarray, recv: np.ndarray,
                cap: float, node_size: int, pack: int | None = None) -> tuple[float, int, int, int] | None:  # fmt: skip
    """``(busiest load after, micro-batch, first rank, signed ranks)``: of the placements of a spread piece whose
    roles are ``cut`` (:func:`role_costs`: tokens, tiles, keys, int64 ``[c]`` each) on a window of ``c`` ranks
    (:func:`windows`, THD's orientation or mirrored, :func:`owner_ranks`) in one micro-batch (``pack`` alone where
    given) where every role fits the ranks' ``room`` (int64 ``[world, packs]``) and no rank's received keys
    (``recv`` int64 ``[world]``, after it) pass ``cap``, the one whose busiest ``load`` (float64 ``[world]``)
    after it is least; None where none. Ties: the first micro-batch, the lowest rank, the orientation whose busiest
    receiver after it is least, THD's. (Equal pieces tie on every orientation: THD's each time gave a rank the
    first role in every micro-batch, 8,192-token documents at 32 x 4K 32,768 keys, Megatron's busiest receiver;
    alternating, 24,576.) The THD roles receive unequal keys (the first rank ``(c - 1) / c`` of the document, the
    last ``(c - 1) / 2c``: :func:`~cpdata.layout.spread.thd_recv`) for near-equal tiles, so under the cap a window
    or its mirror keeps a rank that received much from receiving most again (web 32 x 4K, seed 15: 1.49 -> 0.85 x
    Megatron's busiest receiver). One array search over every window, micro-batch and orientation
    (:func:`best_windows`, one width)."""
    return best_windows([cut], room, load, recv, [cap], node_size, pack)[0]


@functools.lru_cache(maxsize=1024)
def _windows_of(world: int, node_size: int, widths: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The windows of every width in ``widths`` (:func:`window_index`) in one table, widths in order, each
    width's windows by first rank, laid end to end: int64 ``[W]`` their first ranks and their width's index in
    ``widths``; ``[T]`` their ranks, window after window (``T`` the sum of their widths); ``[2, T]`` the place of
    each position's role (THD's orientation, mirrored) in the widths' roles laid end to end; ``[W]`` where each
    window starts in ``T``. Read-only: one cached copy serves every call."""
    starts, width_of, ranks, places, bounds = [], [], [], [], []
    offset, at = 0, 0
    for i, c in enumerate(widths):
        first, held, roles = window_index(world, node_size, c)
        count = first.shape[0]
        starts.append(first)
        width_of.append(np.full(count, i, dtype=np.int64))
        ranks.append(held.reshape(-1))
        places.append(np.tile(roles + offset, (1, count)))
        bounds.append(at + c * np.arange(count, dtype=np.int64))
        offset, at = offset + c, at + c * count
    table = tuple(np.concatenate(part, axis=-1) for part in (starts, width_of, ranks, places, bounds))
    for part in table:
        part.flags.writeable = False
    return table


def best_windows(cuts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], room: np.ndarray, load: np.ndarray,
                 recv: np.ndarray, caps: Sequence[float], node_size: int, pack: int | None = None
                 ) -> list[tuple[float, int, int, int] | None]:  # fmt: skip
    """:func:`best_window` of each of several cuts of one piece (its widths, each under its own cap in ``caps``)
    on the same books, in ``cuts``' order: one array search over every width's windows, micro-batches and
    orientations (a call costs about as much as its arrays are long). A placement's micro-batch is the first that
    fits it: the ties put the micro-batch before the window."""
    out: list[tuple[float, int, int, int] | None] = [None] * len(cuts)
    widths = tuple(cut[0].shape[0] for cut in cuts)
    if not widths:
        return out
    starts, width_of, at, places, bounds = _windows_of(load.shape[0], node_size, widths)
    if not starts.size:
        return out
    need, added, keys = (np.concatenate([cut[f] for cut in cuts])[places] for f in range(3))  # [2, T] each
    held = (room if pack is None else room[:, pack:pack + 1])[at]  # [T, packs] (pack alone: [T, 1])
    score = np.maximum.reduceat(load[at] + added, bounds, axis=1)  # [2, W]
    receiver = np.maximum.reduceat(recv[at] + keys, bounds, axis=1)  # [2, W]
    fits = np.logical_and.reduceat(held >= need[..., None], bounds, axis=1)  # [2, W, packs]
    o, a = np.nonzero(fits.any(2) & (receiver <= np.asarray(caps, dtype=np.float64)[width_of]))
    if not o.size:
        return out
    k = fits.argmax(2)[o, a]
    order = np.lexsort((o, receiver[o, a], a, k, score[o, a], width_of[a]))
    o, a, k = o[order], a[order], k[order]
    group = width_of[a]
    for j in np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]])).tolist():
        i, w, c = int(group[j]), int(a[j]), widths[int(group[j])]
        busiest, mb, first = float(score[o[j], w]), int(k[j]) if pack is None else pack, int(starts[w])
        out[i] = (busiest, mb, *window_owners(first, c, bool(o[j])))
    return out


def owned_runs(slot_lens: np.ndarray, owners: np.ndarray, pack_len: int, world: int, node_size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The runs of a pack a world step dealt (:class:`~cpdata.layout.world_step.StepBins`, :attr:`PackPlan.owners`):
    ``(starts, lengths, owners)`` int64 ``[R]`` sorted by global start, tiling ``[0, pack_len)``, every rank
    ``pack_len / world`` positions (its pad last).

    ``slot_lens`` int64 ``[D]``; ``owners`` int64 ``[D, 2]``: each slot's first rank and ranks (1: whole on the
    first; ``c > 1``: the ``2c`` chunks of :func:`~cpdata.layout.spread.spread_chunks` over ``c`` consecutive
    ranks up from the first, rank ``first + j`` taking chunks ``j`` and ``2c - 1 - j``: TE THD's up to Megatron's
    width, on tile boundaries inside one node of ``node_size`` ranks, the receive-capped cut wider; ``-c``: the
    same roles down from it, :func:`owner_ranks`). ``node_size`` is the deal's: the cut depends on it.
    ``ValueError`` when a rank would hold more than its positions, a slot names a rank outside the world, or a
    width has no cut.
    """
    local = pack_len // world
    held = np.zeros(world, dtype=np.int64)
    runs: list[tuple[int, int, int]] = []
    at = 0
    for s, (first, c) in zip(slot_lens.tolist(), owners.tolist(), strict=True):
        ranks = owner_ranks(first, c)
        if not ranks or not (0 <= min(ranks) and max(ranks) < world):
            raise ValueError(f"a slot of {s} tokens names ranks {first}..{first + c - (1 if c > 0 else -1)} "
                             f"(first rank {first}, ranks {c}), outside a world of {world}")  # fmt: skip
        if len(ranks) == 1:
            runs.append((at, s, first))
            held[first] += s
        for offset, n, i in spread_runs(s, len(ranks), local, node_size) if len(ranks) > 1 else ():
            runs.append((at + offset, n, ranks[i]))
            held[ranks[i]] += n
        at += s
    if int(held.max(initial=0)) > local or at > pack_len:
        raise ValueError(f"slot owners give a rank {int(held.max())} tokens (slots {at}) in a pack of {pack_len} "
                         f"tokens over {world} ranks ({local} each); the owners belong to another pack")  # fmt: skip
    for r in range(world):
        n = local - int(held[r])
        if n:
            runs.append((at, n, r))
            at += n
    out = np.array(sorted(runs), dtype=np.int64).reshape(-1, 3)
    return out[:, 0].copy(), out[:, 1].copy(), out[:, 2].copy()
