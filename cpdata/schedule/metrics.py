"""Imbalance of a schedule's pack costs across DP ranks (the figures ``cpdata bench`` reports).

For one step with pack costs ``c[r, m]`` (DP rank ``r``, micro-batch ``m``):

- ``imb_step = max_r sum_m c[r, m] / mean_r sum_m c[r, m] - 1``: DDP, one
  gradient sync per step, so the slowest rank's whole step sets the pace.
- ``imb_mb = sum_m max_r c[r, m] / sum_m mean_r c[r, m] - 1``: FSDP / ZeRO-3 /
  pipeline parallelism, which synchronise every micro-batch.

Both are 0 for a perfectly balanced step; ``imb_mb >= imb_step`` always.
"""

from __future__ import annotations

import numpy as np

__all__ = ["imbalance"]


def imbalance(costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(imb_step, imb_mb)``, float64 ``[steps]`` each, from costs ``[steps, dp_size, micro_batches]``.

    A missing pack (a rank with fewer micro-batches) costs 0. A step that costs
    nothing has imbalance 0.
    """
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 3:
        raise ValueError(f"costs must be [steps, dp_size, micro_batches], got shape {c.shape}")
    per_rank = c.sum(axis=2)
    mean = per_rank.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    imb_step = np.where(mean > 0, per_rank.max(axis=1) / safe - 1.0, 0.0)
    imb_mb = np.where(mean > 0, c.max(axis=1).sum(axis=1) / safe - 1.0, 0.0)
    return imb_step, imb_mb
