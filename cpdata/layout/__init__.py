"""Layouts: which global token positions each CP rank owns (pure numpy, plus the record that carries them).

A layout is one integer map (``rows[r]`` = the global positions of rank ``r``'s tokens, in local order) and
its inverse, a pure function of the document lengths, so every CP rank computes the same map without talking.
``maps`` holds the layouts (``rank_indices``, ``alignment``, ``inverse_indices``); ``runs`` and ``blocks``
build their tables; ``tiled`` and ``world_deal`` (with ``world_plan``, its cost model in ``world_cost``) are the
layouts that balance kernel tiles, their tables ``spans``; ``world_step`` deals a step of world micro-batches
together (its books in ``step_loads``, their ranks kept sorted by ``ranked``; who holds what in ``world_owners``;
the close's moves in ``step_moves``), cutting the documents it spreads as ``spread`` says (over whole nodes:
``node_chunks``);
``exchange`` plans the K/V exchange; ``tiles`` counts what kernels pay (a causal segment's tiles: ``causal_tiles``);
``shard_layout`` is the torch record that travels with a batch (the one module here that imports torch).
Nothing is imported eagerly: ``cpdata.gather`` must load torch alone.
"""

__all__: list[str] = []
