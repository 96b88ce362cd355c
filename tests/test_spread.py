"""How the world step cuts a spread document (cpdata.layout.spread): up to Megatron's width TE THD's chunks, or inside
a node the cut on tile boundaries; the receive-capped cut wider; the roles' tokens, tiles and received keys as the
real layout and exchange count them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.layout import spread
from cpdata.layout.node_chunks import node_chunks
from cpdata.layout.spread import thd_recv
from cpdata.layout.world_owners import owned_runs
from cpdata.layout.world_plan import alone_tiles, chunk_need, thd_chunks, thd_runs
from tests.test_world_step import thd_tiles

TILE, NODE = 128, 8
WEB = 31_467  # web 16 x 8K, seed 13: the document that stood on 4 ranks at 1.375 x the step's mean rank


def test_megatron_width_is_the_power_of_two_of_the_fewest_ranks() -> None:
    lengths = (1, 8192, 8193, 16384, 16385, WEB, 32768, 32769)
    assert [spread.megatron_width(s, 8192) for s in lengths] == [1, 1, 2, 2, 4, 4, 4, 8]


@pytest.mark.parametrize(("s", "local"), [(WEB, 8192), (8193, 8192), (100_000, 4096)])
def test_up_to_megatron_width_the_cut_is_thds_or_one_that_costs_fewer_tiles(s: int, local: int) -> None:
    """At one rank, THD's cut; past a node, the node cut where the width is whole nodes and it has one (each node
    holds THD's tokens, so keys crossing nodes stay THD's), else THD's; inside a node of 8, THD's or the aligned
    cut, whichever's busiest role costs fewer tiles (ties: the aligned)."""
    for c in range(1, spread.megatron_width(s, local) + 1):
        thd = tuple(thd_chunks(s, c))
        if c == 1 or c > NODE:
            node = node_chunks(s, c, NODE, local, thd_recv(s, c)[0], TILE) if c > NODE else None
            assert node is None or max(spread.chunk_tiles(node, TILE)) < max(thd_tiles(s, c, TILE))
            assert spread.spread_chunks(s, c, local, NODE) == (thd if node is None else node)
            if node is None:
                assert spread.spread_runs(s, c, local, NODE) == thd_runs(s, c)
            continue
        aligned = spread.aligned_chunks(s, c, thd_recv(s, c)[0], local)
        better = aligned is not None and max(spread.chunk_tiles(aligned, TILE)) <= max(thd_tiles(s, c, TILE))
        assert spread.spread_chunks(s, c, local, NODE) == (aligned if better else thd)
        assert spread.spread_chunks(s, c, local, c - 1) == thd  # (the same width past a node of c - 1)


def test_the_aligned_cut_of_17000_tokens_on_8_ranks_costs_the_document_alone() -> None:
    """The docstring's example: THD's 2 x 8 chunks of 1,062-1,063 tokens cost 9,678 tiles, the busiest role 1,222;
    cut on tiles, 8,911 (the document alone) and 1,123; no role receives more than THD's first."""
    s, c = 17_000, 8
    assert sum(thd_tiles(s, c, TILE)) == 9_678 and max(thd_tiles(s, c, TILE)) == 1_222
    chunk = spread.spread_chunks(s, c, 4096, NODE)
    assert chunk == spread.aligned_chunks(s, c, thd_recv(s, c)[0], 4096)
    tiles = spread.chunk_tiles(chunk, TILE)
    assert sum(tiles) == alone_tiles(s, TILE) == 8_911 and max(tiles) == 1_123
    assert max(spread.chunk_recv(chunk)) <= thd_recv(s, c)[0]


