"""The device half: apply a precomputed layout on the training step, torch only.

Role: everything the training process runs per step. It copies a worker's
batch to the device (or, for raw full batches, shards it NeMo's way), installs
the layout, and does the one differentiable collective; it never imports
torchdata, the nodes or the sources, and never recomputes a worker's layout.

Modules, in pipeline order: ``presharded`` (a worker batch checked against the
mesh and moved), ``raw_shard`` (raw ``[B, S]`` batches sharded on the device),
``thd_batch`` (a raw THD batch as one stream, and TE's partition of it),
``pp_chunks`` (THD batches split into pipeline chunks), ``thd_shard`` (the THD
strategy), ``resolve`` (choosing a strategy once, NeMo's order),
``token_coords`` (token tensors between caller and layout coordinates),
``kv_exchange`` (the one all-to-all that moves only the K/V a layout's
exchange plan names), ``cp_attention`` (the SDPA override that gathers or
exchanges K/V), ``varlen`` (the varlen / flash kernel of the ``"cpdata"``
attention: per-document-run segments, ``cu_seq``, the key gather; ``varlen_reference`` its exact CPU reference),
``consistency`` (ranks
agreeing on the plan and on the end of an epoch), ``sharder``
(``ContextParallelSharder``, the entry point). The gather itself is
:mod:`cpdata.gather`, kept at the root so model code imports it alone.
"""

__all__: list[str] = []
