"""``ScheduledPacks``: this DP rank's packs of a global schedule, reading only their documents.

Replaces ``Documents -> Pack`` when the source states every document's length up front
(``open_dataset(...).lengths``, a token store index, an HF length column, or ``lengths=`` given)::

    lengths ──► plan_schedule (same on every rank, no collective)
                   └─► packs (step, dp_rank, micro_batch) of this rank ─► read those documents ─► PackPlan

Every rank, CP rank and worker computes the same :func:`~cpdata.schedule.plan_schedule` (a pure
function); pack ``j`` of this rank is micro-batch ``j % micro_batches`` of step ``j // micro_batches``.
``shuffle=True`` plans epoch ``e`` over the documents in the ``(seed, e)`` order when it starts. Serving,
worker striding, epochs and the state are :class:`~cpdata.nodes.served.ServedPacks`'s (identity: the
source's and the lengths'): a restore is O(1), one from other data or settings is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cpdata.nodes.scheduled_rows import SCHEDULES, RankRows, rank_rows, schedule_settings, source_lengths
from cpdata.nodes.served import PackRows, PlanRows, ServedPacks
from cpdata.nodes.source_kinds import read_document
from cpdata.schedule import CostModel, Schedule, plan_schedule
from cpdata.sources.fingerprint import check_source_unchanged, source_fingerprint, source_identity
from cpdata.sources.open import as_source
from cpdata.worker.keys import INPUT_IDS
from cpdata.worker.targets import LabelsAlignment

__all__ = ["SCHEDULES", "ScheduleRows", "ScheduledPacks", "source_lengths"]

class ScheduleRows(PlanRows):
    """The :class:`~cpdata.nodes.served.PlanRows` of :class:`ScheduledPacks`: one block per epoch, planned
    when first asked for (without ``shuffle`` every epoch is epoch 0's)."""

    def __init__(self, source: Any, lengths: np.ndarray, plan_kw: dict[str, Any], config: dict[str, Any], *,
                 dp_rank: int, vocab_size: int | None, labels_alignment: LabelsAlignment | None) -> None:  # fmt: skip
        self.source, self.lengths, self.vocab_size, self.labels_alignment = source, lengths, vocab_size, labels_alignment
        self.plan_kw, self.shuffle = plan_kw, bool(plan_kw["shuffle"])
        self.dp_rank, self.dp_size, self.capacity = dp_rank, int(plan_kw["dp_size"]), int(plan_kw["capacity"])
        self.micro_batches, self.config = int(plan_kw["micro_batches"]), config
        self.schedule: Schedule | None = plan_schedule(lengths, **plan_kw, epoch=0)  # None in a worker
        self._rows: tuple[int, RankRows] = (0, rank_rows(self.schedule, dp_rank))
        self.identity = source_identity(source, lengths)
        self._fingerprint = source_fingerprint(source)
        self.documents_read = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "schedule": None}

    def rows(self, epoch: int) -> RankRows:
        """This rank's rows of epoch ``epoch``."""
        epoch = epoch if self.shuffle else 0
        if self._rows[0] != epoch:
            self.schedule = plan_schedule(self.lengths, **self.plan_kw, epoch=epoch)
            self._rows = (epoch, rank_rows(self.schedule, self.dp_rank))
        return self._rows[1]

    def start(self, epoch: int, block: Mapping[str, Any] | None) -> int:
        check_source_unchanged(self.source, self._fingerprint)  # changed data: refused naming file and document
        return 0

    def packs(self, epoch: int) -> int:
        return int(self.rows(epoch)["offsets"].shape[0]) - 1

    def pack(self, epoch: int, item: int) -> PackRows:
        s = self.rows(epoch)
        step, micro_batch = divmod(item, self.micro_batches)
        pack = (step * self.dp_size + self.dp_rank) * self.micro_batches + micro_batch  # the schedule's pack id
        return PackRows(columns=s, rows=slice(int(s["offsets"][item]), int(s["offsets"][item + 1])), index=pack,
                        extras={"step": step, "micro_batch": micro_batch, "epoch": epoch})  # fmt: skip

    def document(self, index: int) -> Mapping[str, np.ndarray]:
        arrays = read_document(self.source, index, self.vocab_size, self.labels_alignment).arrays
        self.documents_read += 1
        n = int(arrays[INPUT_IDS].shape[0])
        if n != int(self.lengths[index]):
            raise ValueError(
                f"document {index} has {n} tokens but its length was given as {int(self.lengths[index])}; "
                "the lengths must describe the source (re-read them, or rebuild the length index)"
            )
        return arrays


class ScheduledPacks(ServedPacks):
    """This DP rank's packs of the global schedule of an indexable ``source`` (module docstring).

    The options are :class:`~cpdata.nodes.options.SchedulePlan`'s and
    :class:`~cpdata.nodes.options.DataPolicy`'s (``schedule``: ``SchedulePlan.kind``); ``worker``: a
    :class:`~cpdata.nodes.served.WorkerShare`. Planned from lengths alone, a document that trains nothing
    is packed like any other; one whose length differs from ``lengths`` raises ``ValueError`` when read.
    """

    rows: ScheduleRows

    def __init__(
        self,
        source: Any,
        *,
        capacity: int,
        layout: str,
        cp_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        micro_batches: int = 1,
        schedule: str = "balanced",
        cost: CostModel | None = None,
        max_delay: int = 0,
        algorithm: str = "bfd",
        overflow: str | None = None,
        seed: int = 0,
        shuffle: bool = False,
        num_epochs: int | None = None,
        tail: str = "pad",
        lengths: Sequence[int] | np.ndarray | None = None,
        vocab_size: int | None = None,
        worker: tuple[int, int] = (0, 1),
        labels_alignment: LabelsAlignment | None = None,
    ) -> None:
        plan_kw, config = schedule_settings(
            schedule, capacity=capacity, layout=layout, cp_size=cp_size, dp_rank=dp_rank, dp_size=dp_size,
            micro_batches=micro_batches, cost=cost, max_delay=max_delay, algorithm=algorithm, overflow=overflow,
            seed=seed, tail=tail, labels_alignment=labels_alignment,
        )  # fmt: skip
        source = as_source(source, indexed=True)  # a datasets.Dataset: its lengths; a mix: its draw listing
        rows = ScheduleRows(source, source_lengths(source, lengths), {**plan_kw, "shuffle": shuffle},
                            {**config, "shuffle": bool(shuffle)}, dp_rank=int(dp_rank), vocab_size=vocab_size,
                            labels_alignment=config["labels_alignment"])  # fmt: skip
        super().__init__(rows, num_epochs=num_epochs, worker=worker)

    @property
    def schedule(self) -> Schedule | None:
        """The current epoch's schedule (None in a dataloader worker, which gets this rank's rows only)."""
        return self.rows.schedule

    @property
    def documents_read(self) -> int:
        """Documents read from the source (a split document once per run of packs)."""
        return self.rows.documents_read
