"""The slots of a batch's stream (:mod:`cpdata.worker.collate`), checked, and their metadata: no tokens.

:func:`slot_block` checks the slots of ``k`` batches in one pass over the plans and a few numpy calls;
:func:`metadata_block` gives their ``cu_seqlens`` family."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cpdata.layout.maps import thd_slot_lens
from cpdata.worker.keys import IGNORE_INDEX
from cpdata.worker.plan import PackPlan

__all__ = ["SlotBlock", "metadata_block", "pack_metadata", "slot_block"]

_PAD_SLOT = np.array([[-1, 0, 0, IGNORE_INDEX]], dtype=np.int64)  # plan columns of an empty pack's one pad slot
_ZERO_SLOT = np.zeros(1, dtype=np.int64)  # its raw slot length (the tail makes it the whole pack)


@dataclass(frozen=True, slots=True)
class SlotBlock:
    """The checked slots of ``k`` batches, batch after batch: ``N`` slots of ``P`` plans.

    Attributes:
        table: int64 ``[N, 4]``: each slot's piece ``(index, start, length, next_label)``.
        slot_lens: int64 ``[N]``: every pack's tail absorbed by its last slot.
        layout_lens: int64 ``[N]``: ``slot_lens`` but each batch's last slot as the plan gives it.
        raw_lens: int64 ``[N]``: as the plans give them (an empty plan's slot 0).
        counts: ``P`` ints: pieces per plan.
        plan_first, first: ``k + 1`` ints: batch ``b`` holds plans ``[plan_first[b], plan_first[b + 1])``
            and slots ``[first[b], first[b + 1])``.
        capacities: ``k`` ints: each batch's ``S``.
    """

    table: np.ndarray
    slot_lens: np.ndarray
    layout_lens: np.ndarray
    raw_lens: np.ndarray
    counts: list[int]
    plan_first: list[int]
    first: list[int]
    capacities: list[int]
    plans: list[PackPlan]

    def layout_lens_of(self, b: int) -> np.ndarray:
        """int64 ``[K']``: batch ``b``'s slot lengths as :func:`cpdata.layout.maps.rank_indices` takes them,
        every pack's tail absorbed but the last one's (so one plan gives ``plan.slot_lens``; a view)."""
        end = self.first[b + 1] - (not self.counts[self.plan_first[b + 1] - 1])  # an empty last plan: no slot
        return self.layout_lens[self.first[b] : end]


def slot_block(batches: Sequence[Sequence[PackPlan]]) -> SlotBlock:
    """The slots of ``k`` batches of plans, checked.

    Raises:
        TypeError, ValueError: a single plan instead of a sequence, no plan, unequal capacities in a batch,
            ``slot_lens`` not one per piece, a piece longer than its slot, slots past the capacity (the
            errors of :func:`cpdata.layout.maps.thd_slot_lens`), naming the first bad plan.
    """
    tables, slots, counts, caps, ends, flat = [], [], [], [], [], []  # ends: each plan's last slot, plus one
    plan_first, first, at = [0], [0], 0
    for plans in batches:
        if isinstance(plans, PackPlan):
            raise TypeError("collate takes a sequence of PackPlan (one per row), got a single PackPlan; wrap it: [plan]")
        if len(plans) == 0:
            raise ValueError("collate needs at least one PackPlan, got an empty sequence")
        capacity = plans[0].capacity
        for b, plan in enumerate(plans):
            if plan.capacity != capacity:
                raise ValueError(
                    f"all plans of a batch need the same capacity; plan {b} has {plan.capacity}, plan 0 has {capacity}"
                )
            table, slot_lens = plan.columns, np.asarray(plan.slot_lens)  # (any dtype: cast below)
            n = table.shape[0]
            if slot_lens.shape != (n,):
                raise ValueError(
                    f"plan {plan.index}: slot_lens has shape {slot_lens.shape}, expected ({n},) (one slot per piece)"
                )
            counts.append(n)
            tables.append(table if n else _PAD_SLOT)  # empty pack: one pad slot
            slots.append(slot_lens if n else _ZERO_SLOT)
            at += n or 1
            ends.append(at)
        flat.extend(plans)
        caps.append(capacity)
        plan_first.append(len(counts))
        first.append(at)
    table = tables[0] if len(tables) == 1 else np.concatenate(tables)
    raw = (slots[0] if len(slots) == 1 else np.concatenate(slots)).astype(np.int64, copy=False)
    short = raw < table[:, 2]
    if short.any():
        k = int(np.flatnonzero(short)[0])
        p = bisect_right(ends, k)  # the plan holding stream slot k, then its piece
        i = k - (ends[p - 1] if p else 0)
        raise ValueError(
            f"plan {flat[p].index}: piece {i} has {int(table[:, 2][short][0])} tokens but its slot only "
            f"{int(raw[short][0])}; slot_lens must be >= the piece lengths"
        )
    last = np.asarray(ends, dtype=np.int64) - 1
    # each plan's tail padding: its capacity minus the sum of its slots
    tails = np.repeat(caps, np.diff(plan_first)) - np.add.reduceat(raw, np.concatenate(([0], last[:-1] + 1)))
    slot_lens = raw.copy()
    slot_lens[last] += tails
    if tails.min() < 0:  # (a negative slot is shorter than its piece: refused above)
        for plan in flat:
            thd_slot_lens(plan.slot_lens, plan.capacity)  # its error for the first bad plan
    layout_lens = slot_lens.copy()
    batch_last = last[np.asarray(plan_first[1:], dtype=np.int64) - 1]
    layout_lens[batch_last] = raw[batch_last]
    return SlotBlock(table, slot_lens, layout_lens, raw, counts, plan_first, first, caps, flat)


def pack_metadata(plans: Sequence[PackPlan]) -> dict[str, np.ndarray]:
    """``cu_seqlens``, ``cu_seqlens_padded`` (int32 ``[K + 1]``), ``seq_lens``, ``seq_lens_padded`` (int32
    ``[K]``) and ``max_seqlen`` (0-d int32) of one batch's stream; O(slots)."""
    block = slot_block([plans])
    first = np.asarray(block.first, dtype=np.int64)
    return metadata_block(block.table[:, 2], block.slot_lens, first, np.zeros(first[1], dtype=np.int64))[0]


def metadata_block(real_lens: np.ndarray, slot_lens: np.ndarray, first: np.ndarray, batch_of: np.ndarray
                   ) -> list[dict[str, np.ndarray]]:  # fmt: skip
    """:func:`pack_metadata` of each batch of a block.

    Batch ``b`` holds slots ``[first[b], first[b + 1])``; ``batch_of``: int64 ``[N]`` each slot's batch. One
    cumulative sum over the block, restarted at each batch; each dict's arrays are views of a few block
    arrays."""
    n, k = real_lens.shape[0], first.shape[0] - 1
    lens = np.empty((2, n), dtype=np.int32)  # real, slot
    lens[0], lens[1] = real_lens, slot_lens
    cu = np.zeros((2, n + k), dtype=np.int32)  # batch b: columns [first[b] + b, first[b + 1] + b]
    head = first[:-1]
    cum = lens.cumsum(axis=1, dtype=np.int64)
    cum -= (cum[:, head] - lens[:, head])[:, batch_of]
    at = np.arange(1, n + 1, dtype=np.int64)
    at += batch_of
    cu[:, at] = cum
    longest = np.maximum.reduceat(lens[0], head)
    out, bounds, (cu_real, cu_slot), (real, slot) = [], first.tolist(), cu, lens
    for b in range(k):
        i, j = bounds[b], bounds[b + 1]
        out.append({
            "cu_seqlens": cu_real[i + b : j + b + 1],
            "cu_seqlens_padded": cu_slot[i + b : j + b + 1],
            "seq_lens": real[i:j],
            "seq_lens_padded": slot[i:j],
            "max_seqlen": longest[b, ...],  # a 0-d view
        })  # fmt: skip
    return out
