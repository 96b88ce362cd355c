"""``cpdata.schedule.improve``: exchanges between cells, and the D2 balance they and the FIFO window buy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.bench.schedule_balance import DISTRIBUTIONS, sample_lengths
from cpdata.schedule import CostModel, plan_schedule
from cpdata.schedule.improve import improve_step
from tests.test_schedule import check_schedule


def _state(cell: np.ndarray, slot: np.ndarray, key: np.ndarray, K: int, C: int):
    placed = cell >= 0
    room = C - np.bincount(cell[placed], weights=slot[placed], minlength=K).astype(np.int64)
    load = np.bincount(cell[placed], weights=key[placed], minlength=K)
    return room, load


def _slot_max_sum(load: np.ndarray, room: np.ndarray, rho: float, R: int, M: int) -> float:
    return float((load + rho * room).reshape(M, R).max(axis=1).sum())


def test_an_exchange_lowers_the_costliest_cell_of_a_slot():
    # One slot of two cells (capacity 100, key = tokens**2): [50, 40] costs 4100, [30, 30, 20] 2200.
    slot = np.array([50, 40, 30, 30, 20], dtype=np.int64)
    key = slot.astype(np.float64) ** 2
    cell = np.array([0, 0, 1, 1, 1], dtype=np.int64)
    room, load = _state(cell, slot, key, 2, 100)
    done = improve_step(cell, np.ones(5, bool), slot, key, room, load, 0.0, 2, 1)
    assert done >= 1
    assert cell[0] == 0 and sorted(slot[cell == 1].tolist() + slot[cell == 0].tolist()) == sorted(slot.tolist())
    assert (room >= 0).all()
    room2, load2 = _state(cell, slot, key, 2, 100)  # the arrays it updated agree with the new assignment
    assert (room2 == room).all() and np.allclose(load2, load)
    assert load.max() <= 3400  # 4100 before: the 40 went to the other cell for a 30 (or the 20)


def test_pieces_that_may_not_move_stay_and_a_lone_rank_changes_nothing():
    slot = np.array([60, 30, 10], dtype=np.int64)
    key = slot.astype(np.float64) ** 2
    cell = np.array([0, 0, 1], dtype=np.int64)
    room, load = _state(cell, slot, key, 2, 100)
    before = cell.copy()
    assert improve_step(cell, np.zeros(3, bool), slot, key, room, load, 0.0, 2, 1) == 0
    assert (cell == before).all()
    one = np.array([0, 0, 0], dtype=np.int64)
    room1, load1 = _state(one, slot, key, 1, 100)
    assert improve_step(one, np.ones(3, bool), slot, key, room1, load1, 0.0, 1, 1) == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), R=st.integers(2, 5), M=st.integers(1, 4), rho=st.sampled_from([0.0, 3.0]))
def test_exchanges_keep_capacity_and_never_raise_the_sum_of_slot_maxima(seed, R, M, rho):
    rng = np.random.default_rng(seed)
    C, K = 256, R * M
    n = int(rng.integers(1, 6 * K))
    slot = rng.integers(1, C // 2 + 1, n).astype(np.int64)
    key = slot.astype(np.float64) ** 2
    cell = np.full(n, -1, dtype=np.int64)
    room_l = [C] * K
    for i in rng.permutation(n).tolist():  # a random first-fit placement, some pieces left out
        c = int(rng.integers(K))
        if room_l[c] >= slot[i]:
            cell[i], room_l[c] = c, room_l[c] - int(slot[i])
    movable = (cell >= 0) & (rng.random(n) < 0.8)
    room, load = _state(cell, slot, key, K, C)
    before_cell, before = cell.copy(), _slot_max_sum(load, room, rho, R, M)
    improve_step(cell, movable, slot, key, room, load, rho, R, M)
    room2, load2 = _state(cell, slot, key, K, C)
    assert (room2 == room).all() and np.allclose(load2, load) and (room >= 0).all()
    assert (cell[~movable] == before_cell[~movable]).all() and ((cell >= 0) == (before_cell >= 0)).all()
    assert _slot_max_sum(load, room, rho, R, M) <= before + 1e-9


def _bench_d2(seed: int, max_delay: int = 4):
    d = DISTRIBUTIONS["D2"]
    C, M, R = int(d["capacity"]), int(d["micro_batches"]), 8
    probe = sample_lengths("D2", 100_000, 0)
    lengths = sample_lengths("D2", int(33.5 * R * M * C / probe.mean()), seed)  # the bench's size (32 steps)
    cost = CostModel()
    sched = plan_schedule(lengths, capacity=C, layout="balanced", cp_size=1, dp_size=R, micro_batches=M, cost=cost,
                          max_delay=max_delay)  # fmt: skip
    return lengths, sched, 100 * sched.imbalance(cost)[1][: sched.num_steps - 1]


def test_d2_bench_sample_meets_the_targets_within_the_fifo_window():
    """The bench's own D2 dp 8 sample (seed 9) with ``max_delay=4``: ``imb_mb`` <= 2.5 % mean, <= 6 % p95
    (2.78 / 6.46 before the FIFO window and the exchanges), every step full, no piece more than 4 steps after
    or one step before its FIFO step."""
    lengths, sched, imb_mb = _bench_d2(9)
    assert imb_mb.mean() <= 2.5 and np.percentile(imb_mb, 95) <= 6.0
    assert sched.num_steps == sched.stats.lower_bound_steps
    after = sched.fifo_delay()
    assert after.min() >= -1 and after.max() <= 4
    check_schedule(sched, lengths, "balanced", 1, 4)


def test_d2_targets_hold_across_sampling_seeds():
    """Not a lucky sample: over sampling seeds 1-6 the mean ``imb_mb`` and the mean p95 stay within the targets
    (12-seed means measured: 2.16 % and 5.18 %)."""
    means, p95s = [], []
    for seed in range(1, 7):
        _, sched, imb_mb = _bench_d2(seed)
        means.append(imb_mb.mean())
        p95s.append(np.percentile(imb_mb, 95))
        assert sched.fifo_delay().max() <= 4
    assert np.mean(means) <= 2.5 and np.mean(p95s) <= 6.0
    assert max(means) <= 3.0  # no seed far off
