"""What a CP trainer adds to each Trainer log line: padding, CP imbalance and tokens per second.

Read from each batch's host-side ``info`` (Python ints, no device sync), summed
between two log calls:

==================  ===========================================================================
``cp_padding_pct``  100 x (1 - real tokens / pack tokens) over the packs trained since the last log
``cp_imbalance``    mean over packs of the busiest CP rank's causal attention work over the mean
                    rank's (a token at document position p costs p + 1; 1.0 = perfectly even)
``cp_tokens_per_s`` real (non-pad) tokens trained per second, over every DP group
                    (one all-reduce over the DP group per log when dp > 1)
==================  ===========================================================================

Every CP rank of a DP group sees the same packs, so the figures are the same on
each of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PackMetrics"]


class PackMetrics:
    """Accumulates per-pack figures between Trainer logs; :meth:`drain` returns and resets them."""

    def __init__(self, dp_group: Any = None, dp_size: int = 1, device: torch.device | str = "cpu") -> None:
        self.dp_group, self.dp_size, self.device = dp_group, dp_size, torch.device(device)
        self._since = time.perf_counter()
        self._real = self._pack = self._packs = 0
        self._imbalance = 0.0

    def add(self, info: Mapping[str, Any]) -> None:
        """One trained batch (``ShardedBatch.info``: ``real_tokens``, ``pack_tokens``, ``causal_work``)."""
        self._real += int(info["real_tokens"])
        self._pack += int(info["pack_tokens"])
        work = torch.as_tensor(info["causal_work"], dtype=torch.float64)
        self._imbalance += (work.max() / work.mean()).item() if work.sum() > 0 else 1.0
        self._packs += 1

    def drain(self) -> dict[str, float]:
        """The figures since the last drain (empty when no pack was trained); collective when dp > 1."""
        now = time.perf_counter()
        elapsed, self._since = now - self._since, now
        real = float(self._real)
        if self.dp_size > 1:  # every rank logs at the same steps, so every rank reaches this collective
            total = torch.tensor([real], dtype=torch.float64, device=self.device)
            dist.all_reduce(total, group=self.dp_group)
            real = total.item()
        out: dict[str, float] = {}
        if self._packs:
            out = {
                "cp_padding_pct": 100.0 * (1.0 - self._real / self._pack) if self._pack else 0.0,
                "cp_imbalance": self._imbalance / self._packs,
                "cp_tokens_per_s": real / elapsed if elapsed > 0 else 0.0,
            }
        self._real = self._pack = self._packs = 0
        self._imbalance = 0.0
        return out
