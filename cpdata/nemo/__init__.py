"""NeMo Automodel's device contract (release 0.7.0): ``ContextParallelSharder``, backend resolution, token
verbs.

Everything here exists so code written against NeMo's sharder runs unchanged: raw batches sharded in the step
(round-robin ``[B, S]`` rows, Transformer Engine's THD partition, pipeline chunks). cpdata's native path needs
none of it (a worker batch is only moved: :mod:`cpdata.device.presharded`); nothing in :mod:`cpdata.device`
imports this package. Modules, in pipeline order: ``sharder``, ``resolve``, ``raw_shard``, ``thd_batch``,
``thd_shard`` (with pipeline chunks), ``token_coords``.
"""

__all__: list[str] = []
