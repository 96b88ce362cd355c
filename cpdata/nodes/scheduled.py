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

State: ``{"version", "config", "lengths_sha256", "position"}``: a restore is
O(1) (no replay); one saved under another configuration, another DP split or
over other lengths is refused with ``ValueError``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.nodes.source import to_document
from cpdata.offline.hf_datasets import indexed_hf_documents
from cpdata.plan import DocPiece, PackPlan
from cpdata.schedule import CostModel, Schedule, plan_schedule
from cpdata.state_version import check_saved_config, check_state_version
from cpdata.targets import LabelsAlignment, check_labels_alignment, piece_arrays

__all__ = ["SCHEDULES", "ScheduledPacks", "source_lengths"]

SCHEDULES: tuple[str, ...] = ("balanced", "in_order")
"""``balanced``: packs cost-balanced across ranks and micro-batches (:class:`~cpdata.schedule.CostModel`);
``in_order``: today's packs (``bfd``) in stream order, dealt to ranks step by step."""


def source_lengths(source: Any, lengths: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """int64 ``[n_docs]``: ``lengths`` if given, else ``source.lengths``; ``TypeError`` naming the fix otherwise."""
    if lengths is None:
        lengths = getattr(source, "lengths", None)
    if lengths is None:
        raise TypeError(
            f"schedule= plans from every document's length before reading any, but the source "
            f"({type(source).__name__}) has no .lengths; pass lengths=[...] (tokens per document), use "
            "cpdata.open_dataset(path) (it has .lengths), or schedule=None (each DP rank reads and packs "
            "documents i % dp_size as it streams)"
        )
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"lengths must be a 1-D integer array, got dtype {arr.dtype} shape {arr.shape}")
    if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
        raise TypeError(
            f"schedule= reads documents by index; the source ({type(source).__name__}) needs __len__ and "
            "__getitem__ (a list, a map-style dataset, cpdata.open_dataset(path))"
        )
    if len(source) != arr.shape[0]:
        raise ValueError(f"the source has {len(source)} documents but {arr.shape[0]} lengths; they must match")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, slots=True)
class _RankRows:
    """One rank's packs of a schedule, CSR: pack ``j`` (step ``j // M``, micro-batch ``j % M``)."""

    offsets: np.ndarray
    doc_index: np.ndarray
    doc_start: np.ndarray
    doc_len: np.ndarray
    slot_len: np.ndarray
    continues: np.ndarray


