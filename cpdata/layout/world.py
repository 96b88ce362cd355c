"""Layout ``world``: the whole DP x CP world as one CP group, short documents whole on one rank.

``cp_size`` is the world (DP folded in); the layout string carries the ranks per node (``"world:8"``,
:func:`cpdata.layout.maps.layout_spec` with ``node_size=``; ``"world"`` is one node), passed by the caller:
nothing here reads the environment, and a world that is not a multiple of the node size is refused. The deal
(:mod:`cpdata.layout.world_deal`) runs on the dataloader worker, so the per-document CP degree costs no
process group per size, no in-step collective and no host sync. :func:`world_block`'s tables are span tables
(:mod:`cpdata.layout.spans`): a rank's row and the inverse map are one ``repeat`` and one add over the runs.
"""

from __future__ import annotations

import numpy as np

from cpdata.layout.runs import _per_pack
from cpdata.layout.spans import SpanBlock, SpanTable
from cpdata.layout.world_deal import world_runs

__all__ = ["WorldBlock", "WorldTable", "world_block"]

WorldBlock, WorldTable = SpanBlock, SpanTable
"""``world``'s tables: span tables (:mod:`cpdata.layout.spans`), one span per run of the deal."""


def world_block(lens: np.ndarray, counts: np.ndarray | None, pack_len: int, cp_size: int, node_size: int,
                tile: int = 128) -> SpanBlock:  # fmt: skip
    """``world`` tables of ``P`` packs (``lens`` int64 ``[N]`` checked slot lengths, ``counts`` int64 ``[P]``
    slots per pack, None: one pack): one :func:`~cpdata.layout.world_deal.world_runs` per pack."""
    runs = [world_runs(pack, pack_len, cp_size, node_size, tile) for pack in _per_pack(lens, counts)]
    starts, lengths, owners = (np.concatenate(part) for part in zip(*runs, strict=True))
    spans = np.array([r[0].shape[0] for r in runs], dtype=np.int64)
    return SpanBlock(pack_len, cp_size, lens, counts, starts, lengths, owners, spans)
