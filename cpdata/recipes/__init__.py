"""Ready-made cpdata pipelines (docs/recipes.md): each module's ``build(...)`` returns a torchdata ``Loader`` of
:class:`cpdata.ShardedBatch` for one CP rank (``sft_thd.build(docs, capacity=32768, cp_size=cp, cp_rank=r)``).

Recipes: ``balanced_allgather`` (all-gather attention), ``pretrain_concat`` (torch ``context_parallel``),
``sft_thd`` (Transformer Engine THD), ``precomputed`` (a ``cpdata precompute`` plan). This is their one home;
the repository's ``pipelines/`` re-exports them. Copy a module to change a recipe.
"""

__all__ = ["balanced_allgather", "precomputed", "pretrain_concat", "sft_thd"]
