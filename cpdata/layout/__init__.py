"""Layouts: which global token positions each CP rank owns (pure numpy, plus the record that carries them).

Role: the coordinate system every other part uses. A layout is one integer map
(``rows[r]`` = the global positions of rank ``r``'s tokens, in local order) and
its inverse; everything here is a pure function of document lengths, so every
CP rank computes the same map without talking.

Modules, in pipeline order: ``maps`` (the layouts: ``rank_indices``,
``LAYOUTS``, ``alignment``, ``inverse_indices``, causal work), ``runs`` (a
layout as runs of consecutive positions, the table the worker gathers from),
``blocks`` (run tables of a block of packs at once), ``tiled`` (the
``tiled`` layout: whole tile-token blocks dealt to balance kernel tiles),
``tiled_deal`` (its deal: which rank owns each block), ``world`` (the ``world`` layout: the whole DP x CP
world as one CP group), ``world_deal`` (its deal: documents whole, long ones on few ranks of one node),
``world_cost`` (the per-tile and per-byte cost model it weighs, replaceable by a calibration file),
``world_plan`` (the per-rank bins a world micro-batch fills: documents whole, long ones on consecutive ranks),
``world_keys`` (its exchange plan and intra- / inter-node keys), ``tiles`` (live kernel tiles and K/V needs
per rank), ``varlen_tiles`` (the tiles a varlen kernel pays: each document run tiled by itself), ``exchange`` (the K/V
exchange plan: which keys each rank needs from each other rank under the
document-causal mask, for any layout), ``shard_layout``
(``ShardLayout``, the torch record of a layout that travels with a batch; the
one module here that imports torch).

Nothing is imported eagerly: ``cpdata.gather`` names ``ShardLayout`` for type
checking only and must load torch alone.
"""

__all__: list[str] = []
