"""The schedule record: packs by (step, DP rank, micro-batch), in CSR form, its counters and its imbalance.

With pack costs ``c[r, m]``: ``imb_step = max_r sum_m c / mean_r sum_m c - 1`` (DDP: one sync per step) and
``imb_mb = sum_m max_r c / sum_m mean_r c - 1`` (FSDP / ZeRO-3 / pipeline: a sync per micro-batch);
``imb_mb >= imb_step``, both 0 when balanced (the figures ``cpdata bench`` reports).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdata.packing import PackingConfig, PackingResult, PackingStats
from cpdata.schedule.cost import CostModel

__all__ = ["COUNTS", "TAIL_POLICIES", "Schedule", "ScheduleStats", "assemble", "imbalance", "schedule_pack"]

COUNTS: tuple[str, ...] = ("documents", "skipped", "split", "truncated", "dropped", "truncated_tokens",
                           "dropped_tokens")  # fmt: skip
"""The document counters a schedule takes over from cutting its documents (:class:`ScheduleStats` fields)."""

TAIL_POLICIES: tuple[str, ...] = ("pad", "drop")
"""The last step when the documents do not fill it: ``pad`` (default) keeps it, its packs with no document all
padding (labels -100; ``ScheduleStats.empty_packs``); ``drop`` leaves it out when it holds an empty pack
(``tail_dropped_pieces`` / ``tail_dropped_tokens``)."""


def imbalance(costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(imb_step, imb_mb)``, float64 ``[steps]`` each, from costs ``[steps, dp_size, micro_batches]`` (a step
    that costs nothing: 0)."""
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 3:
        raise ValueError(f"costs must be [steps, dp_size, micro_batches], got shape {c.shape}")
    per_rank = c.sum(axis=2)
    mean = per_rank.mean(axis=1)
    safe = np.where(mean > 0, mean, 1.0)
    imb_step = np.where(mean > 0, per_rank.max(axis=1) / safe - 1.0, 0.0)
    imb_mb = np.where(mean > 0, c.max(axis=1).sum(axis=1) / safe - 1.0, 0.0)
    return imb_step, imb_mb


