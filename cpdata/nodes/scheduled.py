"""``ScheduledPacks``: this DP rank's packs of a global schedule, reading only their documents.

Replaces ``Documents -> Pack`` when the source knows every document's length
up front (``open_dataset(...).lengths``, a token store index, an HF length
column, or ``lengths=`` given)::

    lengths ──► plan_schedule (same on every rank, no collective)
                   └─► packs (step, dp_rank, micro_batch) of this rank ─► read those documents ─► PackPlan

Every rank, CP rank and dataloader worker computes the same
:func:`~cpdata.schedule.plan_schedule` from the same lengths (a pure
function: ~3-5 us per document, once per process). This rank's packs form one
sequence, step by step and micro-batch by micro-batch (pack ``j`` is
micro-batch ``j % micro_batches`` of step ``j // micro_batches``); a
``StatefulDataLoader`` worker ``w`` of ``N`` serves items ``w, w + N, ...`` of
it (steps ``w, w + N, ...`` when ``micro_batches == 1``), so the loader's
round-robin gives the same order for every ``N`` and each worker reads only
the documents of its own packs: worker CPU per pack does not grow with ``N``.

Epochs: ``shuffle=True`` plans epoch ``e`` over the documents in the
``(seed, e)`` order (every rank and worker plans it when the epoch starts:
the schedule stays a pure function of its arguments and the epoch);
``num_epochs`` runs that many epochs per ``iter()``, the items going on in one
sequence across epoch ends, as :class:`~cpdata.nodes.source.Documents` does.

State: ``{"version", "config", "lengths_sha256", "epoch", "first_epoch",
"item"}`` (``item``: the next pack of the epoch this worker serves): a restore
is O(1) (no replay: at most the epoch's plan); one saved under another
configuration, another DP split or over other lengths is refused with
``ValueError``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.document_names import name_document_error
from cpdata.nodes.scheduled_rows import EpochRows, check_dp_share, source_lengths
from cpdata.nodes.source import to_document
from cpdata.nodes.state_version import check_saved_config, check_state_version
from cpdata.schedule import CostModel, Schedule
from cpdata.sources.hf import indexed_hf_documents
from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.worker.plan import DocPiece, PackPlan
from cpdata.worker.targets import LabelsAlignment, check_labels_alignment, piece_arrays

__all__ = ["SCHEDULES", "ScheduledPacks", "source_lengths"]

SCHEDULES: tuple[str, ...] = ("balanced", "in_order")
"""``balanced``: packs cost-balanced across ranks and micro-batches (:class:`~cpdata.schedule.CostModel`);
``in_order``: today's packs (``bfd``) in stream order, dealt to ranks step by step."""