@settings(max_examples=300, deadline=None)
@given(local=st.sampled_from([512, 1024, 4096, 8192]), s=st.integers(2, 8 * 8192), c=st.integers(2, 8))
def test_an_aligned_cut_ends_its_chunks_on_tiles_and_costs_the_document_alone(local: int, s: int, c: int) -> None:
    """Where the walk finds a cut: every chunk boundary but the document's end on a tile, every token once, the
    roles' tiles summing to the document's alone (the counter's own segments, :func:`segment_tiles` through
    ``chunk_tiles``), every rank within its room and the receive cap; where spread_chunks takes it, its busiest
    role costs at most THD's."""
    most = thd_recv(s, c)[0]
    chunk = spread.aligned_chunks(s, c, most, local)
    if s > c * local:
        assert chunk is None
    if chunk is None:
        return
    ends = np.cumsum(chunk)
    assert len(chunk) == 2 * c and min(chunk) >= 0 and ends[-1] == s
    assert all(end % TILE == 0 for end in ends[:-1] if end < s)
    assert sum(spread.chunk_tiles(chunk, TILE)) == alone_tiles(s, TILE)
    assert max(chunk_need(chunk)) <= local and max(spread.chunk_recv(chunk)) <= most
    if c <= spread.megatron_width(s, local) and spread.spread_chunks(s, c, local, NODE) == chunk:
        assert max(spread.chunk_tiles(chunk, TILE)) <= max(thd_tiles(s, c, TILE))


