"""Imbalance of a schedule's pack costs across DP ranks (the figures ``cpdata bench`` reports).

With pack costs ``c[r, m]``: ``imb_step = max_r sum_m c / mean_r sum_m c - 1`` (DDP: one sync per step) and
``imb_mb = sum_m max_r c / sum_m mean_r c - 1`` (FSDP / ZeRO-3 / pipeline: a sync per micro-batch);
``imb_mb >= imb_step``, both 0 when balanced.
"""

from __future__ import annotations

import numpy as np

__all__ = ["imbalance"]


def imbalance(costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(imb_step, imb_mb)``, float64 ``[steps]`` each, from costs ``[steps, dp_size, micro_batches]`` (a step
    that costs nothing: 0)."""
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 3:
        raise ValueError(f"costs must be [steps, dp_size, micro_batches], got shape {c.shape}")
    per_rank = c.sum(axis=2)
    mean = per_rank.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    imb_step = np.where(mean > 0, per_rank.max(axis=1) / safe - 1.0, 0.0)
    imb_mb = np.where(mean > 0, c.max(axis=1).sum(axis=1) / safe - 1.0, 0.0)
    return imb_step, imb_mb
