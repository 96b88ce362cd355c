"""Phase A of a step: which outliers (pieces longer than half a pack) form runs now, go loose, or wait.

A *run* is ``dp_size`` outliers of similar length, one per DP rank in one micro-batch slot. A dynamic program
over the outliers sorted by length picks runs and single pieces minimising a run's spread in effective cost (a
piece's key plus ``b * (C - L)**2``, the most its cell's room can add), a loose piece's excess over ``FLEX * b *
C**2`` per other cell of its slot, and waiting (:data:`HOLD_PENALTY` per step of age).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FLEX", "HOLD_PENALTY", "choose_runs"]

FLEX = 0.4
"""A loose outlier's slot: the other cells are assumed to reach ``FLEX * b * C**2`` of quadratic cost (below the
``1/2`` two half-pack pieces would reach: the pool rarely holds enough of them; D2 ``imb_mb`` 2.70 % against 3.08 %)."""
HOLD_PENALTY = 0.01
"""Cost of letting an outlier wait one more step, as a share of a full cell's cost, times (1 + its age)."""


def choose_runs(
    slot: np.ndarray, key: np.ndarray, forced: np.ndarray, age: np.ndarray, todo: np.ndarray, *, capacity: int,
    dp_size: int, slots: int, hold: bool, full_cost: float, quad: float,
) -> tuple[list[np.ndarray], list[int]]:
    """``(runs, loose)`` among the outliers of ``todo``: runs to place now (piece indices, longest first) and
    single pieces to place now; the others wait (only when ``hold``; never an overdue one). Per piece ``[n]``:
    ``slot``, ``key``, ``forced`` (overdue), ``age``, ``todo``; ``slots``: runs that may be placed now."""
    C, R = capacity, dp_size
    outlier = np.flatnonzero((2 * slot > C) & todo)
    b = quad / float(C) ** 2
    total_slots = slots
    by_len = outlier[np.lexsort((outlier, -slot[outlier]))]
    ek = key[by_len] + b * (C - slot[by_len]).astype(np.float64) ** 2
    ids, ages, frc = by_len, age[by_len], forced[by_len]
    n = int(ek.shape[0])
    slots = min(slots, n // R)
    loose_cost = (R - 1) * np.maximum(0.0, ek - FLEX * quad)
    wait_cost = np.where(hold & ~frc, HOLD_PENALTY * full_cost * (1 + ages), np.inf)
    single = np.minimum(loose_cost, wait_cost)
    pre = np.concatenate([[0.0], np.cumsum(ek)])
    now = R * ek[: max(0, n - R + 1)] - (pre[R:] - pre[: max(0, n - R + 1)])
    single_l, now_l = single.tolist(), now.tolist()
    best = [[0.0] * (slots + 1) for _ in range(n + 1)]
    choice = [[0] * (slots + 1) for _ in range(n + 1)]  # 0 single, 1 run now
    for i in range(n - 1, -1, -1):
        s, nxt, row, ch = single_l[i], best[i + 1], best[i], choice[i]
        can = i + R <= n
        nw = now_l[i] if can else 0.0
        jump = best[i + R] if can else nxt
        for k in range(slots + 1):
            b_, c = s + nxt[k], 0
            if k and can and nw + jump[k - 1] < b_:
                b_, c = nw + jump[k - 1], 1
            row[k], ch[k] = b_, c
    lc, wc, frc_l = loose_cost.tolist(), wait_cost.tolist(), frc.tolist()
    for allowed in range(slots, -1, -1):  # overdue pieces left loose need cells outside the runs' slots
        runs: list[np.ndarray] = []
        loose: list[int] = []
        overdue_loose = 0
        i, k = 0, allowed
        while i < n:
            if choice[i][k]:  # a run now
                runs.append(ids[i : i + R].copy())
                i, k = i + R, k - 1
            else:
                if lc[i] <= wc[i]:
                    loose.append(int(ids[i]))
                    overdue_loose += frc_l[i]
                i += 1
        if overdue_loose <= (total_slots - len(runs)) * R:
            break
    return runs, loose
