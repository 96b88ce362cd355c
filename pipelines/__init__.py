"""Ready-made cpdata pipelines: short recipes built only from library parts.

Each module documents when to use it and exposes ``build(...)`` returning a
``torchdata.nodes.Loader`` of :class:`cpdata.ShardedBatch` for one CP rank.
This folder sits beside the package and is not installed; copy a recipe or put
the repository root on ``sys.path``.

| module               | packing        | layout        | qkv   | attention it feeds                        |
|----------------------|----------------|---------------|-------|-------------------------------------------|
| ``balanced_allgather`` | bfd, split   | balanced      | bshd  | all-gather K/V with a document mask       |
| ``pretrain_concat``  | concat         | round_robin   | bshd  | torch ``context_parallel`` (causal SDPA)  |
| ``sft_thd``          | bfd, truncate  | thd           | thd   | Transformer Engine THD (``cu_seqlens``)   |
| ``precomputed``      | from the plan directory written by ``cpdata precompute``                  |
"""

__all__ = ["balanced_allgather", "precomputed", "pretrain_concat", "sft_thd"]
