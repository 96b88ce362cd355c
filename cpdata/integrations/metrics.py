"""What a CP trainer adds to each Trainer log line (``cp_padding_pct``, ``cp_tiles_max_over_ideal``,
``cp_tokens_per_s``; docs/trainers.md), summed between two logs from each batch's host-side ``info``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cpdata.layout.tiled import DEFAULT_TILE as TILE
from cpdata.layout.tiles import ideal_tiles, live_tiles

__all__ = ["TILE", "PackMetrics", "pack_tiles"]


def pack_tiles(batch: Any, tile: int = TILE) -> tuple[float, float]:
    """``(this rank's live tiles, the pack's tiles at cp 1 / cp)`` of a ``ShardedBatch``: its row's queries
    over the ``padded_seq_len`` keys, documents from ``cu_seqlens_padded``."""
    layout = batch.layout
    if layout.cp_size == 1:  # one rank holds the pack: even by definition
        return 1.0, 1.0
    rows = np.asarray(layout.local_token_global_indices, dtype=np.int64).reshape(1, -1)
    size = int(layout.padded_seq_len)
    slots = np.diff(np.asarray(batch["cu_seqlens_padded"], dtype=np.int64))
    return float(live_tiles(rows, slots, size, tile)[0]), ideal_tiles(slots, size, tile, layout.cp_size)


class PackMetrics:
    """Accumulates per-pack figures between Trainer logs; :meth:`drain` returns and resets them."""

    def __init__(self, dp_group: Any = None, dp_size: int = 1, device: torch.device | str = "cpu", *,
                 cp_group: Any = None, cp_size: int = 1) -> None:  # fmt: skip
        self.dp_group, self.dp_size, self.device = dp_group, dp_size, torch.device(device)
        self.cp_group, self.cp_size = cp_group, cp_size
        self._since = time.perf_counter()
        self._real = self._pack = 0
        self._tiles: list[tuple[float, float]] = []

    def add(self, batch: Any) -> None:
        """One trained ``ShardedBatch`` (its ``info["real_tokens"]``, ``info["pack_tokens"]`` and layout)."""
        self._real += int(batch.info["real_tokens"])
        self._pack += int(batch.info["pack_tokens"])
        self._tiles.append(pack_tiles(batch))

    def drain(self) -> dict[str, float]:
        """The figures since the last drain (empty when no pack was trained); collective when dp or cp > 1."""
        now = time.perf_counter()
        elapsed, self._since = now - self._since, now
        real = float(self._real)
        if self.dp_size > 1:  # every rank logs at the same steps, so every rank reaches this collective
            total = torch.tensor([real], dtype=torch.float64, device=self.device)
            dist.all_reduce(total, group=self.dp_group)
            real = total.item()
        out: dict[str, float] = {}
        if self._tiles:
            tiles = torch.tensor(self._tiles, dtype=torch.float64, device=self.device)  # [packs, (mine, ideal)]
            if self.cp_size > 1 and dist.is_available() and dist.is_initialized():  # every rank's ideal is equal
                dist.all_reduce(tiles, op=dist.ReduceOp.MAX, group=self.cp_group)
            out = {
                "cp_padding_pct": 100.0 * (1.0 - self._real / self._pack) if self._pack else 0.0,
                "cp_tiles_max_over_ideal": (tiles[:, 0] / tiles[:, 1].clamp_min(1e-12)).mean().item(),
                "cp_tokens_per_s": real / elapsed if elapsed > 0 else 0.0,
            }
        self._real = self._pack = 0
        self._tiles = []
        return out
