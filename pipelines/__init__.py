"""Ready-made cpdata pipelines, installed as :mod:`cpdata.recipes`.

This folder is not installed: each module here re-exports the installed
recipe's ``build`` so scripts run from a checkout can ``import pipelines.sft_thd``
and users have a place to copy a recipe to before changing it. Installed code
should import ``cpdata.recipes`` (``from cpdata.recipes import sft_thd``).

| module               | packing        | layout        | qkv   | attention it feeds                        |
|----------------------|----------------|---------------|-------|-------------------------------------------|
| ``balanced_allgather`` | bfd, split   | balanced      | bshd  | all-gather K/V with a document mask       |
| ``pretrain_concat``  | concat         | round_robin   | bshd  | torch ``context_parallel`` (causal SDPA)  |
| ``sft_thd``          | bfd, truncate  | thd           | thd   | Transformer Engine THD (``cu_seqlens``)   |
| ``precomputed``      | from the plan directory written by ``cpdata precompute``                  |
"""

__all__ = ["balanced_allgather", "precomputed", "pretrain_concat", "sft_thd"]
