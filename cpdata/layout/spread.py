"""How the world step cuts a document it spreads over ``c`` ranks: ``2c`` chunks, rank ``j`` of the ``c`` holding
chunks ``j`` and ``2c - 1 - j`` (the last rank's two follow each other).

- Up to the width Megatron's scheduler would give the document (:func:`megatron_width`: the power of two of
  ``ceil(s / local)``), the chunks are TE THD's: near-equal (:func:`~cpdata.layout.world_plan.thd_chunks`).
  Their roles cost near-equal tiles, and role ``j`` receives ``(2c - 2 - j) / 2c`` of the document.
- Inside one node (``c <= node_size``), up to that width, the chunks end on tile boundaries where that costs
  the busiest role no more (:func:`aligned_chunks`): a chunk tiled by itself pays a whole row of key tiles for a
  partial last query block, so THD's chunks cost more than the document alone (a 17,000-token document on 8
  ranks: 9,678 tiles against 8,911, the busiest role 1,222 against 1,123 aligned). The roles then hold unequal
  tokens and receive unequal keys (none more than THD's first role).
- Past a node, each node holds THD's tokens, so the keys crossing nodes stay THD's: on whole nodes
  (:func:`~cpdata.layout.node_chunks.node_chunks`, a width that is a multiple of ``node_size``) the chunks end on
  tiles inside each node's THD spans where that costs the busiest role fewer tiles (116,533 tokens on 32 ranks of
  4K: 13,229 against THD's 13,708); on a width that is not whole nodes, THD's chunks.
- Wider (:func:`capped_chunks`), THD's first role would receive ``(c - 1) / c`` of the document, more than
  Megatron's first role does at its width. The chunks are then cut so that no role receives more keys than
  THD's first role at Megatron's width, and the roles' causal work stays as even as that allows: the early
  roles take long front chunks (cheap: few keys before them) and short back chunks.

Why wider at all: a document of ``s`` tokens on its ``ceil(s / local)`` ranks costs each ``s^2 / 2c`` work in
one micro-batch, which the other ranks' short documents may never reach (web 16 x 8K, seed 13: a
31,467-token document on 4 ranks at 7,718 tiles each, the step's mean rank at 5,600). On 7 ranks of a node it
costs at most 4,824 a rank, and no rank receives more than Megatron's first role on 4 (23,600 keys).

Trade-off: the capped roles are less even than THD's (7 ranks for a document Megatron gives 4: the busiest
1.07 x the mean role, its last role at 0.64 x; THD's 1.002 x), so the deal only widens where the narrower
widths leave the step's busiest rank over the level. The cut is a pure function of ``(s, c, local,
node_size)``: the pack's slot owners say ``c``, and :func:`~cpdata.layout.world_owners.owned_runs` recomputes the
runs under the deal's node size.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from cpdata.layout.causal_tiles import segment_tiles, span_tiles
from cpdata.layout.node_chunks import node_chunks
from cpdata.layout.tiled import DEFAULT_TILE
from cpdata.layout.world_plan import chunk_need, chunk_runs, thd_chunks

__all__ = ["aligned_chunks", "capped_chunks", "chunk_recv", "chunk_tiles", "megatron_width", "spread_chunks",
           "spread_runs", "thd_recv"]  # fmt: skip


def megatron_width(s: int, local: int) -> int:
    """The ranks Megatron's scheduler gives a document of ``s`` tokens at ``local`` tokens a rank: the power of
    two of ``ceil(s / local)``."""
    return 1 << (-(-s // local) - 1).bit_length()


@functools.lru_cache(maxsize=4096)
def spread_chunks(s: int, c: int, local: int, node_size: int) -> tuple[int, ...] | None:
    """The ``2c`` chunk lengths of a document of ``s`` tokens on ``c`` ranks of ``local`` tokens, ``node_size``
    ranks a node: up to :func:`megatron_width`, TE THD's, or inside one node (``c <= node_size``)
    :func:`aligned_chunks` where its busiest role costs no more tiles, past a node on whole nodes
    :func:`~cpdata.layout.node_chunks.node_chunks` where it costs fewer; :func:`capped_chunks` wider inside a node;
    past a node and Megatron's width, THD's again, as Megatron's scheduler widens a sample into the ranks it left
    empty (the close's :meth:`~cpdata.packing.world_close.StepClose._spread_out`), where every chunk holds a
    token; None where no cut keeps every rank within ``local`` tokens and the receive cap."""
    width = megatron_width(s, local)
    if c > width and c > node_size:  # (as Megatron's scheduler widens a sample into ranks left empty)
        return tuple(thd_chunks(s, c)) if s >= 2 * c else None
    if c > width:
        return capped_chunks(s, c, thd_recv(s, width)[0], local)
    thd = tuple(thd_chunks(s, c))
    if c > node_size:
        node = node_chunks(s, c, node_size, local, thd_recv(s, c)[0], DEFAULT_TILE)
        return thd if node is None else node
    if c == 1:
        return thd
    aligned = aligned_chunks(s, c, thd_recv(s, c)[0], local)
    if aligned is not None and max(chunk_tiles(aligned, DEFAULT_TILE)) <= max(chunk_tiles(thd, DEFAULT_TILE)):
        return aligned
    return thd


def thd_recv(s: int, c: int) -> tuple[int, ...]:
    """Keys each of ``c`` ranks receives of a document of ``s`` tokens in TE THD's ``2c`` chunks
    (:func:`chunk_recv`): role ``j`` lacks ``(2c - 2 - j) / 2c`` of it, the first ``(c - 1) / c``."""
    return chunk_recv(thd_chunks(s, c))


def chunk_recv(chunk: Sequence[int]) -> tuple[int, ...]:
    """Keys each role receives: those up to its last query (the end of its later chunk ``2c - 1 - j``, or of
    chunk ``j`` where that is empty) that it does not hold; a role that holds nothing, none."""
    c = len(chunk) // 2
    ends = list(itertools.accumulate(chunk))
    last = 2 * c - 1
    return tuple(ends[last - j] - chunk[j] - chunk[last - j] if chunk[last - j] else
                 ends[j] - chunk[j] if chunk[j] else 0 for j in range(c))  # fmt: skip


def chunk_tiles(chunk: Sequence[int], tile: int) -> tuple[int, ...]:
    """Varlen tiles of each role (:func:`~cpdata.layout.causal_tiles.segment_tiles`): each chunk a segment of its
    queries over the document's keys up to its last query; a role's two chunks where they follow each other (the
    last role's; a capped cut's whose chunks between are empty) one segment, as the varlen plan runs them."""
    c = len(chunk) // 2
    ends = list(itertools.accumulate(chunk, initial=0))
    last = 2 * c - 1
    role, q, k = [], [], []  # the segments: their role, queries, keys
    for j in range(c):
        pieces = ([(j, last - j)] if ends[j + 1] == ends[last - j] else [(j, j), (last - j, last - j)])
        for a, b in pieces:
            if ends[b + 1] > ends[a]:
                role.append(j)
                q.append(ends[b + 1] - ends[a])
                k.append(ends[b + 1])
    tiles = segment_tiles(np.array(q, dtype=np.int64), np.array(k, dtype=np.int64), tile)
    return tuple(np.bincount(np.array(role, dtype=np.int64), tiles, minlength=c).astype(np.int64).tolist())


def spread_runs(s: int, c: int, local: int, node_size: int) -> list[tuple[int, int, int]]:
    """``(offset in the document, length, role)`` of every non-empty chunk of :func:`spread_chunks`, role ``i``
    taking chunks ``i`` then ``2c - 1 - i``, role after role. ``ValueError`` where the width has no cut."""
    chunk = spread_chunks(s, c, local, node_size)
    if chunk is None:
        raise ValueError(f"a document of {s} tokens has no cut over {c} ranks of {local} tokens within the "
                         f"receive cap; the owners belong to another pack or another rank size")  # fmt: skip
    return chunk_runs(chunk)


def aligned_chunks(s: int, c: int, most: int, local: int, tile: int = DEFAULT_TILE) -> tuple[int, ...] | None:
    """``2c`` chunk lengths of ``s`` (rank ``j``: chunks ``j`` and ``2c - 1 - j``) whose boundaries fall on
    multiples of ``tile``, no rank receiving more than ``most`` keys or holding more than ``local`` tokens, the
    roles' tiles near equal; None where this walk finds none.

    Why: a chunk of queries tiled by itself pays a whole row of key tiles for its last, partial query block, and
    THD's ``s / 2c`` chunks rarely end on a tile (17,000 tokens on 8 ranks: 9,678 tiles against 8,911 for the
    document alone, the busiest role 1,222 against 1,123 aligned). On tile boundaries the roles' tiles sum to
    the document's alone.

    The roles are cut front to back from pointers ``a`` (front) and ``e`` (back): role ``j`` takes the chunk
    from ``a`` to an aligned front end and the one from an aligned back start to ``e``, aiming at the work left
    between the pointers over the roles left. Of back chunks near THD's equal halves and the front chunk that
    meets the aim, the fewest the receive cap allows and the fewest that leave the roles after it room, it takes
    the one whose miss costs least: work over the aim counts whole, under it spread over the roles left (they
    take it). The last role holds what is left between the pointers, one segment. A role's work is coarse where
    its back blocks are dear and its front has little room (the first role's back blocks cost about the
    document's blocks each), so its miss is spread over the others.

    Trade-off: the roles hold unequal tokens, so the ranks' token counts, and with them the keys each receives
    from each other, are not THD's: :func:`spread_chunks` takes this cut only inside one node, where no key
    crosses nodes. A walk, not a search: a few candidates a role, one pass over the roles (:func:`spread_chunks`
    caches the cut per length, width, rank size and node size)."""
    a, e = 0, s
    fronts: list[int] = []
    backs: list[int] = []
    for j in range(c - 1):
        cut = _walk_role(a, e, c - 1 - j, most, local, tile)
        if cut is None:
            return None
        fronts.append(cut[0] - a)
        backs.append(e - cut[1])
        a, e = cut
    middle = e - a
    half = -(-middle // tile) // 2 * tile  # (one segment: split on a tile as well)
    chunk = tuple(fronts + [half, middle - half] + backs[::-1])
    if middle > local or max(chunk_need(chunk)) > local or max(chunk_recv(chunk)) > most:
        return None
    return chunk


def _walk_role(a: int, e: int, after: int, most: int, local: int, tile: int) -> tuple[int, int] | None:
    """:func:`aligned_chunks`' choice for one role between the pointers ``a`` and ``e`` with ``after`` roles after
    it: its front end and back start, on tile boundaries; None where none fits."""
    aim = _work(a, e, tile) / (after + 1)
    halves = int(aim * tile / (a + e)) if a + e else 0  # THD's equal chunks: their work about n (a + e) / tile^2
    top, base = -(-e // tile), a // tile  # blocks count down from e and up from a (a partial first one)
    x = a / tile + 0.5  # the front's blocks cost about x + i each
    best: tuple[float, int, int] | None = None
    for b in range(max(halves - 1, 0), halves + 3):
        start = e if b == 0 else (top - b) * tile
        if start < a:
            break
        back = _segment_tiles(start, e, tile)
        root = int(math.sqrt(x * x + 2 * max(aim - back, 0.0)) - x)
        # the fewest front tokens: the role receives at most ``most``, and the roles after it hold the rest
        least = max(a + start - most if b else a, start - after * local)
        ends = {min((base + f) * tile, start) if f > 0 else a for f in (root, root + 1)}
        ends.add(min(-(-least // tile) * tile, start) if least > a else a)
        for end in ends:
            held = end - a + e - start
            last = e if b else end
            if end < least or held > local or last - held > most:
                continue
            work = back + _segment_tiles(a, end, tile)
            miss = work - aim if work >= aim else (aim - work) / after
            if best is None or (miss, end, start) < best:
                best = (miss, end, start)
    return None if best is None else (best[1], best[2])


def _segment_tiles(p: int, q: int, tile: int) -> int:
    """Varlen tiles of queries ``p .. q - 1`` over the keys up to them, the query blocks tiled from ``p``, the keys
    from 0 (:func:`~cpdata.layout.causal_tiles.span_tiles`; none where the span is empty)."""
    return span_tiles(p, q, tile) if q > p else 0


def _work(p: int, q: int, tile: int) -> float:
    """About the varlen tiles of queries ``p .. q - 1`` cut on tile boundaries: a block costs its position in
    blocks plus one."""
    return (q * q - p * p) / (2 * tile * tile) + (q - p) / (2 * tile)


def capped_chunks(s: int, c: int, most: int, local: int) -> tuple[int, ...] | None:
    """``2c`` chunk lengths of ``s`` (rank ``j``: chunks ``j`` and ``2c - 1 - j``) with which no rank receives
    more than ``most`` keys or holds more than ``local`` tokens, and every rank holds a token, the busiest rank's
    causal work least as far as a bisection finds; None where none.

    For a work level ``T`` (query-key pairs), roles are cut front to back: role ``j`` holds ``f`` tokens from the
    front pointer ``a`` and ``b`` ending at the back pointer ``e``, work ``f (a + f / 2) + b (e - b / 2) = T``.
    It receives ``e - f - b`` keys, so it needs ``f + b >= e - most``. Where equal halves (THD's) meet that, it
    takes them; else the pair with ``f + b = e - most``, whose work is linear in ``b``. The last role holds
    what is left between the pointers. The least ``T`` at which that is ``<= T`` is bisected; the pointers are
    rounded to tokens under a cap two keys lower (the rounding moves a role's keys by at most 1.5), else one or
    none lower where that leaves the first role no room, and the rounded cut is checked.

    Where the roles before the last reach ``T`` with nothing left, the last role holds nothing: that cut is the
    cut of ``c - 1`` ranks with its last role's chunks dropped (it has the same tokens, tiles and keys a role),
    so ``c`` ranks have no cut and ``c - 1`` ranks take it where its busiest role costs fewer tiles than their own
    bisection's (the tiles round differently at one work level: the web document of 31,467 tokens on 7 ranks of
    8K, 4,824 tiles its busiest role against 4,909; offered as 8 ranks, the owners named a rank that held
    nothing)."""
    own = _capped(s, c, most, local)
    if own is not None and not min(chunk_need(own)):
        own = None
    wider = _capped(s, c + 1, most, local)
    if wider is None or chunk_need(wider)[-1] or not min(chunk_need(wider)[:-1]):
        return own
    dropped = wider[:c] + wider[c + 2:]
    if own is None or max(chunk_tiles(dropped, DEFAULT_TILE)) < max(chunk_tiles(own, DEFAULT_TILE)):
        return dropped
    return own


def _capped(s: int, c: int, most: int, local: int) -> tuple[int, ...] | None:
    """:func:`capped_chunks`' bisection on ``c`` ranks, its rounded cut checked, before any role is looked at."""
    for margin in (2, 1, 0):  # (a document that fills Megatron's width leaves its first role no room for one)
        chunk = _rounded(s, c, most, margin)
        if chunk is not None and min(chunk) >= 0 and max(chunk_need(chunk)) <= local:
            if max(chunk_recv(chunk)) <= most:
                return chunk
    return None


def _rounded(s: int, c: int, most: int, margin: int) -> tuple[int, ...] | None:
    """The least work level's cut (:func:`_cut`, bisected) at a receive cap ``margin`` keys under ``most``, its
    pointers rounded to tokens."""
    best = None
    lo, hi = s * s / (2 * c) * 0.9, s * s / 2.0
    for _ in range(40):
        level = (lo + hi) / 2
        cut = _cut(s, c, most - margin, level)
        if cut is not None and cut[2] <= level:
            hi, best = level, cut
        else:
            lo = level
    if best is None:
        return None
    fronts = [round(v) for v in itertools.accumulate(best[0], initial=0.0)]
    backs = [s - round(v) for v in itertools.accumulate(best[1], initial=0.0)]
    middle = backs[-1] - fronts[-1]
    return (tuple(fronts[i + 1] - fronts[i] for i in range(c - 1)) + (middle // 2, middle - middle // 2)
            + tuple(backs[i] - backs[i + 1] for i in reversed(range(c - 1))))  # fmt: skip


def _cut(s: int, c: int, most: float, level: float) -> tuple[list[float], list[float], float] | None:
    """Front and back lengths of roles ``0 .. c - 2`` at work ``level`` and the last role's work; None where a
    role cannot meet the receive cap at that work."""
    front, back = 0.0, float(s)
    fs: list[float] = []
    bs: list[float] = []
    for _ in range(c - 1):
        need = back - most
        half = level / (front + back)
        if 2 * half >= need:
            f = b = half
        else:
            least = need * front + need * need / 2  # the work of holding ``need`` tokens all from the front
            if least > level:
                return None
            slope = back - front - need
            b = min((level - least) / slope, need) if slope > 0 else 0.0
            f = need - b
        if front + f > back - b:  # the rest fits this role: it takes it, front first
            f = min(f, back - front)
            b = back - front - f
        fs.append(f)
        bs.append(b)
        front += f
        back -= b
    if front > most:
        return None
    middle = back - front
    return fs, bs, middle * front + middle * middle / 2
