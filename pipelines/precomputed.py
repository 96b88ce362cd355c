"""Serve a plan directory written by ``cpdata precompute``.

Copy-me starting point: the recipe is installed as :mod:`cpdata.recipes.precomputed`
(read it there); copy that module to change it, or import it as below.
"""

from cpdata.recipes.precomputed import build

__all__ = ["build"]
