"""The device half: apply a worker's layout on the training step (torch only; no torchdata, nodes or sources).

Modules, in pipeline order: ``presharded`` (a worker batch checked against the mesh and moved),
``cp_attention`` (the CP attention core: K/V and masks of a batch; the SDPA override on it; ``batch_context``: the
ctx a batch comes with), ``kv_exchange``
(the one K/V mover), ``attention_masks`` (the one mask: each query's key interval), ``varlen`` (the flash
kernel's segments, its exact CPU reference, the kernel names and choice), ``consistency`` (ranks agreeing on the plan
and the epoch's end). The gather is :mod:`cpdata.gather`; NeMo's sharder contract is :mod:`cpdata.nemo`, a
layer above.
"""

__all__: list[str] = []
