"""Packing planners: pure numpy/Python over document lengths, shared by the ``Pack`` node and
:func:`plan_lengths`, so both give the same packs.

Algorithms ``bfd`` (default), ``ffd``, ``first_fit``, ``next_fit``, ``concat``: table and padding figures in
docs/packing-and-mixing.md, numbers from ``cpdata bench``. Modules, in pipeline order:
``records``, ``pieces`` (documents to aligned pieces), ``greedy``, ``decreasing`` (also the world layout's
packer), ``world_steps`` (the world layout's packer dealing a step of micro-batches; the open step in
``open_step``, its close's phases in ``world_close``: settle in ``world_settle``, window trades in
``world_trades``, fill in ``world_fill``, moves for keys in ``world_keys``, its last phase in ``world_densify``),
``filling`` (exact fills), ``planner`` (the shared core and ``plan_lengths``), ``distributions``
(length distributions for tests and benchmarks)."""

from cpdata.packing.planner import StreamPlanner, plan_lengths
from cpdata.packing.records import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    DEFAULT_WINDOW,
    OVERFLOW_POLICIES,
    WINDOW_PACKS,
    PackingConfig,
    PackingResult,
    PackingStats,
    PackKeys,
)

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "DEFAULT_WINDOW", "OVERFLOW_POLICIES", "WINDOW_PACKS",
           "PackKeys", "PackingConfig", "PackingResult", "PackingStats", "StreamPlanner",
           "plan_lengths"]  # fmt: skip
