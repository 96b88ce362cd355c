"""The window search of a spread piece (:func:`cpdata.layout.world_owners.best_window`) against brute force: every
window of its width, either orientation, every micro-batch, the roles' room and the receive cap checked one by
one, the least busiest load taken with the documented ties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cpdata.layout.world_owners import best_window, owner_ranks, role_costs, windows

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
