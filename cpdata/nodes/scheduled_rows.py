"""One DP rank's packs of a global schedule, epoch by epoch, and the lengths a schedule is planned from.

:class:`RankRows` is the slice of a :class:`~cpdata.schedule.Schedule` one DP
rank reads (``1 / dp_size`` of it: what a dataloader worker receives instead
of the whole plan). :class:`EpochRows` plans each epoch's schedule when asked
(``shuffle=True``: the lengths in the ``(seed, epoch)`` order; otherwise every
epoch is epoch 0's) and keeps the current epoch's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cpdata.schedule import Schedule, plan_schedule

__all__ = ["EpochRows", "RankRows", "check_dp_share", "rank_rows", "source_lengths"]


def check_dp_share(dp_rank: int, dp_size: int, num_epochs: int | None) -> None:
    """Refuse a DP rank/size that are not ints with ``0 <= dp_rank < dp_size``, or ``num_epochs`` not None or >= 1."""
    for name, value in (("dp_rank", dp_rank), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
    if num_epochs is not None and (isinstance(num_epochs, bool) or not isinstance(num_epochs, (int, np.integer))
                                   or num_epochs < 1):  # fmt: skip
        raise ValueError(f"num_epochs must be an int >= 1 or None (one epoch per iter()), got {num_epochs!r}")


def source_lengths(source: Any, lengths: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """int64 ``[n_docs]``: ``lengths`` if given, else ``source.lengths``; ``TypeError`` naming the fix otherwise."""
    if lengths is None:
        lengths = getattr(source, "lengths", None)
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
    if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
        raise TypeError(
            f"a SchedulePlan reads documents by index; the source ({type(source).__name__}) needs __len__ and "
            "__getitem__ (a list, a map-style dataset, cpdata.open_dataset(path))"
        )
    if len(source) != arr.shape[0]:
        raise ValueError(f"the source has {len(source)} documents but {arr.shape[0]} lengths; they must match")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, slots=True)
class RankRows:
    """One rank's packs of a schedule, CSR: pack ``j`` (step ``j // M``, micro-batch ``j % M``)."""

    offsets: np.ndarray
    doc_index: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    slot_len: np.ndarray
    continues: np.ndarray


def rank_rows(sched: Schedule, dp_rank: int) -> RankRows:
    """Rank ``dp_rank``'s packs of ``sched`` in (step, micro-batch) order."""
    R, M = sched.dp_size, sched.micro_batches
    first = (np.arange(sched.num_steps, dtype=np.int64) * R + dp_rank) * M  # pack id of (step, rank, 0)
    packs = (first[:, None] + np.arange(M)).reshape(-1)
    lo, hi = sched.pack_offsets[packs], sched.pack_offsets[packs + 1]
    sizes = hi - lo
    rows = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return RankRows(offsets=offsets, doc_index=sched.doc_index[rows], doc_start=sched.doc_start[rows],
                     doc_len=sched.doc_len[rows], slot_len=sched.slot_len[rows],
                     continues=sched.continues[rows])  # fmt: skip


class EpochRows:
    """A rank's rows for any epoch: planned with ``plan_kw`` (:func:`~cpdata.schedule.plan_schedule`'s
    arguments but ``epoch``), once per epoch when ``shuffle`` is on, else once for all epochs.

    Planning an epoch costs what the first did (~3-5 us per document, on every rank and worker).
    """

    def __init__(self, lengths: np.ndarray, dp_rank: int, plan_kw: dict[str, Any]) -> None:
        self.lengths, self.dp_rank, self.plan_kw = lengths, dp_rank, plan_kw
        self.shuffle = bool(plan_kw.get("shuffle", False))
        self.schedule: Schedule | None = plan_schedule(lengths, **plan_kw, epoch=0)
        self._rows: tuple[int, RankRows] = (0, rank_rows(self.schedule, dp_rank))

    def rows(self, epoch: int) -> RankRows:
        """The rows of epoch ``epoch`` (the schedule of ``shuffle=False`` is the same every epoch)."""
        epoch = epoch if self.shuffle else 0
        if self._rows[0] != epoch:
            self.schedule = plan_schedule(self.lengths, **self.plan_kw, epoch=epoch)
            self._rows = (epoch, rank_rows(self.schedule, self.dp_rank))
        return self._rows[1]

    def __getstate__(self) -> dict[str, Any]:
        # Workers need only this rank's rows (1 / dp_size of the schedule): the whole plan stays behind.
        return {**self.__dict__, "schedule": None}
