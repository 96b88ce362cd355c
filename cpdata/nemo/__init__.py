"""NeMo Automodel's device contract: ``ContextParallelSharder``, its backend resolution and its token verbs.

Role: everything that exists so code written against NeMo Automodel's
``ContextParallelSharder`` (release 0.7.0) runs unchanged. It shards *raw*
batches in the training step the way NeMo does (round-robin ``[B, S]`` rows,
Transformer Engine's THD partition, pipeline chunks), resolves which backend
owns a batch in NeMo's order, and moves token tensors between the caller's
coordinates and a layout. cpdata's native path does not need any of it: a
worker batch is laid out on the dataloader workers and the sharder only hands
it to :mod:`cpdata.device.presharded` (one copy), :mod:`cpdata.gather` and
:mod:`cpdata.device.cp_attention`. This package sits above :mod:`cpdata.device`
and nothing in the device package imports it.

Modules, in pipeline order: ``sharder`` (``ContextParallelSharder``, the
entry point), ``resolve`` (choosing a strategy once, NeMo's order),
``raw_shard`` (raw ``[B, S]`` batches sharded on the device), ``thd_batch``
(a raw THD batch as one stream, and TE's partition of it), ``thd_shard`` (the
THD strategy), ``pp_chunks`` (THD batches split into pipeline chunks),
``token_coords`` (token tensors between caller and layout coordinates).
"""

__all__: list[str] = []
