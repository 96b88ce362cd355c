"""The physics the ``world`` deal weighs: predicted per-rank seconds of attention compute and K/V traffic.

Compute and the two links overlap (the exchange runs while the kernel computes the rank's own keys)::

    seconds = max(tiles * per_tile_seconds,
                  intra_keys * bytes_per_key / intra_node_bytes_per_second,
                  inter_keys * bytes_per_key / inter_node_bytes_per_second)

``tiles``: live ``tile x tile`` tiles (:func:`cpdata.layout.tiles.live_tiles`); ``intra_keys`` /
``inter_keys``: keys received from the rank's own node / other nodes
(:func:`cpdata.layout.exchange.node_recv`). :data:`H100_DEFAULTS` come from published H100 SXM figures for
one layer of 32 query heads, 8 K/V heads, head dim 128, bf16, forward and backward (their derivation:
docs/layouts-and-kernels.md); a calibration file measured on a GPU replaces them (:meth:`WorldCost.from_json`:
one JSON object with the four fields of ``_REQUIRED``, optionally ``tile`` and ``source``; unknown keys are
refused, a misspelt key would silently keep a default). Only ratios matter to the deal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.errors import check_int

__all__ = ["H100_DEFAULTS", "WorldCost"]

_REQUIRED = ("per_tile_seconds", "intra_node_bytes_per_second", "inter_node_bytes_per_second", "bytes_per_key")


@dataclass(frozen=True, slots=True)
class WorldCost:
    """Per-tile compute cost and link bandwidths (see the module docstring).

    Attributes:
        per_tile_seconds: seconds of one live ``tile x tile`` tile, forward and backward, one layer.
        intra_node_bytes_per_second: effective all-to-all bandwidth per GPU between ranks of one node.
        inter_node_bytes_per_second: the same between nodes.
        bytes_per_key: bytes one key moves (K and V forward, their gradients backward), one layer.
        tile: the tile ``per_tile_seconds`` belongs to.
        source: where the figures come from.
    """

    per_tile_seconds: float = 1.94e-6
    intra_node_bytes_per_second: float = 370e9
    inter_node_bytes_per_second: float = 50e9
    bytes_per_key: float = 8192.0
    tile: int = 128
    source: str = "published H100 SXM figures (cpdata.layout.world_cost)"

    def __post_init__(self) -> None:
        for name in _REQUIRED:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"WorldCost.{name} must be a finite number > 0, got {value!r}")
        check_int("WorldCost.tile", self.tile, min=1)

    @classmethod
    def from_json(cls, path: str | Path) -> WorldCost:
        """The figures of a calibration file (format: the module docstring); ``ValueError`` naming a missing,
        unknown or bad key."""
        data: Any = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"calibration file {path} must hold one JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = [k for k in _REQUIRED if k not in data]
        if unknown or missing:
            raise ValueError(f"calibration file {path}: missing keys {missing}, unknown keys {unknown}; it holds "
                             f"{list(_REQUIRED)} and optionally 'tile', 'source'")  # fmt: skip
        return cls(**data)

    def seconds(self, tiles: np.ndarray, intra_keys: np.ndarray, inter_keys: np.ndarray) -> np.ndarray:
        """float64, the shape of the arguments: predicted seconds per rank (compute and the two links overlap)."""
        compute = np.asarray(tiles, dtype=np.float64) * self.per_tile_seconds
        intra = np.asarray(intra_keys, dtype=np.float64) * (self.bytes_per_key / self.intra_node_bytes_per_second)
        inter = np.asarray(inter_keys, dtype=np.float64) * (self.bytes_per_key / self.inter_node_bytes_per_second)
        return np.maximum(compute, np.maximum(intra, inter))

    def keys_per_tile(self, inter_node: bool) -> float:
        """Keys received over one link in the time of one tile (intra-node, or inter-node)."""
        bw = self.inter_node_bytes_per_second if inter_node else self.intra_node_bytes_per_second
        return self.per_tile_seconds * bw / self.bytes_per_key


H100_DEFAULTS = WorldCost()
"""The published-figure defaults."""