def _rank_rows(sched: Schedule, dp_rank: int) -> _RankRows:
    R, M = sched.dp_size, sched.micro_batches
    first = (np.arange(sched.num_steps, dtype=np.int64) * R + dp_rank) * M  # pack id of (step, rank, 0)
    packs = (first[:, None] + np.arange(M)).reshape(-1)
    lo, hi = sched.pack_offsets[packs], sched.pack_offsets[packs + 1]
    sizes = hi - lo
    rows = np.repeat(lo - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return _RankRows(offsets=offsets, doc_index=sched.doc_index[rows], doc_start=sched.doc_start[rows],
                     doc_len=sched.doc_len[rows], slot_len=sched.slot_len[rows],
                     continues=sched.continues[rows])  # fmt: skip


class ScheduledPacks(BaseNode[PackPlan]):
    """Emit this DP rank's packs of the global schedule as :class:`~cpdata.plan.PackPlan` (see the module docstring).

    Args:
        source: documents indexable by position (``source[i]`` a dict with ``input_ids``).
        capacity, layout, cp_size, algorithm, overflow, seed, shuffle, max_delay, tail: as for
            :func:`~cpdata.schedule.plan_schedule`.
        dp_rank, dp_size, micro_batches: this rank, the DP size, packs per rank per step.
        schedule: one of :data:`SCHEDULES`.
        cost: the cost model of ``"balanced"`` (default: the FlexSP 7B profile).
        lengths: tokens per document; default ``source.lengths``.
        vocab_size: token ids ``>= vocab_size`` raise ``ValueError``.
        worker: ``(worker_id, num_workers)``: serve items ``worker_id, worker_id + num_workers, ...``.
        labels_alignment: the documents' label convention, as for :class:`~cpdata.nodes.source.Documents`.
            The schedule is planned from lengths alone, so a document that trains nothing (every label
            -100) is packed like any other (the streaming packer leaves it out, counted as ``untrained``).

    A document whose length differs from ``lengths`` raises ``ValueError`` when read.
    """

    VERSION = 1
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    LENGTHS_KEY = "lengths_sha256"
    POSITION_KEY = "position"

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
        for name, value in (("dp_rank", dp_rank), ("dp_size", dp_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        worker_id, num_workers = worker
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"need 0 <= worker_id < num_workers, got worker={worker}")
        source = indexed_hf_documents(source)  # a datasets.Dataset: lengths from its length column or offsets
        arr = source_lengths(source, lengths)
        if schedule == "balanced" and cost is None:
            cost = CostModel()
        self.source, self.vocab_size = source, vocab_size
        self.dp_rank, self.dp_size, self.worker = int(dp_rank), int(dp_size), (int(worker_id), int(num_workers))
        self.schedule: Schedule = plan_schedule(
            arr, capacity=capacity, layout=layout, cp_size=cp_size, dp_size=dp_size, micro_batches=micro_batches,
            cost=cost if schedule == "balanced" else None, max_delay=max_delay, algorithm=algorithm,
            overflow=overflow, seed=seed, shuffle=shuffle, tail=tail,
        )  # fmt: skip
        self.lengths = arr
        self.num_steps, self.micro_batches = self.schedule.num_steps, self.schedule.micro_batches
        self._rows = _rank_rows(self.schedule, self.dp_rank)
        self._lengths_sha = hashlib.sha256(np.ascontiguousarray(arr, dtype="<i8").tobytes()).hexdigest()
        self._config = {
            "schedule": schedule, "capacity": int(capacity), "layout": layout, "cp_size": int(cp_size),
            "dp": [self.dp_rank, self.dp_size], "micro_batches": int(micro_batches), "max_delay": int(max_delay),
            "algorithm": algorithm, "overflow": self.schedule.config.overflow, "seed": int(seed),
            "shuffle": bool(shuffle), "tail": tail, "worker": list(self.worker),
            "cost": None if cost is None or schedule != "balanced" else [float(cost.a), float(cost.b)],
            "labels_alignment": self.labels_alignment,
        }  # fmt: skip
        self._position = 0
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
        other._position, other._cached, other.documents_read = 0, None, 0
        return other

    def __getstate__(self) -> dict[str, Any]:
        # Workers need only this rank's rows (1 / dp_size of the schedule): the whole plan stays behind.
        state = self.__dict__.copy()
        state["schedule"], state["_cached"] = None, None
        return state

    def __len__(self) -> int:
        """Items this worker serves per epoch."""
        total = self.num_steps * self.micro_batches
        w, n = self.worker
        return max(0, -(-(total - w) // n))

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._position = 0
        if initial_state is None:
            return
        check_state_version("ScheduledPacks", initial_state, self.VERSION_KEY, self.VERSION)
        check_saved_config("ScheduledPacks", initial_state[self.CONFIG_KEY], self._config)
        if initial_state.get(self.LENGTHS_KEY) != self._lengths_sha:
            raise ValueError(
                "ScheduledPacks state was saved over other document lengths (lengths sha256 "
                f"{str(initial_state.get(self.LENGTHS_KEY))[:16]}…, now {self._lengths_sha[:16]}…); "
                "resume on the same dataset"
            )
        position = initial_state[self.POSITION_KEY]
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position <= len(self):
            raise ValueError(f"ScheduledPacks state has position={position!r}, expected 0..{len(self)}")
        self._position = int(position)

    def _document(self, index: int) -> Mapping[str, np.ndarray]:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        try:
            item = self.source[index]
        except Exception as exc:
            raise type(exc)(f"reading document {index} from the source failed: {exc}") from exc
        arrays = to_document(item, index, self.vocab_size, self.labels_alignment).arrays
        self.documents_read += 1
        n = int(arrays[INPUT_IDS].shape[0])
        if n != int(self.lengths[index]):
            raise ValueError(
                f"document {index} has {n} tokens but its length was given as {int(self.lengths[index])}; "
                "the lengths must describe the source (re-read them, or rebuild the length index)"
            )
        self._cached = (index, arrays)
        return arrays

    def plan(self, item: int) -> PackPlan:
        """This rank's pack ``item`` (0-based, all workers together): random access."""
        step, micro_batch = divmod(item, self.micro_batches)
        s = self._rows
        rows = slice(int(s.offsets[item]), int(s.offsets[item + 1]))
        pieces = []
        for j in range(rows.start, rows.stop):
            doc, start, length = int(s.doc_index[j]), int(s.doc_start[j]), int(s.doc_len[j])
            arrays = self._document(doc)
            end, continues = start + length, bool(s.continues[j])
            sliced = piece_arrays(arrays, start, length, continues)
            next_label = int(arrays[INPUT_IDS][end]) if continues else IGNORE_INDEX
            pieces.append(DocPiece(index=doc, start=start, arrays=sliced, next_label=next_label))
        return PackPlan(pieces=tuple(pieces), slot_lens=np.array(s.slot_len[rows], dtype=np.int64),
                        capacity=self._config["capacity"], index=item,
                        extras={"step": step, "micro_batch": micro_batch})  # fmt: skip

    def next(self) -> PackPlan:
        if self._position >= len(self):
            raise StopIteration
        w, n = self.worker
        plan = self.plan(w + n * self._position)
        self._position += 1
        return plan

    def get_state(self) -> dict[str, Any]:
        return {
            self.VERSION_KEY: self.VERSION,
            self.CONFIG_KEY: dict(self._config),
            self.LENGTHS_KEY: self._lengths_sha,
            self.POSITION_KEY: self._position,
        }
