"""Phase A of a step: which outliers (pieces longer than half a pack) form runs now, go loose, or wait.

A *run* is ``dp_size`` outliers of similar length, one per DP rank in one
micro-batch slot, so the slot's cells cost nearly the same. Outliers are
sorted by length (longest first) and a dynamic program cuts the sequence into
runs of ``dp_size`` neighbours and single pieces, minimising:

- a run's *spread*, ``sum(ek[top] - ek[j])`` in "effective" cost (a piece's
  key plus the most its cell's leftover room can still add, ``b * (C - L)**2``);
- a single piece's *loose* cost, what the cells of its slot cannot match
  without an outlier, ``(dp_size - 1) * max(0, ek - FLEX * b * C**2)``;
- waiting: :data:`HOLD_PENALTY` of a full cell per step of age.

At most ``slots`` runs are placed now, fewer when overdue pieces left loose
need cells outside the runs' slots (one per cell).

``FLEX`` is below the ``1/2`` that two half-pack pieces per cell would reach:
the pool rarely holds ``2 * (dp_size - 1)`` such pieces, so an outlier just
over half a pack left loose costs its slot more than the ideal suggests
(``cpdata bench --sections schedule``, D2 over 12 sampling seeds: ``imb_mb``
3.08 % with ``1/2``, 2.70 % with 0.4).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FLEX", "HOLD_PENALTY", "choose_runs"]

FLEX = 0.4
"""A loose outlier's slot: the other cells are assumed to reach ``FLEX * b * C**2`` of quadratic cost."""
HOLD_PENALTY = 0.01
"""Cost of letting an outlier wait one more step, as a share of a full cell's cost, times (1 + its age)."""


def choose_runs(
    slot: np.ndarray, key: np.ndarray, forced: np.ndarray, age: np.ndarray, todo: np.ndarray, *, capacity: int,
    dp_size: int, slots: int, hold: bool, full_cost: float, quad: float,
) -> tuple[list[np.ndarray], list[int]]:
    """``(runs, loose)`` among the outliers of ``todo``: runs to place now (piece indices, longest first)
    and single pieces to place now; the other outliers of ``todo`` wait.

    Args:
        slot, key, forced, age, todo: per piece of the pool (``[n]``): slot tokens, balancing key,
            overdue, steps waited, still to place.
        slots: runs that may be placed now (fewer when overdue outliers need slots of their own).
        hold: outliers that are not overdue may wait (otherwise every outlier is placed now).
    """
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
            c = choice[i][k]
            if c == 1:
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
