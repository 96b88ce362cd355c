"""Between phases B and C of a step: exchanges of pieces between cells that lower the slots' costliest cells.

Each round scores at once, with numpy, every exchange between the costliest cell of a slot and another cell
(piece for piece, or a move; pieces of at most half a pack) by the change of the sum of the slots' maxima,
applies the best, then the best among those touching neither of its slots; at most :data:`ROUNDS` rounds. A
cell's score is ``load + rho * room``: what the fillers will still add to it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GAIN", "ROUNDS", "improve_step"]

ROUNDS = 12
"""Rounds of exchanges per step at most (each scores every candidate once)."""
GAIN = 1e-4
"""An exchange is applied only if it lowers the sum of the slots' maxima by more than this share of a slot's."""


def improve_step(cell: np.ndarray, movable: np.ndarray, slot: np.ndarray, key: np.ndarray, room: np.ndarray,
                 load: np.ndarray, rho: float, dp_size: int, micro_batches: int) -> int:  # fmt: skip
    """Apply exchanges in place on ``cell`` (int64 ``[n]``, -1: not placed), ``room`` and ``load`` (``[K]``: free
    tokens and key sum per cell); returns how many. ``movable``: bool ``[n]``; ``rho``: the fillers' key per token.
    """
    R, M = dp_size, micro_batches
    K = R * M
    ids = np.flatnonzero(movable)
    if R < 2 or not ids.size:
        return 0
    slot_of = np.arange(K) // R
    rows = np.arange(M)
    # Partners: every movable piece, and "nothing" in every cell (a move). A piece's weight is its key less
    # what its tokens of filler would add (``rho`` per token): an exchange shifts ``w_x - w_y`` from a to b.
    s_all = np.concatenate([slot[ids], np.zeros(K, np.int64)])
    w_all = np.concatenate([key[ids] - rho * slot[ids], np.zeros(K)])
    by = np.concatenate([cell[ids], np.arange(K)])
    n_ids = ids.shape[0]
    done = 0
    for _ in range(ROUNDS):
        est = load + rho * room
        e2 = est.reshape(M, R)
        order = np.argsort(e2, axis=1, kind="stable")
        top1, top2 = e2[rows, order[:, -1]], e2[rows, order[:, -2]]
        top3 = e2[rows, order[:, -3]] if R > 2 else np.full(M, -np.inf)
        arg1, arg2 = order[:, -1] + rows * R, order[:, -2] + rows * R
        is_top = np.zeros(K, bool)
        is_top[arg1] = True
        xs = np.flatnonzero(is_top[by[:n_ids]])
        if not xs.size:
            break
        a = by[xs]
        ma = slot_of[a]
        ta = top1[ma][:, None]
        mb = slot_of[by]
        sx = s_all[xs][:, None]
        ok = (sx <= (room[by] + s_all)[None, :]) & (s_all[None, :] <= room[a][:, None] + sx) & (by != a[:, None])
        w = w_all[xs][:, None] - w_all[None, :]
        new_a = ta - w
        new_b = est[by][None, :] + w
        excl_b = np.where(by == arg1[mb], top2[mb], top1[mb])  # b's slot maximum without b
        # Another slot: a's slot falls to max(new_a, its second), b's rises to max(new_b, its max without b).
        delta = np.maximum(new_a, top2[ma][:, None]) + (np.maximum(new_b, excl_b) - top1[mb]) - ta
        same = ma[:, None] == mb[None, :]
        if same.any():  # a's own slot: max(new_a, new_b, the slot without a and b)
            rest = np.where(by[None, :] == arg2[ma][:, None], top3[ma][:, None], top2[ma][:, None])
            delta = np.where(same, np.maximum(np.maximum(new_a, new_b), rest) - ta, delta)
        delta = np.where(ok, delta, np.inf)
        # Apply the best exchange, then the best among those in slots it left alone (their scores still hold).
        applied = 0
        while True:
            j = int(np.argmin(delta))
            i, k = divmod(j, by.shape[0])
            if not delta[i, k] < -GAIN * ta[i, 0]:
                break
            src, dst = int(a[i]), int(by[k])
            moved = int(s_all[xs[i]] - s_all[k])
            cell[ids[xs[i]]] = dst
            by[xs[i]] = dst
            if k < n_ids:
                cell[ids[k]] = src
                by[k] = src
            room[src] += moved
            room[dst] -= moved
            dkey = float(w[i, k]) + rho * moved
            load[src] -= dkey
            load[dst] += dkey
            applied += 1
            m1, m2 = int(ma[i]), int(mb[k])
            delta[(ma == m1) | (ma == m2)] = np.inf
            delta[:, (mb == m1) | (mb == m2)] = np.inf
        if not applied:
            break
        done += applied
    return done
