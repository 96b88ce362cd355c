"""Packing planners: pure numpy/Python over document lengths.

The same code serves the online :class:`~cpdata.nodes.pack.Pack` node and an
offline precompute of a whole dataset (:func:`plan_lengths`).

| algorithm     | what                                                      | padding above the bound |
|---------------|-----------------------------------------------------------|-------------------------|
| ``bfd``       | streaming best-fit-decreasing, open bins carried and topped up (default) | 0.00-0.04 pp |
| ``ffd``       | first-fit-decreasing over the whole stream (offline)      | 0.00-0.08 pp            |
| ``first_fit`` | Grain-style first-fit over 8 open bins                    | 0.4-11 pp               |
| ``next_fit``  | one open bin (torchtune / NeMo ``pack_dataset``)          | 1.8-22 pp               |
| ``concat``    | pretraining: concatenate, cut at the capacity; positions continue | 0 (all packs full but the last) |

The bound is ``ceil(slot tokens / capacity)`` packs; ranges are over the
realistic distributions of :mod:`cpdata.packing.distributions` at 4K-128K.
Numbers: ``python -m cpdata.packing``.

Role: below the nodes, beside the schedule; pure functions of lengths, so the
live packer and an offline precompute give the same packs. Modules, in
pipeline order: ``records`` (configuration, stats, results), ``pieces``
(documents to aligned pieces, the overflow policy), ``greedy`` (``next_fit``,
``first_fit``), ``decreasing`` (``bfd``, ``ffd``), ``filling`` (exact fills at
the end of the stream), ``world`` (the world layout's packer: per-rank bins,
documents whole), ``planner`` (the core shared by the node and the
offline planner), ``offline`` (``plan_lengths``), ``distributions`` (realistic
length distributions for tests and benchmarks).
"""

from cpdata.packing.offline import plan_lengths
from cpdata.packing.planner import StreamPlanner
from cpdata.packing.records import (
    ALGORITHMS,
    DEFAULT_WINDOW,
    OVERFLOW_POLICIES,
    WINDOW_PACKS,
    PackingConfig,
    PackingResult,
    PackingStats,
    PackKeys,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_WINDOW",
    "OVERFLOW_POLICIES",
    "WINDOW_PACKS",
    "PackKeys",
    "PackingConfig",
    "PackingResult",
    "PackingStats",
    "StreamPlanner",
    "plan_lengths",
]
