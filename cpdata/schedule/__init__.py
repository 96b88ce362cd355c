"""Lengths-first planning: one epoch of (step, DP rank, micro-batch) packs, the same on every rank.

::

    sched = plan_schedule(dataset.lengths, capacity=8192, layout="thd", cp_size=4, dp_size=8,
                          micro_batches=8, cost=CostModel())
    sched.pieces(step, dp_rank, micro_batch)   # [(document_index, start, length), ...]

| module | what |
|---|---|
| :mod:`~cpdata.schedule.cost` | ``CostModel``: ``a * L + b * L**2`` per document piece |
| :mod:`~cpdata.schedule.balance` | one step's placement: runs of outliers, largest gap first, fillers |
| :mod:`~cpdata.schedule.improve` | exchanges of pieces between cells that lower a step's costliest cells |
| :mod:`~cpdata.schedule.runs` | which outliers form runs of one size now, go loose or wait |
| :mod:`~cpdata.schedule.fill` | closing cells exactly with short pieces; the first-fit check of due pieces |
| :mod:`~cpdata.schedule.planner` | ``plan_schedule``: the step loop, carry and the delay bound, tail policy |
| :mod:`~cpdata.schedule.records` | ``Schedule`` (CSR packs) and ``ScheduleStats`` |
| :mod:`~cpdata.schedule.metrics` | ``imb_step`` / ``imb_mb`` from pack costs |
"""

from cpdata.schedule.cost import FLEXSP_7B, CostModel
from cpdata.schedule.metrics import imbalance
from cpdata.schedule.planner import plan_schedule
from cpdata.schedule.records import TAIL_POLICIES, Schedule, ScheduleStats

__all__ = ["FLEXSP_7B", "TAIL_POLICIES", "CostModel", "Schedule", "ScheduleStats", "imbalance", "plan_schedule"]
