"""Concatenated pretraining packs for torch ``context_parallel``.

Copy-me starting point: the recipe is installed as :mod:`cpdata.recipes.pretrain_concat`
(read it there); copy that module to change it, or import it as below.
"""

from cpdata.recipes.pretrain_concat import build

__all__ = ["build"]
