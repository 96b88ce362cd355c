"""Supervised fine-tuning packs in THD form for Transformer Engine.

Copy-me starting point: the recipe is installed as :mod:`cpdata.recipes.sft_thd`
(read it there); copy that module to change it, or import it as below.
"""

from cpdata.recipes.sft_thd import build

__all__ = ["build"]
