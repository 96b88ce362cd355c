"""The window search of a spread piece (:func:`cpdata.layout.world_owners.best_window`, and
:func:`~cpdata.layout.world_owners.best_windows` over several widths at once) against brute force: every window of its
width, either orientation, every micro-batch, the roles' room and the receive cap checked one by
one, the least busiest load taken with the documented ties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cpdata.layout.world_owners import best_window, best_windows, owner_ranks, role_costs, windows
from cpdata.layout.world_step import StepBins

WORLD, NODE, PACKS, LOCAL, TILE = 16, 4, 3, 1024, 128


def _brute(cut, room, load, recv, cap, pack):
    need, added, keys = (a.tolist() for a in cut)
    c, found = len(need), []
    for k in range(PACKS) if pack is None else (pack,):
        for a in windows(WORLD, NODE, c):
            for o, (first, signed) in enumerate(((a, c), (a + c - 1, -c))):
                ranks = list(owner_ranks(first, signed))
                if any(room[r][k] < need[j] for j, r in enumerate(ranks)):
                    continue
                receiver = max(recv[r] + keys[j] for j, r in enumerate(ranks))
                if receiver > cap:
                    continue
                busiest = max(load[r] + added[j] for j, r in enumerate(ranks))
                found.append(((busiest, k, a, receiver, o), (busiest, k, first, signed)))
    return min(found)[1] if found else None


@pytest.mark.parametrize("seed", range(40))
def test_best_window_is_the_least_loaded_placement_within_room_and_cap(seed: int) -> None:
    rng = np.random.default_rng(seed)
    s = int(rng.integers(LOCAL + 1, 6 * LOCAL))
    widths = [c for c in range(-(-s // LOCAL), 2 * NODE + 1) if role_costs(s, c, LOCAL, TILE, NODE) is not None]
    c = int(rng.choice(widths))  # (inside a node and past it)
    cut = role_costs(s, c, LOCAL, TILE, NODE)
    room = rng.integers(0, LOCAL + 1, size=(WORLD, PACKS)) if seed % 3 else np.full((WORLD, PACKS), LOCAL)
    load = rng.integers(0, 40, size=WORLD).astype(np.float64)  # (ties in load: small integers)
    recv = rng.integers(0, 2 * s, size=WORLD)
    cap = math.inf if seed % 2 else float(np.quantile(recv, 0.7) + cut[2].max())
    pack = None if seed % 4 else int(rng.integers(0, PACKS))
    got = best_window(cut, room, load, recv, cap, NODE, pack)
    assert got == _brute(cut, room.tolist(), load.tolist(), recv.tolist(), cap, pack)


def test_equal_loads_go_to_the_orientation_whose_busiest_receiver_is_least() -> None:
    cut = role_costs(3 * LOCAL, 4, LOCAL, TILE, NODE)  # roles receive unequal keys: the first most
    room, load = np.full((WORLD, PACKS), LOCAL), np.zeros(WORLD)
    recv = np.zeros(WORLD, dtype=np.int64)
    recv[0] = 10_000  # rank 0 took a first role before: mirrored, it takes the last role here
    got = best_window(cut, room, load, recv, math.inf, NODE)
    assert got[1:] == (0, 3, -4) and cut[2][0] > cut[2][-1]
    recv[:] = 0
    assert best_window(cut, room, load, recv, math.inf, NODE)[1:] == (0, 0, 4)  # (no receiver: THD's order)
    assert best_window(cut, np.zeros((WORLD, PACKS), dtype=np.int64), load, recv, math.inf, NODE) is None


def test_best_windows_is_each_widths_own_search() -> None:
    placed, empty = 0, 0
    for seed in range(60):
        rng = np.random.default_rng(100 + seed)
        s = int(rng.integers(LOCAL + 1, 6 * LOCAL))
        widths = [c for c in range(-(-s // LOCAL), 2 * NODE + 1) if role_costs(s, c, LOCAL, TILE, NODE) is not None]
        widths = sorted(rng.choice(widths, size=int(rng.integers(1, len(widths) + 1)), replace=False).tolist())
        cuts = [role_costs(s, c, LOCAL, TILE, NODE) for c in widths]
        room = rng.integers(0, LOCAL + 1, size=(WORLD, PACKS))
        room[rng.random((WORLD, PACKS)) < 0.4] = LOCAL  # (some micro-batches hold a wide piece, some do not)
        load = rng.integers(0, 40, size=WORLD).astype(np.float64)
        recv = rng.integers(0, 2 * s, size=WORLD)
        caps = [math.inf if rng.random() < 0.3 else float(np.quantile(recv, 0.6) + cut[2].max()) for cut in cuts]
        pack = None if seed % 3 else int(rng.integers(0, PACKS))
        got = best_windows(cuts, room, load, recv, caps, NODE, pack)
        books = room.tolist(), load.tolist(), recv.tolist()
        want = [_brute(cut, *books, cap, pack) for cut, cap in zip(cuts, caps, strict=True)]
        assert got == want, (seed, widths)
        placed += sum(w is not None for w in want)
        empty += sum(w is None for w in want)
    assert placed >= 40 and empty >= 10  # (compared on placements and on widths with none, not on empty answers)


def test_choose_widths_skips_only_widths_with_no_room() -> None:
    """The books' search (:meth:`~cpdata.layout.step_loads.StepLoads.choose_widths`) leaves out the widths whose
    least role more than all but fewer than their ranks have room for. Books where one window of a width has each
    role's room to the token and every other rank one token less than the least role: that width still lands there,
    and every width's answer is the search's over the whole books."""
    s = 4 * LOCAL - 301
    widths = list(range(-(-s // LOCAL), 2 * NODE + 1))
    cuts = [role_costs(s, c, LOCAL, TILE, NODE) for c in widths]
    assert any(cut[0].min() < cut[0].max() for cut in cuts if cut is not None)  # (roles of unequal room)
    for c, cut in zip(widths, cuts, strict=True):
        if cut is None:
            continue
        first, k = windows(WORLD, NODE, c)[-1], PACKS - 1
        bins = StepBins(PACKS, WORLD, LOCAL, NODE, TILE)
        for r in range(WORLD):
            for j in range(PACKS):
                room = int(cut[0][r - first]) if j == k and first <= r < first + c else int(cut[0].min()) - 1
                bins.restore(LOCAL - room, (j, r, 1))
        room, load, recv = bins.snapshot()
        got = bins.choose_widths(s, widths, math.inf)
        assert got == [None if cut is None else best_window(cut, room, load, recv, math.inf, NODE) for cut in cuts]
        assert got[widths.index(c)][1:] == (k, first, c)
    assert bins.choose_widths(s, [WORLD + 1], math.inf) == [None]  # (wider than the world: no window)
    assert bins.widths_under(s, [WORLD + 1, widths[0]], math.inf) == [widths[0]]