def test_aligned_cuts_lower_thds_busiest_role_on_most_widths() -> None:
    """Over 100 documents of 4K-32K tokens on their widths up to Megatron's, inside a node of 8 ranks of 4K: the
    aligned cut is taken on four in five, its busiest role about 3 % under THD's on the mean (never over: else
    THD's)."""
    rng = np.random.default_rng(0)
    ratios = []
    for s in rng.integers(4097, 8 * 4096, size=100).tolist():
        for c in range(max(-(-s // 4096), 2), min(spread.megatron_width(s, 4096), NODE) + 1):
            chunk = spread.spread_chunks(s, c, 4096, NODE)
            ratios.append(max(spread.chunk_tiles(chunk, TILE)) / max(thd_tiles(s, c, TILE)))
    assert len(ratios) > 50 and max(ratios) <= 1.0
    assert np.mean(ratios) < 0.975 and np.mean(np.array(ratios) < 1.0) > 0.75


def test_the_web_document_wider_than_megatron_receives_no_more_than_its_first_role_and_costs_less() -> None:
    """On 5-7 ranks of 8K: no rank receives more than THD's first role on Megatron's 4 (23,600 keys), none holds
    more than 8K, every rank holds a token, and the busiest costs less than THD's 7,718 on 4 (4,824 on 7: the cut
    bisected on 8, whose last role holds nothing, less that role). 8 ranks have no cut."""
    cap = thd_recv(WEB, 4)[0]
    assert cap == 23_600 and max(thd_tiles(WEB, 4, TILE)) == 7_718
    most = []
    for c in range(5, 8):
        chunk = spread.spread_chunks(WEB, c, 8192, NODE)
        assert chunk is not None and len(chunk) == 2 * c and sum(chunk) == WEB and min(chunk) >= 0
        assert max(spread.chunk_recv(chunk)) <= cap < max(thd_recv(WEB, c))  # (THD itself would pass the cap)
        assert max(chunk_need(chunk)) <= 8192 and min(chunk_need(chunk)) > 0
        most.append(max(spread.chunk_tiles(chunk, TILE)))
    assert most == [6_382, 5_327, 4_824]  # (the busiest role: fewer tiles with every rank added)
    assert spread.spread_chunks(WEB, 8, 8192, NODE) is None


def test_a_cut_whose_last_role_holds_nothing_is_the_cut_of_one_rank_fewer() -> None:
    """Bisected on 8 ranks of 1,024, 2,800 tokens leave the last role nothing: 8 ranks have no cut, and 7 take
    that cut less its empty role where it costs fewer tiles than their own (here it does not), so no owners name
    a rank that holds nothing; bisected on 8 ranks of 8K, the web document's cut less its last role is the 7
    ranks' cut, chunk for chunk, with the same tiles and keys a role."""
    assert spread.spread_chunks(2_800, 8, 1024, NODE) is None
    seven = spread.spread_chunks(2_800, 7, 1024, NODE)
    assert seven is not None and min(chunk_need(seven)) > 0 and sum(seven) == 2_800
    cap = thd_recv(WEB, 4)[0]
    eight = spread._capped(WEB, 8, cap, 8192)
    assert eight is not None and eight[7] == eight[8] == 0 and min(chunk_need(eight)[:7]) > 0
    dropped = eight[:7] + eight[9:]
    assert spread.spread_chunks(WEB, 7, 8192, NODE) == dropped
    assert spread.chunk_tiles(dropped, TILE) == spread.chunk_tiles(eight, TILE)[:7]
    assert spread.chunk_recv(dropped) == spread.chunk_recv(eight)[:7]
    own = spread._capped(WEB, 7, cap, 8192)
    assert max(spread.chunk_tiles(own, TILE)) == 4_909 > 4_824 == max(spread.chunk_tiles(dropped, TILE))


@settings(max_examples=150, deadline=None)
@given(local=st.sampled_from([256, 1024, 4096, 8192]), blocks=st.integers(4, 16), extra=st.integers(0, 8191),
       wider=st.integers(1, 16))  # fmt: skip
def test_a_capped_cut_keeps_its_tokens_room_and_receive_cap(local: int, blocks: int, extra: int, wider: int) -> None:
    """Up to twice Megatron's width of 4 or more: a cut exists (at 1,024 tokens a rank or more, for a document
    short of filling Megatron's width: at 1,024 a rank, s = 4,096, 8,192 and 16,384 have none on some widths,
    the first role would need all its room and the rounding's margin; at 256, coarser, more), or the bisection's
    last role holds nothing and one rank fewer has a cut; a cut holds every token once, gives every rank a token,
    and keeps every rank within its room and the receive cap; where none exists, the runs are refused with the
    values."""
    s = (blocks - 1) * local + 1 + extra % local
    width = spread.megatron_width(s, local)
    c = width + 1 + (wider - 1) % width
    cap = thd_recv(s, width)[0]
    chunk = spread.capped_chunks(s, c, cap, local)
    if local >= 1024 and s < width * local and chunk is None:
        bisected = spread._capped(s, c, cap, local)
        assert bisected is not None and chunk_need(bisected)[-1] == 0, (s, c, local)
        assert spread.capped_chunks(s, c - 1, cap, local) is not None, (s, c, local)
    if c > NODE:  # (past a node and Megatron's width: THD's, as Megatron widens a sample into empty ranks)
        assert spread.spread_chunks(s, c, local, NODE) == tuple(thd_chunks(s, c))
    if chunk is not None:
        assert sum(chunk) == s and min(chunk) >= 0 and len(chunk) == 2 * c
        assert max(spread.chunk_recv(chunk)) <= cap and max(chunk_need(chunk)) <= local
        assert min(chunk_need(chunk)) > 0
        assert spread.spread_chunks(s, c, local, NODE) == chunk or c > NODE
    elif c <= NODE:
        with pytest.raises(ValueError, match=f"a document of {s} tokens has no cut over {c} ranks of {local}"):
            spread.spread_runs(s, c, local, NODE)


def test_past_a_node_and_megatrons_width_the_cut_is_thds() -> None:
    """Where Megatron's scheduler widens a sample into ranks it left empty, over more ranks than a node: TE THD's
    ``2c`` chunks, every chunk a token or more (a 1,500-token document on 16 ranks of 1,024: at most 94 tokens a
    rank, the first role receiving all but its own two chunks, 1,407 keys). Inside a node past Megatron's 2 ranks
    there is still no cut, and a document of fewer than ``2c`` tokens has none."""
    assert spread.megatron_width(1_500, 1024) == 2
    chunk = spread.spread_chunks(1_500, 16, 1024, NODE)
    assert chunk == tuple(thd_chunks(1_500, 16)) and min(chunk) >= 46 and max(chunk_need(chunk)) == 94
    assert spread.chunk_recv(chunk)[0] == 1_500 - chunk[0] - chunk[31] == 1_407
    assert spread.spread_chunks(1_500, 4, 1024, NODE) is None and spread.spread_chunks(1_500, 8, 1024, NODE) is None
    assert spread.spread_chunks(31, 16, 1024, NODE) is None and spread.spread_chunks(32, 16, 1024, NODE) is not None


def test_two_ranks_of_megatron_leave_no_wider_cut() -> None:
    """At Megatron's width 2 the cap is half the document: the rank holding the last token must hold half of it,
    the next the rest, and no cut over 3 or 4 ranks keeps the work under THD's on 2."""
    assert spread.spread_chunks(12_000, 3, 8192, NODE) is None and spread.spread_chunks(12_000, 4, 8192, NODE) is None
    with pytest.raises(ValueError, match="a document of 12000 tokens has no cut over 3 ranks of 8192 tokens"):
        spread.spread_runs(12_000, 3, 8192, NODE)


@pytest.mark.parametrize("owners", [(0, 7), (7, -7), (8, 6), (13, -6), (3, 5), (4, 4), (11, -4)])
def test_the_roles_are_what_the_layout_and_the_exchange_count(owners: tuple[int, int]) -> None:
    """A 16 x 8K pack of the web document dealt wider than Megatron, or on Megatron's 4 ranks cut on tile
    boundaries (either orientation), and short documents: per rank, the tiles and received keys of the bench's
    own counters (varlen tiles of the layout, the exchange plan) are the cut's roles'; the document's runs tile
    it and no rank holds more than its positions."""
    from cpdata.bench import world
    from cpdata.layout.world_owners import owner_ranks

    first, c = owners
    lens = np.array([WEB, 3000, 900], dtype=np.int64)
    own = np.array([[first, c], [15, 1], [15, 1]], dtype=np.int64)
    tiles, recv, inter = world._step([(lens, own)], 16, 8192)[0]
    chunk = spread.spread_chunks(WEB, abs(c), 8192, NODE)
    if abs(c) == 4:  # (on tile boundaries: the busiest role 7,650 tiles against THD's 7,718)
        assert chunk != tuple(thd_chunks(WEB, 4)) and max(spread.chunk_tiles(chunk, TILE)) == 7_650
    ranks = list(owner_ranks(first, c))
    assert tiles[ranks].tolist() == list(spread.chunk_tiles(chunk, TILE))
    assert recv[ranks].tolist() == list(spread.chunk_recv(chunk))
    assert inter.sum() == 0 and recv[15] == 0
    starts, lengths, who = owned_runs(lens, own, 16 * 8192, 16, 8)
    doc = starts < WEB
    held = [int(lengths[doc][who[doc] == r].sum()) for r in ranks]
    assert lengths[doc].sum() == WEB and set(who[doc].tolist()) <= set(ranks) and held == list(chunk_need(chunk))
    assert (np.bincount(who, weights=lengths, minlength=16) == 8192).all()


@settings(max_examples=300, deadline=None)
@given(p=st.integers(0, 200_000), n=st.integers(1, 20_000), tile=st.sampled_from([64, 128]))
def test_the_walks_segment_count_is_the_tile_counters(p: int, n: int, tile: int) -> None:
    """aligned_chunks and node_chunks weigh their candidates with a closed form of one segment's varlen tiles
    (causal_tiles.span_tiles, on ints and on arrays); it is the layout's own counter (causal_tiles.segment_tiles)
    for every start and length, on a tile or not."""
    from cpdata.layout.causal_tiles import segment_tiles, span_tiles

    counted = int(segment_tiles(np.array([n]), np.array([p + n]), tile)[0])
    assert spread._segment_tiles(p, p + n, tile) == counted
    assert span_tiles(np.array([p, p], dtype=np.int64), np.array([p + n, p + n]), tile).tolist() == [counted] * 2
    assert spread._segment_tiles(p, p, tile) == 0