class ScheduledPacks(BaseNode[PackPlan]):
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

    VERSION = 2  # 2: epochs (the epoch, the first epoch of the iter() and the next item of the epoch)
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    LENGTHS_KEY = "lengths_sha256"
    EPOCH_KEY = "epoch"
    FIRST_EPOCH_KEY = "first_epoch"
    ITEM_KEY = "item"

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
        super().__init__()
        self.labels_alignment = check_labels_alignment(labels_alignment)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)} or None")
        check_dp_share(dp_rank, dp_size, num_epochs)
        worker_id, num_workers = worker
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"need 0 <= worker_id < num_workers, got worker={worker}")
        source = indexed_hf_documents(source)  # a datasets.Dataset: lengths from its length column or offsets
        arr = source_lengths(source, lengths)
        fallback = schedule == "balanced" and cost is None  # the default: the token plan when it is cheaper
        if fallback:
            cost = CostModel()
        self.source, self.vocab_size, self.num_epochs = source, vocab_size, num_epochs
        self.dp_rank, self.dp_size, self.worker = int(dp_rank), int(dp_size), (int(worker_id), int(num_workers))
        self._plans = EpochRows(arr, self.dp_rank, dict(
            capacity=capacity, layout=layout, cp_size=cp_size, dp_size=dp_size, micro_batches=micro_batches,
            cost=cost if schedule == "balanced" else None, max_delay=max_delay, algorithm=algorithm,
            overflow=overflow, seed=seed, shuffle=shuffle, tail=tail, fallback=fallback,
        ))  # fmt: skip
        self.schedule: Schedule = self._plans.schedule  # type: ignore[assignment]
        """Epoch 0's schedule (the whole plan; not sent to dataloader workers)."""
        self.lengths = arr
        self.num_steps, self.micro_batches = self.schedule.num_steps, self.schedule.micro_batches
        self._lengths_sha = hashlib.sha256(np.ascontiguousarray(arr, dtype="<i8").tobytes()).hexdigest()
        self._config = {
            "schedule": schedule, "capacity": int(capacity), "layout": layout, "cp_size": int(cp_size),
            "dp": [self.dp_rank, self.dp_size], "micro_batches": int(micro_batches), "max_delay": int(max_delay),
            "algorithm": algorithm, "overflow": self.schedule.config.overflow, "seed": int(seed),
            "shuffle": bool(shuffle), "num_epochs": num_epochs, "tail": tail, "worker": list(self.worker),
            "cost": None if cost is None or schedule != "balanced" else [float(cost.a), float(cost.b)],
            "fallback": fallback,
            "labels_alignment": self.labels_alignment,
        }  # fmt: skip
        self._epoch, self._first_epoch, self._item, self._started = 0, 0, self.worker[0], False
        self._cached: tuple[int, Mapping[str, np.ndarray]] | None = None
        self.documents_read = 0
        """Documents this node has read from the source (a split document counts once per pack it spans)."""

    def with_worker(self, worker: tuple[int, int]) -> ScheduledPacks:
        """The same rank's packs for dataloader worker ``worker = (worker_id, num_workers)``, not planned again."""
        worker_id, num_workers = worker
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"need 0 <= worker_id < num_workers, got worker={worker}")
        other = copy.copy(self)
        BaseNode.__init__(other)
        other.worker = (int(worker_id), int(num_workers))
        other._config = {**self._config, "worker": list(other.worker)}
        other._item, other._cached, other.documents_read = other.worker[0], None, 0
        return other

    def __getstate__(self) -> dict[str, Any]:
        # Workers need only this rank's rows (1 / dp_size of the schedule): the whole plan stays behind.
        return {**self.__dict__, "schedule": None, "_cached": None}

    def __len__(self) -> int:
        """Items this worker serves of epoch 0 when it starts the epoch (later epochs may differ by a step)."""
        total = self.num_steps * self.micro_batches  # epoch 0's, without replanning it in a later epoch
        w, n = self.worker
        return max(0, -(-(total - w) // n))

    @property
    def epoch(self) -> int:
        """The epoch being served (0-based; counts on across ``iter()`` calls and restores)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next fresh ``reset()`` (a new ``iter()``) start epoch ``epoch`` (for processes that
        rebuild the node every epoch, like ``DistributedSampler.set_epoch``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch, self._started = int(epoch) - 1, epoch > 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._epoch = self._epoch + 1 if self._started else 0  # a new iter(): the next epoch
            self._first_epoch, self._item, self._started = self._epoch, self.worker[0], True
            return
        check_state_version("ScheduledPacks", initial_state, self.VERSION_KEY, self.VERSION)
        check_saved_config("ScheduledPacks", initial_state[self.CONFIG_KEY], self._config)
        if initial_state.get(self.LENGTHS_KEY) != self._lengths_sha:
            raise ValueError(
                "ScheduledPacks state was saved over other document lengths (lengths sha256 "
                f"{str(initial_state.get(self.LENGTHS_KEY))[:16]}…, now {self._lengths_sha[:16]}…); "
                "resume on the same dataset"
            )
        values = [initial_state.get(k) for k in (self.EPOCH_KEY, self.FIRST_EPOCH_KEY, self.ITEM_KEY)]
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in values) or (
                values[1] > values[0]):  # fmt: skip
            raise ValueError(f"ScheduledPacks state has epoch, first_epoch, item = {values}; expected ints >= 0 "
                             "with first_epoch <= epoch")  # fmt: skip
        self._epoch, self._first_epoch, self._item = (int(v) for v in values)
        self._started = True

    def _document(self, index: int) -> Mapping[str, np.ndarray]:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        try:
            item = self.source[index]
        except Exception as exc:
            raise type(exc)(f"reading document {index} from the source failed: {exc}") from exc
        try:
            arrays = to_document(item, index, self.vocab_size, self.labels_alignment).arrays
        except (TypeError, ValueError) as exc:
            name_document_error(exc, self.source)  # a mix: document i of source 'b'
            raise
        self.documents_read += 1
        n = int(arrays[INPUT_IDS].shape[0])
        if n != int(self.lengths[index]):
            raise ValueError(
                f"document {index} has {n} tokens but its length was given as {int(self.lengths[index])}; "
                "the lengths must describe the source (re-read them, or rebuild the length index)"
            )
        self._cached = (index, arrays)
        return arrays

    def plan(self, item: int, epoch: int = 0) -> PackPlan:
        """This rank's pack ``item`` (0-based, all workers together) of epoch ``epoch``: random access."""
        step, micro_batch = divmod(item, self.micro_batches)
        s = self._plans.rows(epoch)
        rows = slice(int(s.offsets[item]), int(s.offsets[item + 1]))
        pieces = []
        for j in range(rows.start, rows.stop):
            doc, start, length = int(s.doc_index[j]), int(s.doc_start[j]), int(s.doc_len[j])
            arrays = self._document(doc)
            end, continues = start + length, bool(s.continues[j])
            sliced = piece_arrays(arrays, start, length, continues)
            next_label = int(arrays[INPUT_IDS][end]) if continues else IGNORE_INDEX
            pieces.append(DocPiece(index=doc, start=start, arrays=sliced, next_label=next_label))
        pack = (step * self.dp_size + self.dp_rank) * self.micro_batches + micro_batch  # the schedule's pack id
        return PackPlan(pieces=tuple(pieces), slot_lens=np.array(s.slot_len[rows], dtype=np.int64),
                        capacity=self._config["capacity"], index=pack,
                        extras={"step": step, "micro_batch": micro_batch, "epoch": epoch})  # fmt: skip

    def next(self) -> PackPlan:
        while True:
            total = int(self._plans.rows(self._epoch).offsets.shape[0]) - 1
            if self._item < total:
                break
            if self._epoch + 1 - self._first_epoch >= (self.num_epochs or 1):
                raise StopIteration
            # The next epoch of this iter(): the items go on in one sequence across the epoch end.
            self._item, self._epoch = self._item - total, self._epoch + 1
        plan = self.plan(self._item, self._epoch)
        self._item += self.worker[1]
        return plan

    def get_state(self) -> dict[str, Any]:
        return {
            self.VERSION_KEY: self.VERSION,
            self.CONFIG_KEY: dict(self._config),
            self.LENGTHS_KEY: self._lengths_sha,
            self.EPOCH_KEY: self._epoch,
            self.FIRST_EPOCH_KEY: self._first_epoch,
            self.ITEM_KEY: self._item,
        }
