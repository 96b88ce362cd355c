"""Ready-made cpdata pipelines: short recipes built only from library parts.

Each module documents when to use it and exposes ``build(...)`` returning a
``torchdata.nodes.Loader`` of :class:`cpdata.ShardedBatch` for one CP rank::

    from cpdata.recipes import sft_thd
    loader = sft_thd.build(docs, capacity=32768, cp_size=cp, cp_rank=r)

This is their one home, installed with the package; the repository's
top-level ``pipelines/`` is a checkout's entry to the same modules
(``from pipelines import sft_thd``). Copy a module from here to change a recipe.

| module               | packing        | layout        | qkv   | attention it feeds                        |
|----------------------|----------------|---------------|-------|-------------------------------------------|
| ``balanced_allgather`` | bfd, split   | balanced      | bshd  | all-gather K/V with a document mask       |
| ``pretrain_concat``  | concat         | round_robin   | bshd  | torch ``context_parallel`` (causal SDPA)  |
| ``sft_thd``          | bfd, truncate  | thd           | thd   | Transformer Engine THD (``cu_seqlens``)   |
| ``precomputed``      | from the plan directory written by ``cpdata precompute``                  |
"""

__all__ = ["balanced_allgather", "precomputed", "pretrain_concat", "sft_thd"]