def schedule_pack(item: Any, micro_batches: int, dp_rank: int, dp_size: int) -> tuple[Any, Any, Any]:
    """``(step, micro_batch, pack id)`` of a DP rank's pack ``item`` (an int, or int64 ``[n]`` of them) of a
    schedule: micro-batch ``item % M`` of step ``item // M``, whose id numbers every rank's packs step by step
    (``M = 1``: every ``dp_size``-th pack)."""
    step, micro_batch = divmod(item, micro_batches)
    return step, micro_batch, (step * dp_size + dp_rank) * micro_batches + micro_batch


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleStats:
    """Counters of one :func:`~cpdata.schedule.plan_schedule` run: real tokens in packs + ``truncated_tokens`` +
    ``dropped_tokens`` + ``tail_dropped_tokens`` = tokens of all documents."""

    documents: int
    tokens: int
    """Real tokens in the schedule's packs."""
    slot_tokens: int
    steps: int
    lower_bound_steps: int
    """``ceil(slot tokens / (dp_size * micro_batches * capacity))``: fewer steps cannot hold the tokens."""
    packs: int
    empty_packs: int
    """Packs with no document (``tail="pad"``); the loss ignores them."""
    padding_pct: float
    """``100 * (1 - tokens / (packs * capacity))``."""
    skipped: int
    split: int
    truncated: int
    dropped: int
    truncated_tokens: int
    dropped_tokens: int
    tail: str
    tail_dropped_steps: int
    tail_dropped_pieces: int
    tail_dropped_tokens: int
    delay_counts: tuple[int, ...]
    """``delay_counts[k]``: pieces placed ``k`` steps after the step that took them from the stream (the bound:
    :func:`~cpdata.schedule.plan_schedule`)."""
    imb_step_mean: float
    """Mean over steps of :func:`imbalance`'s ``imb_step`` (0 without a cost model)."""
    imb_mb_mean: float

    @property
    def max_delay_steps(self) -> int:
        """The largest delay of any piece."""
        return len(self.delay_counts) - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """Packs of one epoch, ``num_steps x dp_size x micro_batches`` of them (read-only arrays), in the CSR form of
    :class:`~cpdata.packing.PackingResult`: pack ``p = (step * dp_size + dp_rank) * micro_batches +
    micro_batch`` holds pieces ``pack_offsets[p]:pack_offsets[p + 1]``, in stream order."""

    num_steps: int
    dp_size: int
    micro_batches: int
    capacity: int
    pack_offsets: np.ndarray
    """int64 ``[num_steps * dp_size * micro_batches + 1]``."""
    doc_index: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    slot_len: np.ndarray
    continues: np.ndarray
    """bool ``[pieces]``: the piece's document goes on in a later piece."""
    delay: np.ndarray
    """int64 ``[pieces]``: steps between taking the piece from the stream and placing it (the bound:
    :func:`~cpdata.schedule.plan_schedule`)."""
    config: PackingConfig
    cost: CostModel | None
    stats: ScheduleStats

    def pack_id(self, step: int, dp_rank: int, micro_batch: int) -> int:
        """Index of the pack in the CSR arrays; ``IndexError`` outside the schedule."""
        M = self.micro_batches
        for name, value, size in (("step", step, self.num_steps), ("dp_rank", dp_rank, self.dp_size),
                                  ("micro_batch", micro_batch, M)):  # fmt: skip
            if not 0 <= value < size:
                raise IndexError(f"{name}={value} out of range 0..{size - 1}")
        return schedule_pack(step * M + micro_batch, M, dp_rank, self.dp_size)[2]

    def rows(self, step: int, dp_rank: int, micro_batch: int) -> slice:
        """The piece rows of one pack."""
        p = self.pack_id(step, dp_rank, micro_batch)
        return slice(int(self.pack_offsets[p]), int(self.pack_offsets[p + 1]))

    def pieces(self, step: int, dp_rank: int, micro_batch: int) -> list[tuple[int, int, int]]:
        """``[(document_index, start, length), ...]`` of one pack, in slot order."""
        r = self.rows(step, dp_rank, micro_batch)
        return list(zip(self.doc_index[r].tolist(), self.doc_start[r].tolist(), self.doc_len[r].tolist(),
                        strict=True))  # fmt: skip

    def documents_of(self, dp_rank: int, steps: range | None = None) -> np.ndarray:
        """Sorted unique document indices that rank ``dp_rank`` reads in ``steps`` (default: all)."""
        steps = range(self.num_steps) if steps is None else steps
        parts = [self.doc_index[self.rows(s, dp_rank, 0).start : self.rows(s, dp_rank, self.micro_batches - 1).stop]
                 for s in steps]  # fmt: skip
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def fifo_delay(self) -> np.ndarray:
        """int64 ``[pieces]``: the step each piece is placed in minus its FIFO step (its stream position in slot
        tokens, documents in index order, over ``dp_size * micro_batches * capacity``); :attr:`delay` counts
        from the step that took it instead."""
        k = self.dp_size * self.micro_batches
        step = np.repeat(np.arange(self.num_steps * k) // k, np.diff(self.pack_offsets))
        stream = np.lexsort((self.doc_start, self.doc_index))
        position = np.empty_like(stream)
        position[stream] = np.cumsum(self.slot_len[stream]) - self.slot_len[stream]
        return step - position // (k * self.capacity)

    def pack_costs(self, cost: CostModel) -> np.ndarray:
        """float64 ``[num_steps, dp_size, micro_batches]``: ``sum cost(piece length)`` per pack."""
        return self.pack_sums(cost(self.doc_len))

    def pack_sums(self, per_piece: np.ndarray) -> np.ndarray:
        """float64 ``[num_steps, dp_size, micro_batches]``: the sum of ``per_piece`` (float64 ``[pieces]``) per pack."""
        sums = np.add.reduceat(np.append(per_piece, 0.0), self.pack_offsets[:-1])
        sums[np.diff(self.pack_offsets) == 0] = 0.0
        return sums.reshape(self.num_steps, self.dp_size, self.micro_batches)

    def imbalance(self, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
        """``(imb_step, imb_mb)`` per step under ``cost`` (:func:`imbalance`)."""
        return imbalance(self.pack_costs(cost))

    def as_packing_result(self) -> PackingResult:
        """Every pack in (step, rank, micro-batch) order as a :class:`~cpdata.packing.PackingResult`."""
        s = self.stats
        stats = PackingStats.from_counts(capacity=self.capacity, tokens=s.tokens, slot_tokens=s.slot_tokens,
                                         packs=s.packs, **{k: getattr(s, k) for k in COUNTS})  # fmt: skip
        return PackingResult(pack_offsets=self.pack_offsets, doc_index=self.doc_index, doc_start=self.doc_start,
                             doc_len=self.doc_len, slot_len=self.slot_len, stats=stats, config=self.config)


def assemble(cells, doc, start, length, slot, cont, delay, counts, config, R, M, cost, tail) -> Schedule:
    """The :class:`Schedule` of placed pieces (``cells``: pack id per piece, any order), the tail policy applied."""
    K, C = R * M, config.capacity
    n_cells = int(cells.max()) + 1 if cells.size else 0
    num_steps = -(-n_cells // K)
    dropped_steps = dropped_pieces = dropped_tokens = 0
    all_slot_tokens = int(slot.sum())
    per_cell = np.bincount(cells, minlength=num_steps * K)
    if tail == "drop" and num_steps and (per_cell[(num_steps - 1) * K :] == 0).any():
        last = cells >= (num_steps - 1) * K
        dropped_steps, dropped_pieces, dropped_tokens = 1, int(last.sum()), int(length[last].sum())
        keep = ~last
        cells, doc, start, length, slot, cont, delay = (a[keep] for a in (cells, doc, start, length, slot, cont, delay))
        num_steps -= 1
        per_cell = per_cell[: num_steps * K]
    order = np.argsort(cells, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(per_cell)]).astype(np.int64)
    arrays = [offsets, *(np.ascontiguousarray(a[order]) for a in (doc, start, length, slot, cont, delay))]
    for a in arrays:
        a.flags.writeable = False
    offsets, doc, start, length, slot, cont, delay = arrays
    tokens, slot_tokens, packs = int(length.sum()), int(slot.sum()), num_steps * K
    schedule = Schedule(num_steps=num_steps, dp_size=R, micro_batches=M, capacity=C, pack_offsets=offsets,
                        doc_index=doc, doc_start=start, doc_len=length, slot_len=slot, continues=cont,
                        delay=delay, config=config, cost=cost,
                        stats=None)  # type: ignore[arg-type]  # set below  # fmt: skip
    imb = [0.0, 0.0] if cost is None or not num_steps else [float(i.mean()) for i in schedule.imbalance(cost)]
    stats = ScheduleStats(
        **{k: int(counts[k]) for k in COUNTS}, tokens=tokens, slot_tokens=slot_tokens, steps=num_steps,
        lower_bound_steps=-(-all_slot_tokens // (K * C)), packs=packs, empty_packs=int((per_cell == 0).sum()),
        padding_pct=100.0 * (1 - tokens / (packs * C)) if packs else 0.0, tail=tail,
        tail_dropped_steps=dropped_steps, tail_dropped_pieces=dropped_pieces, tail_dropped_tokens=dropped_tokens,
        delay_counts=tuple(np.bincount(delay).tolist()) if delay.size else (0,), imb_step_mean=imb[0],
        imb_mb_mean=imb[1],
    )  # fmt: skip
    return dataclasses.replace(schedule, stats=stats)
