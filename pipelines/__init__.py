"""Ready-made cpdata pipelines: this checkout's entry to :mod:`cpdata.recipes`, where they live and are installed.

``from pipelines import sft_thd`` (a script run from a checkout) is the module
``cpdata.recipes.sft_thd``; installed code imports ``cpdata.recipes``. Each
recipe is a short ``build(...)`` made only of library parts; to change one,
copy its module from ``cpdata/recipes/``. The recipes and what each feeds are
listed in :mod:`cpdata.recipes` and ``docs/recipes.md``.
"""

from cpdata.recipes import balanced_allgather, precomputed, pretrain_concat, sft_thd

__all__ = ["balanced_allgather", "precomputed", "pretrain_concat", "sft_thd"]
