"""Test configurations written as flat keyword dicts, routed into the option records.

Many tests share one configuration dict and vary a key (``{**CFG, "algorithm": a}``); keeping those
dicts flat keeps each variation one key. :func:`records` routes every key the way
:data:`cpdata.nodes.options.RENAMED` names it (``overflow`` -> ``StreamPlan.overflow``, ``num_epochs``
-> ``DataPolicy.epochs``, ...), so a test reads ``build_loader(docs, **records(**CFG, cp_rank=0))``.
Combinations the records cannot express (an option of the schedule without ``schedule``) fail here,
loudly, instead of being guessed.
"""

from __future__ import annotations

from typing import Any

from cpdata.nodes.loader import GraphOptions
from cpdata.nodes.options import RENAMED, DataPolicy, Delivery, SchedulePlan, StreamPlan

__all__ = ["graph_options", "precompute_records", "records"]

_SCHEDULE_ONLY = ("micro_batches", "max_delay", "cost", "lengths", "tail", "schedule_window")
_STREAM_ONLY = ("window", "shuffle_buffer")


def _field(name: str) -> str:
    return RENAMED[name][1].partition(" or ")[0].partition(".")[2]


def _plan(flat: dict[str, Any], schedule: str | None) -> StreamPlan | SchedulePlan | None:
    given = {k: flat.pop(k) for k in [k for k in flat if RENAMED.get(k, ("",))[0] == "plan"]}
    if schedule is not None:
        stray = sorted(set(given) & set(_STREAM_ONLY))
        assert not stray, f"{stray} belong to a StreamPlan, not to schedule={schedule!r}"
        return SchedulePlan(kind=schedule, **{_field(k): v for k, v in given.items()})
    stray = sorted(set(given) & set(_SCHEDULE_ONLY))
    assert not stray, f"{stray} belong to a SchedulePlan: pass schedule= with them"
    return StreamPlan(**given) if given else None


def records(**flat: Any) -> dict[str, Any]:
    """``flat`` with its plan, data and delivery keys replaced by ``plan=``, ``data=``, ``delivery=`` records
    (each only when one of its keys is given); every other key passes through unchanged."""
    plan = _plan(flat, flat.pop("schedule", None))
    groups: dict[str, dict[str, Any]] = {"data": {}, "delivery": {}}
    for name in [k for k in flat if k in RENAMED]:
        groups[RENAMED[name][0]][_field(name)] = flat.pop(name)
    out = dict(flat)
    if plan is not None:
        out["plan"] = plan
    if groups["data"]:
        out["data"] = DataPolicy(**groups["data"])
    if groups["delivery"]:
        out["delivery"] = Delivery(**groups["delivery"])
    return out


def graph_options(**flat: Any) -> GraphOptions:
    """:func:`records` as the :class:`GraphOptions` that ``shard_graph(source, options)`` takes."""
    return GraphOptions(**records(**flat))


def precompute_records(**flat: Any) -> dict[str, Any]:
    """``precompute``'s flat keywords as records: ``dp_size`` (with ``schedule``, default ``"balanced"``) plans
    a global schedule, as before; without it the plan is a stream plan."""
    if flat.get("dp_size") is not None:
        flat.setdefault("schedule", "balanced")
    else:
        flat.pop("dp_size", None)
        flat.pop("schedule", None)
    return records(**flat)
