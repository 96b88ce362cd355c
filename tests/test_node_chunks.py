"""The cut of a document over whole nodes that keeps THD's tokens on every node and ends chunks on tiles inside
each (cpdata.layout.node_chunks), checked against THD's cut, Megatron's counter and a brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cpdata.bench.world_megatron import thd_part
from cpdata.layout.node_chunks import TOKENS, node_chunks
from cpdata.layout.spread import chunk_recv, chunk_tiles, spread_chunks, thd_recv
from cpdata.layout.world_plan import chunk_need, thd_chunks

TILE = 128


def _keys_from_other_nodes(chunk: tuple[int, ...], node_size: int, mirrored: bool) -> list[int]:
    """Per role, the keys before its last query held by roles on other nodes, the roles on ranks ``0 .. c - 1``
    (mirrored: role ``j`` on rank ``c - 1 - j``), counted from the chunks' positions."""
    c = len(chunk) // 2
    starts = list(itertools.accumulate(chunk, initial=0))
    node = [((c - 1 - j) if mirrored else j) // node_size for j in range(c)]
    held = [[(starts[i], starts[i + 1]) for i in (j, 2 * c - 1 - j)] for j in range(c)]
    out = []
    for j in range(c):
        back = held[j][1]
        end = back[1] if back[1] > back[0] else held[j][0][1]
        out.append(sum(max(0, min(b, end) - a) for q in range(c) if node[q] != node[j] for a, b in held[q]))
    return out


def _check(chunk: tuple[int, ...], s: int, c: int, node_size: int, local: int) -> None:
    """Every invariant of a node cut: the tokens, THD's spans per node, tiles inside, caps, keys across nodes (a
    role's keys from other nodes are THD's, or fewer where its back chunk is empty)."""
    thd = tuple(thd_chunks(s, c))
    assert len(chunk) == 2 * c and min(chunk) >= 0 and sum(chunk) == s
    pos, thd_pos = (list(itertools.accumulate(x, initial=0)) for x in (chunk, thd))
    for i in range(2 * c + 1):
        if i == c:  # (the middle role's two chunks are one segment: its split is free)
            continue
        if i % node_size == 0 or (2 * c - i) % node_size == 0:  # a node's span starts or ends here
            assert pos[i] == thd_pos[i], (i, pos[i], thd_pos[i])
        else:  # on a tile, or at its node's span edge (a chunk left empty)
            g = (i if i < c else 2 * c - i) // node_size * node_size
            spans = {thd_pos[g], thd_pos[g + node_size], thd_pos[2 * c - g - node_size], thd_pos[2 * c - g]}
            assert pos[i] % TILE == 0 or pos[i] in spans, (i, pos[i])
    assert max(chunk_need(chunk)) <= local
    assert max(abs(a - b) for a, b in zip(chunk_need(chunk), chunk_need(thd), strict=True)) <= TOKENS
    assert max(chunk_recv(chunk)) <= thd_recv(s, c)[0]
    for mirrored in (False, True):
        across, thd_across = (_keys_from_other_nodes(x, node_size, mirrored) for x in (chunk, thd))
        for j in range(c):  # (THD's where its back chunk holds a token; a role with none needs fewer keys)
            assert across[j] == thd_across[j] if chunk[2 * c - 1 - j] else across[j] <= thd_across[j], (j, mirrored)
    assert max(chunk_tiles(chunk, TILE)) < max(chunk_tiles(thd, TILE))


def test_a_long_book_on_four_nodes_costs_its_busiest_role_less_than_thd_and_megatron() -> None:
    """116,533 tokens on 32 ranks of 4K, 8 a node (books 32 x 4K, seed 8): THD's chunks cost its busiest role
    13,708 tiles in varlen segments (Megatron's counter, one query run a role: 13,679); the node cut 13,229, the
    keys crossing nodes THD's."""
    s, c = 116_533, 32
    chunk = node_chunks(s, c, 8, 4096, thd_recv(s, c)[0], TILE)
    assert chunk is not None
    _check(chunk, s, c, 8, 4096)
    assert max(chunk_tiles(tuple(thd_chunks(s, c)), TILE)) == 13_708 and max(thd_part(s, c)[0]) == 13_679
    assert max(chunk_tiles(chunk, TILE)) == 13_229
    assert spread_chunks(s, c, 4096, 8) == chunk  # (the world step's cut at that width)
    assert spread_chunks(s, 31, 4096, 8) == tuple(thd_chunks(s, 31))  # (31 ranks: no node cut)


@pytest.mark.parametrize("seed", range(4))
def test_random_lengths_keep_every_invariant(seed: int) -> None:
    """Random documents over 16, 24 or 32 ranks of 4K or 8K: each cut found keeps THD's spans per node, tiles
    inside, each role within ``TOKENS`` of THD's tokens, the token and receive caps, the keys across nodes, and
    beats THD's busiest role."""
    rng = np.random.default_rng(seed)
    found = 0
    for _ in range(12):
        local = int(rng.choice([4096, 8192]))
        c = int(rng.choice([16, 24, 32]))
        s = int(rng.integers(8 * local + 1, c * local + 1))
        chunk = node_chunks(s, c, 8, local, thd_recv(s, c)[0], TILE)
        if chunk is not None:
            found += 1
            _check(chunk, s, c, 8, local)
    assert found >= 6


@pytest.mark.parametrize("seed", range(3))
def test_small_ranks_keep_every_invariant(seed: int) -> None:
    """Ranks of 512 tokens, 4 a node, on 8 or 12 ranks (the world step tests' shape): a role's back chunk may move
    past its rank's room there, so the token cap binds."""
    rng = np.random.default_rng(100 + seed)
    found = 0
    for _ in range(40):
        c = int(rng.choice([8, 12]))
        s = int(rng.integers(4 * 512 + 1, c * 512 + 1))
        chunk = node_chunks(s, c, 4, 512, thd_recv(s, c)[0], TILE)
        if chunk is not None:
            found += 1
            _check(chunk, s, c, 4, 512)
    assert found >= 10


@pytest.mark.parametrize("c, node_size", [(31, 8), (8, 8), (6, 8), (12, 8)])
def test_widths_that_are_not_whole_nodes_have_no_node_cut(c: int, node_size: int) -> None:
    """Past a node but not whole nodes, a node's roles differ by orientation: no node cut (THD's stays)."""
    s = 24 * 1000 + 7
    assert node_chunks(s, c, node_size, 4096, thd_recv(s, c)[0], TILE) is None


def _brute(s: int, c: int, node_size: int, local: int, tile: int) -> int:
    """The least busiest role over every cut on the tile grid that keeps THD's spans per node and the caps
    (node_size 2: one front end and one back start a node)."""
    thd = list(itertools.accumulate(thd_chunks(s, c), initial=0))
    most = thd_recv(s, c)[0]
    best = max(chunk_tiles(tuple(thd_chunks(s, c)), tile))
    per_node = []
    for g in range(0, c, node_size):
        a, f_end, b_start, e = thd[g], thd[g + 2], thd[2 * c - g - 2], thd[2 * c - g]
        least = None
        fronts = [x for x in range(a, f_end + 1) if x % tile == 0 or x in (a, f_end)]
        backs = [x for x in range(b_start, e + 1) if x % tile == 0 or x in (b_start, e)]
        for f, b in itertools.product(fronts, backs):
            out = thd[:]
            out[g + 1], out[2 * c - 1 - g] = f, b
            if g + 2 == c:  # (the middle: its split on a tile, as the cut makes it)
                middle = out[c + 1] - out[c - 1]
                out[c] = out[c - 1] + min(-(-middle // tile) // 2 * tile, middle)
            chunk = tuple(out[i + 1] - out[i] for i in range(2 * c))
            if min(chunk) < 0 or max(chunk_need(chunk)) > local or max(chunk_recv(chunk)) > most:
                continue
            tiles = max(chunk_tiles(chunk, tile)[g : g + 2])
            least = tiles if least is None else min(least, tiles)
        per_node.append(least)
    return min(best, max(per_node)) if None not in per_node else best


@pytest.mark.parametrize("s", [1_001, 1_537, 1_900, 2_047])
def test_the_search_finds_the_brute_forces_busiest_role_on_small_documents(s: int) -> None:
    """8 ranks of 256 tokens, 2 a node, 32-token tiles: the node cut's busiest role is the brute force's least
    (or no node cut, where THD's is already that)."""
    c, node_size, local, tile = 8, 2, 256, 32
    chunk = node_chunks(s, c, node_size, local, thd_recv(s, c)[0], tile)
    best = _brute(s, c, node_size, local, tile)
    thd = max(chunk_tiles(tuple(thd_chunks(s, c)), tile))
    if chunk is None:
        assert best == thd
    else:
        assert max(chunk_tiles(chunk, tile)) == best < thd
