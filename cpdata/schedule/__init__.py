"""Lengths-first planning: one epoch of (step, DP rank, micro-batch) packs, the same on every rank.

``plan_schedule(lengths, capacity=..., layout=..., cp_size=..., dp_size=..., micro_batches=..., cost=CostModel())``
returns a :class:`Schedule`; ``sched.pieces(step, dp_rank, micro_batch)`` lists a pack's
``(document_index, start, length)``. The planner's step loop is in ``planner``; one step's placement in
``balance`` (phases ``runs``, ``improve``, ``fill``); the record and its ``imb_step`` / ``imb_mb`` in
``records``; the cost model in ``cost``.
"""

from cpdata.schedule.cost import FLEXSP_7B, CostModel
from cpdata.schedule.planner import plan_schedule
from cpdata.schedule.records import TAIL_POLICIES, Schedule, ScheduleStats, imbalance

__all__ = ["FLEXSP_7B", "TAIL_POLICIES", "CostModel", "Schedule", "ScheduleStats", "imbalance", "plan_schedule"]
