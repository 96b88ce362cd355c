"""A cut of a document spread over whole nodes that holds TE THD's tokens on every node and ends chunks on tiles
inside each node (:func:`node_chunks`).

Past a node, THD's ``2c`` near-equal chunks (:func:`~cpdata.layout.world_plan.thd_chunks`) rarely end on a tile,
and a chunk tiled by itself pays a whole row of key tiles for its last, partial query block: 116,533 tokens on
32 ranks cost 13,708 tiles on the busiest role in varlen segments, the document alone 415,416 (12,982 a role).
Cutting every chunk on a tile (:func:`~cpdata.layout.spread.aligned_chunks`) leaves the nodes unequal tokens, and
with them the keys that cross nodes.

Here each node keeps THD's two spans (its roles' front chunks and back chunks, each contiguous), so every key a
role needs from another node is THD's: a role's keys end inside its node's back span, and the keys before that
span held by other nodes are the same under both cuts. Inside a node the boundaries move to tiles, and the roles'
tiles are balanced: :data:`LEVELS` levels of the busiest role's tiles are tried at once, by one pass that is exact
over back starts within :data:`BAND` tiles of THD's (:func:`_fits`). The 116,533-token document: 13,229 tiles on
its busiest role, 0.965 x THD's; on small documents the pass finds the brute force's
least (tests/test_node_chunks.py).

Only for ``c`` a multiple of ``node_size`` on a window from a node's first rank
(:func:`~cpdata.layout.world_owners.windows`): there the roles of each node are the same in THD's orientation
and mirrored (:data:`~cpdata.layout.world_owners.Placement`), so the cut is a function of ``(s, c, local,
node_size)``, as the slot owners need.

Trade-off: a role receives its node's keys as it needs them, so roles inside a node receive unequal keys (none
more than THD's first role), and the pass is about 30 numpy calls a role over ``[levels, nodes, 7, 7]`` arrays, a
few hundred a cut: the dearest cut the step deal makes (numbers in docs/benchmarks.md). The cut is cached per
length and width (:func:`~cpdata.layout.spread.spread_chunks`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from cpdata.layout.causal_tiles import span_tiles
from cpdata.layout.world_plan import chunk_need, thd_chunks

__all__ = ["node_chunks"]


def node_chunks(s: int, c: int, node_size: int, local: int, most: int, tile: int) -> tuple[int, ...] | None:
    """``2c`` chunk lengths of ``s`` (rank ``j``: chunks ``j`` and ``2c - 1 - j``): each node's roles hold THD's
    spans, their chunks end on multiples of ``tile`` inside them, no role holds more than ``local`` tokens, or
    :data:`TOKENS` more or fewer than THD's role, or receives more than ``most`` keys (THD's first role's, as
    :func:`~cpdata.layout.spread.spread_chunks` passes it), the busiest role's tiles the least of :data:`LEVELS`
    levels; None where ``c`` is not a multiple of ``node_size`` over one node, or where no such cut beats THD's
    busiest role."""
    if c <= node_size or c % node_size or node_size < 2 or s < 2 * c:
        return None
    plan = _plan(s, c, node_size, local, most, tile)
    if plan is None:
        return None
    ok, cuts = _fits(*plan[1:], node_size, tile)
    if not ok.any():
        return None
    return _chunks(plan[0], cuts(int(np.flatnonzero(ok)[0])), s, c, node_size, local, tile)


def _plan(s: int, c: int, n: int, local: int, most: int, tile: int) -> tuple[np.ndarray, ...] | None:
    """A length's inputs to :func:`_fits`: THD's chunk starts (int64 ``[2c + 1]``), each node's spans (int64
    ``[4, G]``: front start and end, back start and end), THD's back starts (``[G, n - 1]``), the roles' token
    bounds (``[2, G, n]``), the receive cap ``most`` (``[1]``) and the levels (``[LEVELS]``);
    None where no level lies between the nodes' least and THD's busiest role."""
    chunk = thd_chunks(s, c)
    pos = np.array(list(itertools.accumulate(chunk, initial=0)), dtype=np.int64)
    firsts, roles = np.arange(0, c, n), np.arange(c)
    a, f_end, b_start, e = pos[firsts], pos[firsts + n], pos[2 * c - firsts - n], pos[2 * c - firsts]
    thd = np.where(pos[roles + 1] == pos[2 * c - 1 - roles], _seg(pos[roles], pos[2 * c - roles], tile),
                   _seg(pos[roles], pos[roles + 1], tile) + _seg(pos[2 * c - 1 - roles], pos[2 * c - roles], tile))  # fmt: skip
    whole = np.where(firsts + n == c, _seg(a, e, tile), _seg(a, f_end, tile) + _seg(b_start, e, tile))
    lo, hi = int(max(-(-whole // n))), int(thd.max()) - 1  # hi: the least level that would beat THD's
    if lo > hi:
        return None
    held = np.array(chunk_need(chunk), dtype=np.int64)[firsts[:, None] + np.arange(n)]  # [G, n] THD's tokens
    bounds = np.stack([np.maximum(held - TOKENS, 1), np.minimum(held + TOKENS, local)])
    levels = lo + np.round((hi - lo) * np.linspace(0.0, 1.0, LEVELS) ** 2).astype(np.int64)
    centers = pos[2 * c - 1 - (firsts[:, None] + np.arange(n - 1))]
    return pos, np.stack([a, f_end, b_start, e]), centers, bounds, np.array([most]), levels


def _chunks(pos: np.ndarray, found: list[tuple[list[int], list[int]]], s: int, c: int, n: int, local: int,
            tile: int) -> tuple[int, ...] | None:  # fmt: skip
    """The ``2c`` chunk lengths of THD's starts ``pos`` with each node's inner boundaries ``found`` (front ends,
    back starts), the middle role's two chunks split on a tile; None where a role would pass ``local``."""
    out = pos.tolist()
    for g, (fronts, backs) in zip(range(0, c, n), found, strict=True):
        for i, (f, b) in enumerate(zip(fronts, backs, strict=True)):
            out[g + i + 1], out[2 * c - 1 - g - i] = f, b
    middle = out[c + 1] - out[c - 1]  # (the last role's two chunks are one segment: split on a tile)
    out[c] = out[c - 1] + min(-(-middle // tile) // 2 * tile, middle)
    chunk = tuple(int(out[i + 1] - out[i]) for i in range(2 * c))
    if min(chunk) < 0 or max(chunk_need(chunk)) > local or sum(chunk) != s:
        return None
    return chunk


LEVELS = 17
"""The busiest role's levels :func:`node_chunks` tries, all at once, from the nodes' least (their spans' tiles over
their roles) to one under THD's busiest role, closer near the least (the ``(i / 16)^2`` points of the range): the
least cut sits 0-3.2 % over the least (median 0.8 %, over the 186 of 234 random widths of whole nodes where a
finer search of an earlier version found a cut), THD's busiest up to 11 %."""

BAND = 3
"""Tiles either side of THD's back start a role's back start may move (:func:`_fits`)."""

TOKENS = 1024
"""Tokens a role may hold over or under THD's role (:func:`_fits`). Balancing tiles on the grid moves tokens
between a node's roles (a front block is cheap, a back block dear), and a role left far under THD's tokens leaves
room the deal may fill with another document's role, which lifts that rank: under an earlier search of this cut
(two rounds of eight levels), 87,141 tokens on 16 ranks of 8K held 3,456 to 6,784 a role, a 8,638-token
document took the room of two of them, and that step (long_context 16 x 8K, seed 57) stood at 1.036 x its mean
rank; within 1,024 tokens, 1.010 x. Tighter, fewer widths find a cut (at 512, not 116,533 tokens on 32 ranks of
4K)."""


def _seg(p: np.ndarray | int, q: np.ndarray | int, tile: int) -> np.ndarray:
    """Varlen tiles of queries ``p .. q - 1`` over the keys up to them, blocks tiled from ``p`` (0 where
    ``q <= p``): :func:`~cpdata.layout.causal_tiles.span_tiles` on arrays."""
    p, q = np.asarray(p, dtype=np.int64), np.asarray(q, dtype=np.int64)
    return np.where(q > p, span_tiles(p, q, tile), 0)


def _fits(spans: np.ndarray, centers: np.ndarray, bounds: np.ndarray, most: np.ndarray, levels: np.ndarray,
          n: int, tile: int) -> tuple[np.ndarray, Callable[[int], list[tuple[list[int], list[int]]]]]:  # fmt: skip
    """Whether, at each of ``levels`` (int64 ``[K]``), every node (``spans`` int64 ``[4, G]``: front start and end,
    back start and end) has a cut whose roles cost at most that many tiles, hold tokens within ``bounds``
    (``[2, G, n]``: least, most) and receive at most ``most`` keys: bool ``[K]``; and a function of a level's
    index giving each node's ``(front ends, back starts)`` of roles ``0 .. n - 2`` (the last role holds what is
    left).

    Role ``r``'s back start is a tile within :data:`BAND` tiles of THD's (``centers`` int64 ``[G, n - 1]``).
    After each role, for every back start the largest front end any cut reaches: a larger front end leaves less
    and later work, so it dominates (short of the token floors of the roles after it: a heuristic there). A
    role's front end is the largest its tiles, tokens and the span allow, from the closed form of a segment's
    tiles in its blocks ``k``: ``k^2 / 2 + (1.5 + Q) k + P - Q - 1`` with ``P = p // tile``, ``Q = (p - 1) //
    tile``."""
    a, f_end, b_start, e = spans  # [G] each
    last = np.arange(a.size) == a.size - 1
    offsets = np.arange(-BAND, BAND + 1)
    back = np.repeat(e[:, None], offsets.size, axis=1)  # [G, m]: every state starts at the node's back end
    front = np.full((levels.size, a.size, offsets.size), -1, dtype=np.int64)  # [K, G, m]
    front[:, :, 0] = a
    level = levels[:, None, None, None]
    f_top = f_end[None, :, None, None]
    steps = []
    for r in range(n - 1):
        nxt = np.clip((centers[:, r, None] // tile + offsets) * tile, b_start[:, None], e[:, None])  # [G, m]
        b = back[:, :, None]
        backlen = b - nxt[:, None, :]  # [G, m, m]: from each state to each next back start
        least, top = bounds[0, :, r, None, None], bounds[1, :, r, None, None]
        usable = (backlen >= 0) & (backlen <= top)
        floor = np.where(backlen > 0, np.maximum(least, b - most), least)  # (the receive cap, in tokens held)
        room = level - _seg(nxt[:, None, :], b, tile)  # [K, G, m, m]
        f = front[..., None]  # [K, G, m, 1]
        p0, lin = f // tile, 2 * ((f - 1) // tile) + 3
        root = (np.sqrt(np.maximum(lin * lin - 4 * (2 * p0 - lin + 1) + 8 * room, 0)) - lin) / 2
        blocks = np.floor(root - 1e-7).astype(np.int64)  # (2 tiles(k) - 2 room = k^2 + lin k + 2 p0 - lin + 1)
        cap = f + (top - backlen)
        cap = np.where(cap >= f_top, f_top, cap - cap % tile)
        f2 = np.maximum(np.minimum((p0 + blocks) * tile, cap), f)
        held = f2 - f + backlen
        ok = usable & (f >= 0) & (room >= 0) & (held >= floor)
        f2 = np.where(ok, f2, -1)
        parent = f2.argmax(axis=2)  # [K, G, m]
        front = np.take_along_axis(f2, parent[:, :, None, :], axis=2)[:, :, 0, :]
        steps.append((front, parent, nxt))
        back = nxt
    f = front
    held = f_end[None, :, None] - f + back[None] - b_start[None, :, None]
    tiles = np.where(last[None, :, None], _seg(f, back[None], tile),
                     _seg(f, f_end[None, :, None], tile) + _seg(b_start[None, :, None], back[None], tile))  # fmt: skip
    need = np.where(back[None] > b_start[None, :, None], back[None], f_end[None, :, None])
    least, top = bounds[0, None, :, n - 1, None], bounds[1, None, :, n - 1, None]
    ok = (f >= 0) & (held >= least) & (held <= top) & (tiles <= levels[:, None, None]) & (need - held <= most)
    fits = ok.any(axis=2).all(axis=1)

    def cuts(k: int) -> list[tuple[list[int], list[int]]]:
        out = []
        for g in range(a.size):
            j = int(np.flatnonzero(ok[k, g])[0])
            fronts, starts = [], []
            for reached, parent, nxt in reversed(steps):
                fronts.append(int(reached[k, g, j]))
                starts.append(int(nxt[g, j]))
                j = int(parent[k, g, j])
            out.append((fronts[::-1], starts[::-1]))
        return out

    return fits, cuts
