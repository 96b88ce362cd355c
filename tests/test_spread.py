"""How the world step cuts a spread document (cpdata.layout.spread): TE THD's chunks up to Megatron's width, the
receive-capped cut wider; the roles' tokens, tiles and received keys as the real layout and exchange count them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.layout import spread
from cpdata.layout.spread import thd_recv
from cpdata.layout.world_plan import chunk_need, thd_chunks, thd_runs
from cpdata.layout.world_step import owned_runs
from tests.test_world_step import thd_tiles

TILE = 128
WEB = 31_467  # web 16 x 8K, seed 13: the document that stood on 4 ranks at 1.375 x the step's mean rank


def test_megatron_width_is_the_power_of_two_of_the_fewest_ranks() -> None:
    lengths = (1, 8192, 8193, 16384, 16385, WEB, 32768, 32769)
    assert [spread.megatron_width(s, 8192) for s in lengths] == [1, 1, 2, 2, 4, 4, 4, 8]


@pytest.mark.parametrize(("s", "local"), [(WEB, 8192), (8193, 8192), (100_000, 4096)])
def test_up_to_megatron_width_the_cut_is_thds(s: int, local: int) -> None:
    for c in range(1, spread.megatron_width(s, local) + 1):
        assert spread.spread_chunks(s, c, local) == tuple(thd_chunks(s, c))
        assert spread.spread_runs(s, c, local) == thd_runs(s, c)


def test_the_web_document_wider_than_megatron_receives_no_more_than_its_first_role_and_costs_less() -> None:
    """On 5-8 ranks of 8K: no rank receives more than THD's first role on Megatron's 4 (23,600 keys), none holds
    more than 8K, and the busiest costs less than THD's 7,718 on 4 (4,824 on 8)."""
    cap = thd_recv(WEB, 4)[0]
    assert cap == 23_600 and max(thd_tiles(WEB, 4, TILE)) == 7_718
    most = []
    for c in range(5, 9):
        chunk = spread.spread_chunks(WEB, c, 8192)
        assert chunk is not None and len(chunk) == 2 * c and sum(chunk) == WEB and min(chunk) >= 0
        assert max(spread.chunk_recv(chunk)) <= cap < max(thd_recv(WEB, c))  # (THD itself would pass the cap)
        assert max(chunk_need(chunk)) <= 8192
        most.append(max(spread.chunk_tiles(chunk, TILE)))
    assert most == [6_382, 5_327, 4_909, 4_824]  # (the busiest role: fewer tiles with every rank added)


@settings(max_examples=150, deadline=None)
@given(local=st.sampled_from([256, 1024, 4096, 8192]), blocks=st.integers(4, 16), extra=st.integers(0, 8191),
       wider=st.integers(1, 16))  # fmt: skip
def test_a_capped_cut_keeps_its_tokens_room_and_receive_cap(local: int, blocks: int, extra: int, wider: int) -> None:
    """Up to twice Megatron's width of 4 or more: a cut exists (at 1,024 tokens a rank or more, for a document
    short of filling Megatron's width: at 1,024 a rank, s = 4,096, 8,192 and 16,384 have none on some widths,
    the first role would need all its room and the rounding's margin; at 256, coarser, more), holds every token
    once, and keeps every rank within its room and the receive cap; where none exists, the runs are refused
    with the values."""
    s = (blocks - 1) * local + 1 + extra % local
    width = spread.megatron_width(s, local)
    c = width + 1 + (wider - 1) % width
    cap = thd_recv(s, width)[0]
    chunk = spread.capped_chunks(s, c, cap, local)
    if local >= 1024 and s < width * local:
        assert chunk is not None, (s, c, local)
    if chunk is not None:
        assert sum(chunk) == s and min(chunk) >= 0 and len(chunk) == 2 * c
        assert max(spread.chunk_recv(chunk)) <= cap and max(chunk_need(chunk)) <= local
        assert spread.spread_chunks(s, c, local) == chunk
    else:
        with pytest.raises(ValueError, match=f"a document of {s} tokens has no cut over {c} ranks of {local}"):
            spread.spread_runs(s, c, local)


def test_two_ranks_of_megatron_leave_no_wider_cut() -> None:
    """At Megatron's width 2 the cap is half the document: the rank holding the last token must hold half of it,
    the next the rest, and no cut over 3 or 4 ranks keeps the work under THD's on 2."""
    assert spread.spread_chunks(12_000, 3, 8192) is None and spread.spread_chunks(12_000, 4, 8192) is None
    with pytest.raises(ValueError, match="a document of 12000 tokens has no cut over 3 ranks of 8192 tokens"):
        spread.spread_runs(12_000, 3, 8192)


@pytest.mark.parametrize("owners", [(0, 8), (7, -8), (8, 6), (13, -6), (3, 5)])
def test_the_roles_are_what_the_layout_and_the_exchange_count(owners: tuple[int, int]) -> None:
    """A 16 x 8K pack of the web document dealt wider than Megatron (either orientation) and short documents:
    per rank, the tiles and received keys of the bench's own counters (varlen tiles of the layout, the exchange
    plan) are the cut's roles'; the document's runs tile it and no rank holds more than its positions."""
    from cpdata.bench import world
    from cpdata.layout.world_step import owner_ranks

    first, c = owners
    lens = np.array([WEB, 3000, 900], dtype=np.int64)
    own = np.array([[first, c], [15, 1], [15, 1]], dtype=np.int64)
    tiles, recv, inter = world._step([(lens, own)], 16, 8192)[0]
    chunk = spread.spread_chunks(WEB, abs(c), 8192)
    ranks = list(owner_ranks(first, c))
    assert tiles[ranks].tolist() == list(spread.chunk_tiles(chunk, TILE))
    assert recv[ranks].tolist() == list(spread.chunk_recv(chunk))
    assert inter.sum() == 0 and recv[15] == 0
    starts, lengths, who = owned_runs(lens, own, 16 * 8192, 16)
    doc = starts < WEB
    held = [int(lengths[doc][who[doc] == r].sum()) for r in ranks]
    assert lengths[doc].sum() == WEB and set(who[doc].tolist()) <= set(ranks) and held == list(chunk_need(chunk))
    assert (np.bincount(who, weights=lengths, minlength=16) == 8192).all()
