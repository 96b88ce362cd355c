"""What a world deal costs a rank in time: :class:`WorldCost`, the per-rank predicted time of its tiles, the linear
layers over its positions and its keys over the intra- and inter-node links, from published H100 figures
(:data:`H100_DEFAULTS`) or a calibration file measured on a GPU (:meth:`WorldCost.from_json`, ``make gpu-check``).

The per-pack deal (:mod:`cpdata.layout.world_deal`) picks a document's CP degree with it; ``cpdata bench --sections
world`` reports each system's predicted busiest rank with it; the layout string carries a non-default cost
(:meth:`WorldCost.layout_suffix`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.errors import check_int, check_number

__all__ = ["H100_DEFAULTS", "WorldCost"]

_REQUIRED = ("per_tile_seconds", "intra_node_bytes_per_second", "inter_node_bytes_per_second", "bytes_per_key")


@dataclass(frozen=True, slots=True)
class WorldCost:
    """The physics the deal weighs: predicted per-rank seconds of attention compute and K/V traffic, which
    overlap (the exchange runs while the kernel computes the rank's own keys), after the layer's linear layers,
    which run every position a rank holds, pad included::

        seconds = positions * per_position_seconds
                  + max(tiles * per_tile_seconds,
                        intra_keys * bytes_per_key / intra_node_bytes_per_second,
                        inter_keys * bytes_per_key / inter_node_bytes_per_second)

    ``tiles``: live tiles (:func:`cpdata.layout.tiles.live_tiles`); ``intra_keys`` / ``inter_keys``: keys
    received from the rank's own node / other nodes (:func:`cpdata.layout.exchange.node_recv`); ``positions``:
    the token positions the rank computes (a cpdata rank its whole local row; a GPU given sub-samples, their
    tokens). Only the ratios of the attention terms matter to the deal: it places a step's tokens, and the linear
    layers cost every rank its row whatever it holds. :data:`H100_DEFAULTS` come from published H100 SXM figures
    for one layer of 32 query heads, 8 K/V heads, head dim 128, a SwiGLU MLP of 14,336, bf16, forward and
    backward (derivation: docs/layouts-and-kernels.md); a
    calibration file replaces them (:meth:`from_json`: one JSON object with ``per_tile_seconds`` and any of the
    other fields, the rest keeping these defaults; ``make gpu-check`` writes one, its links unmeasured on one GPU;
    unknown keys are refused, a misspelt key would silently keep a default). The deal reads it from the layout
    string (:meth:`layout_suffix`, :func:`cpdata.layout.maps.layout_spec`), so plans and resumes bind it.

    Attributes:
        per_tile_seconds: seconds of one live ``tile x tile`` tile, forward and backward, one layer.
        intra_node_bytes_per_second: effective all-to-all bandwidth per GPU between ranks of one node.
        inter_node_bytes_per_second: the same between nodes.
        bytes_per_key: bytes one key moves (K and V forward, their gradients backward), one layer.
        per_position_seconds: seconds of one token position through the layer's projections and MLP, forward
            and backward (0: attention alone).
        tile: the tile ``per_tile_seconds`` belongs to.
        source: where the figures come from.
    """

    per_tile_seconds: float = 1.94e-6
    intra_node_bytes_per_second: float = 370e9
    inter_node_bytes_per_second: float = 50e9
    bytes_per_key: float = 8192.0
    per_position_seconds: float = 2.0e-6
    tile: int = 128
    source: str = "published H100 SXM figures (cpdata.layout.world_cost)"

    def __post_init__(self) -> None:
        for name in _REQUIRED:
            check_number(f"WorldCost.{name}", getattr(self, name))
        check_number("WorldCost.per_position_seconds", self.per_position_seconds, positive=False)
        check_int("WorldCost.tile", self.tile, min=1)

    @classmethod
    def from_json(cls, path: str | Path) -> WorldCost:
        """The figures of a calibration file (format: the class docstring); ``ValueError`` naming a missing,
        unknown or bad key."""
        data: Any = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"calibration file {path} must hold one JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown or "per_tile_seconds" not in data:
            raise ValueError(f"calibration file {path}: unknown keys {unknown}, per_tile_seconds "
                             f"{'given' if 'per_tile_seconds' in data else 'missing'}; it holds per_tile_seconds and "
                             f"optionally {[f.name for f in fields(cls)][1:]}")  # fmt: skip
        return cls(**data)

    def layout_suffix(self) -> str:
        """``""`` for the defaults' ratios, else ``":<intra>:<inter>"``: :meth:`keys_per_tile` over each link,
        the only figures the deal weighs, as a ``world`` layout string carries them (exact float reprs)."""
        ratios = (self.keys_per_tile(inter_node=False), self.keys_per_tile(inter_node=True))
        default = (H100_DEFAULTS.keys_per_tile(inter_node=False), H100_DEFAULTS.keys_per_tile(inter_node=True))
        return "" if ratios == default else ":{!r}:{!r}".format(*ratios)

    @classmethod
    def of_ratios(cls, intra: float, inter: float) -> WorldCost:
        """The cost whose :meth:`keys_per_tile` are ``intra`` and ``inter`` (what a layout string carries)."""
        return cls(per_tile_seconds=1.0, intra_node_bytes_per_second=intra, inter_node_bytes_per_second=inter,
                   bytes_per_key=1.0, source="a world layout string")  # fmt: skip

    def seconds(self, tiles: np.ndarray, intra_keys: np.ndarray, inter_keys: np.ndarray,
                positions: np.ndarray | int = 0) -> np.ndarray:  # fmt: skip
        """float64, the shape of the arguments: predicted seconds per rank (the linear layers over ``positions``,
        then attention compute and the two links, which overlap)."""
        compute = np.asarray(tiles, dtype=np.float64) * self.per_tile_seconds
        intra = np.asarray(intra_keys, dtype=np.float64) * (self.bytes_per_key / self.intra_node_bytes_per_second)
        inter = np.asarray(inter_keys, dtype=np.float64) * (self.bytes_per_key / self.inter_node_bytes_per_second)
        linear = np.asarray(positions, dtype=np.float64) * self.per_position_seconds
        return linear + np.maximum(compute, np.maximum(intra, inter))

    def keys_per_tile(self, inter_node: bool) -> float:
        """Keys received over one link in the time of one tile (intra-node, or inter-node)."""
        bw = self.inter_node_bytes_per_second if inter_node else self.intra_node_bytes_per_second
        return self.per_tile_seconds * bw / self.bytes_per_key


H100_DEFAULTS = WorldCost()
"""The published-figure defaults."""
