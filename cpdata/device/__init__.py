"""The device half: apply a worker's layout on the training step, torch only.

Role: what the training process runs per step on a batch the workers already
laid out. It checks the batch against the mesh and moves it as one buffer copy,
makes attention see the whole sequence, and proves the ranks agree on the plan;
it never imports torchdata, the nodes or the sources, and never recomputes a
worker's layout.

Modules, in pipeline order: ``presharded`` (a worker batch checked against the
mesh and moved: ``ShardedBatch.to``, the mesh helpers, the attention ctx
factory), ``cp_attention`` (the SDPA override that gathers or exchanges K/V),
``kv_exchange`` (the one all-to-all that moves only the K/V a layout's exchange
plan names, and ``move_keys_values``, the one K/V mover of every CP attention),
``attention_masks`` (the one mask predicate: each query's key interval),
``varlen`` (the varlen / flash kernel of the ``"cpdata"`` attention: per-document-run
segments, ``cu_seq``, the key gather; ``varlen_reference`` its exact CPU reference),
``consistency`` (ranks agreeing on the plan and on the end of an
epoch). The gather itself is :mod:`cpdata.gather`, kept at the root so model
code imports it alone. NeMo Automodel's sharder contract (raw batches sharded on
the device, backend resolution, the token verbs) is :mod:`cpdata.nemo`, a layer
above this one.
"""

__all__: list[str] = []
