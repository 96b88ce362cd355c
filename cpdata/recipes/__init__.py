"""Ready-made cpdata pipelines: short recipes built only from library parts.

Each module documents when to use it and exposes ``build(...)`` returning a
``torchdata.nodes.Loader`` of :class:`cpdata.ShardedBatch` for one CP rank::

    from cpdata.recipes import sft_thd
    loader = sft_thd.build(docs, capacity=32768, cp_size=cp, cp_rank=r)

They are installed with the package. The repository's top-level
``pipelines/`` folder holds the same recipes as short copy-me starting points
that import from here.

| module               | packing        | layout        | qkv   | attention it feeds                        |
|----------------------|----------------|---------------|-------|-------------------------------------------|
| ``balanced_allgather`` | bfd, split   | balanced      | bshd  | all-gather K/V with a document mask       |
| ``pretrain_concat``  | concat         | round_robin   | bshd  | torch ``context_parallel`` (causal SDPA)  |
| ``sft_thd``          | bfd, truncate  | thd           | thd   | Transformer Engine THD (``cu_seqlens``)   |
| ``precomputed``      | from the plan directory written by ``cpdata precompute``                  |
"""

__all__ = ["balanced_allgather", "precomputed", "pretrain_concat", "sft_thd"]
