"""``ScheduledPacks``: this DP rank's packs of a global schedule, reading only their documents.

Replaces ``Documents -> Pack`` when the source knows every document's length
up front (``open_dataset(...).lengths``, a token store index, an HF length
column, or ``lengths=`` given)::

    lengths ──► plan_schedule (same on every rank, no collective)
                   └─► packs (step, dp_rank, micro_batch) of this rank ─► read those documents ─► PackPlan

Every rank, CP rank and dataloader worker computes the same
:func:`~cpdata.schedule.plan_schedule` from the same lengths (a pure
function, once per process). This rank's packs form one sequence, step by
step and micro-batch by micro-batch (pack ``j`` is micro-batch
``j % micro_batches`` of step ``j // micro_batches``); dataloader workers
split it as :class:`~cpdata.nodes.served.ServedPacks` does, each reading only
the documents of its own packs: worker CPU per pack does not grow with ``N``.
``shuffle=True`` plans epoch ``e`` over the documents in the ``(seed, e)``
order, when the epoch starts (the schedule stays a pure function of its
arguments and the epoch).

Serving, epochs and state belong to ``ServedPacks`` (``identity``: the
source's and the lengths'): a restore is O(1) (no replay: at most the epoch's
plan); one saved under another configuration, another DP split or over other
lengths is refused with ``ValueError``.
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
    """The rows of :class:`ScheduledPacks` (a :class:`~cpdata.nodes.served.PlanRows`): this rank's packs of
    each epoch's schedule, one block per epoch, and the source read by index. An epoch is planned when
    first asked for (``shuffle``: over the lengths in the ``(seed, epoch)`` order; otherwise every epoch is
    epoch 0's), ~3-5 us per document on every rank and worker."""

    def __init__(self, source: Any, lengths: np.ndarray, plan_kw: dict[str, Any], config: dict[str, Any], *,
                 dp_rank: int, vocab_size: int | None, labels_alignment: LabelsAlignment | None) -> None:  # fmt: skip
        self.source, self.lengths, self.vocab_size, self.labels_alignment = source, lengths, vocab_size, labels_alignment
        self.plan_kw, self.shuffle = plan_kw, bool(plan_kw["shuffle"])
        self.dp_rank, self.dp_size, self.capacity = dp_rank, int(plan_kw["dp_size"]), int(plan_kw["capacity"])
        self.micro_batches, self.config = int(plan_kw["micro_batches"]), config
        self.schedule: Schedule | None = plan_schedule(lengths, **plan_kw, epoch=0)
        """The last epoch planned's schedule (the whole plan; None in a dataloader worker, which gets its rows)."""
        self._rows: tuple[int, RankRows] = (0, rank_rows(self.schedule, dp_rank))
        self.identity = source_identity(source, lengths)
        self._fingerprint = source_fingerprint(source)
        self.documents_read = 0

    def __getstate__(self) -> dict[str, Any]:
        # Workers need only this rank's rows (1 / dp_size of the schedule): the whole plan stays behind.
        return {**self.__dict__, "schedule": None}

    def rows(self, epoch: int) -> RankRows:
        """This rank's rows of epoch ``epoch`` (the schedule of ``shuffle=False`` is the same every epoch)."""
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
    """Emit this DP rank's packs of the global schedule as :class:`~cpdata.worker.plan.PackPlan` (see the module docstring).

    Args:
        source: documents indexable by position (``source[i]`` a dict with ``input_ids``).
        capacity, layout, cp_size, algorithm, overflow, seed, max_delay, tail: as for
            :func:`~cpdata.schedule.plan_schedule`.
        dp_rank, dp_size, micro_batches: this rank, the DP size, packs per rank per step.
        schedule: one of :data:`SCHEDULES`.
        cost: the cost model of ``"balanced"``; default: the FlexSP 7B profile, with the token plan
            taken instead when it is cheaper once pads are counted (``plan_schedule(fallback=True)``).
        shuffle: plan epoch ``e`` over the documents in the ``(seed, e)`` order (the order
            :class:`~cpdata.nodes.source.Documents` reads a shuffled sequence in): each epoch's schedule
            is planned when it starts, on every rank and worker alike.
        num_epochs: epochs per ``iter()`` (default one; the next ``iter()`` starts the next epoch).
        lengths: tokens per document; default ``source.lengths``.
        vocab_size: token ids ``>= vocab_size`` raise ``ValueError``.
        worker: ``(worker_id, num_workers)``: serve items ``worker_id, worker_id + num_workers, ...`` of the
            epochs of one ``iter()`` in sequence (so the loader's round-robin keeps the order at epoch ends).
        labels_alignment: the documents' label convention, as for :class:`~cpdata.nodes.source.Documents`.
            The schedule is planned from lengths alone, so a document that trains nothing (every label
            -100) is packed like any other (the streaming packer leaves it out, counted as ``untrained``).

    A document whose length differs from ``lengths`` raises ``ValueError`` when read.
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
        """The current epoch's schedule (the whole plan; None in a dataloader worker, which gets its rows only)."""
        return self.rows.schedule

    @property
    def documents_read(self) -> int:
        """Documents this node has read from the source (a split document counts once per run of packs)."""
        return self.rows.documents_read
