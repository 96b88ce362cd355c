"""A global schedule's settings (:func:`schedule_settings`), the lengths it is planned from, and one DP
rank's rows of it (:class:`RankRows`: ``1 / dp_size`` of the plan, what a dataloader worker receives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cpdata.errors import check_int
from cpdata.schedule import CostModel, Schedule, plan_schedule
from cpdata.sources.protocol import Indexed, StatedLengths
from cpdata.worker.targets import LabelsAlignment, check_labels_alignment

__all__ = ["SCHEDULES", "RankRows", "rank_rows", "schedule_settings", "source_lengths"]


SCHEDULES: tuple[str, ...] = ("balanced", "in_order")
"""``balanced``: packs cost-balanced (:class:`~cpdata.schedule.CostModel`); ``in_order``: dealt in order."""


def schedule_settings(
    schedule: str, *, capacity: int, layout: str, cp_size: int, dp_rank: int, dp_size: int, micro_batches: int,
    cost: CostModel | None, max_delay: int, algorithm: str, overflow: str | None, seed: int, tail: str,
    labels_alignment: LabelsAlignment | None, fallback: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(plan_schedule keywords, the state's config)`` of a global schedule, checked (the planner checks
    the rest). Without ``cost``, ``"balanced"`` takes the FlexSP 7B profile, or the token plan when it is
    cheaper once pads are counted; ``fallback=False`` (a window's plan, whose tail applies per window) not."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)} or None")
    check_int("dp_rank", dp_rank)
    check_int("dp_size", dp_size)
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    fallback = fallback and schedule == "balanced" and cost is None  # the default: the token plan when it is cheaper
    cost = (cost or CostModel()) if schedule == "balanced" else None
    plan_kw = dict(capacity=capacity, layout=layout, cp_size=cp_size, dp_size=int(dp_size), micro_batches=micro_batches,
                   cost=cost, max_delay=max_delay, algorithm=algorithm, overflow=overflow, seed=seed, tail=tail,
                   fallback=fallback)  # fmt: skip
    probe = plan_schedule(np.zeros(0, dtype=np.int64), **plan_kw)  # checks every argument now
    config = {
        "schedule": schedule, "capacity": int(capacity), "layout": layout, "cp_size": int(cp_size),
        "dp": [int(dp_rank), int(dp_size)], "micro_batches": int(micro_batches), "max_delay": int(max_delay),
        "algorithm": algorithm, "overflow": probe.config.overflow, "seed": int(seed), "tail": tail,
        "cost": None if cost is None else [float(cost.a), float(cost.b)], "fallback": fallback,
        "labels_alignment": check_labels_alignment(labels_alignment),
    }  # fmt: skip
    return plan_kw, config


def source_lengths(source: Any, lengths: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """int64 ``[n_docs]``: ``lengths`` if given, else ``source.lengths``; ``TypeError`` naming the fix otherwise."""
    if lengths is None and isinstance(source, StatedLengths):
        lengths = source.lengths
    if lengths is None:
        raise TypeError(
            f"a SchedulePlan plans from every document's length before reading any, but the source "
            f"({type(source).__name__}) has no .lengths; pass SchedulePlan(lengths=[...]) (tokens per document), "
            "use cpdata.open_dataset(path) (it has .lengths), or plan=StreamPlan() (each DP rank reads and packs "
            "documents i % dp_size as it streams), or SchedulePlan(window=W) (plan a stream W documents at a time)"
        )
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"lengths must be a 1-D integer array, got dtype {arr.dtype} shape {arr.shape}")
    if not isinstance(source, Indexed):
        raise TypeError(
            f"a SchedulePlan reads documents by index; the source ({type(source).__name__}) needs __len__ and "
            "__getitem__ (a list, a map-style dataset, cpdata.open_dataset(path))"
        )
    if len(source) != arr.shape[0]:
        raise ValueError(f"the source has {len(source)} documents but {arr.shape[0]} lengths; they must match")
    return arr.astype(np.int64, copy=False)


RankRows = dict[str, np.ndarray]
"""One rank's packs, CSR: pack ``j`` is rows ``offsets[j]:offsets[j + 1]`` of :mod:`cpdata.nodes.served`'s columns."""


def rank_rows(sched: Schedule, dp_rank: int) -> RankRows:
    """Rank ``dp_rank``'s packs of ``sched`` in (step, micro-batch) order."""
    R, M = sched.dp_size, sched.micro_batches
    first = (np.arange(sched.num_steps, dtype=np.int64) * R + dp_rank) * M  # pack id of (step, rank, 0)
    packs = (first[:, None] + np.arange(M)).reshape(-1)
    lo, hi = sched.pack_offsets[packs], sched.pack_offsets[packs + 1]
    sizes = hi - lo
    rows = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return {"offsets": offsets, "doc_index": sched.doc_index[rows], "doc_start": sched.doc_start[rows],
            "doc_len": sched.doc_len[rows], "slot_len": sched.slot_len[rows], "continues": sched.continues[rows]}
