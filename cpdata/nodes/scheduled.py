"""``ScheduledPacks``: this DP rank's packs of a global schedule (docs/scheduling.md).

``ScheduledPacks`` replaces ``Documents -> Pack`` when the source states every document's length
(``open_dataset``, a token store, an HF length column, or ``SchedulePlan.lengths``): every rank and worker
computes the same :func:`~cpdata.schedule.plan_schedule` (no collective) and reads only its own packs'
documents; ``shuffle`` plans epoch ``e`` over the ``(seed, e)`` order; a restore is O(1).

A stream without lengths is planned in windows instead (:mod:`cpdata.nodes.windowed`), with the settings and the
rank's packs of :class:`RankPlanRows`.

Serving, workers, epochs and the state are :class:`~cpdata.nodes.served.ServedPacks`'s; a state from other
data or settings is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from cpdata.layout.runs import segments
from cpdata.nodes.served import PackRows, PlanRows, ServedPacks
from cpdata.nodes.source_kinds import read_document
from cpdata.schedule import CostModel, Schedule, plan_schedule
from cpdata.schedule.records import schedule_pack
from cpdata.sources.fingerprint import check_source_unchanged, source_fingerprint, source_identity
from cpdata.sources.open import as_source
from cpdata.sources.protocol import Indexed, StatedLengths
from cpdata.worker.keys import INPUT_IDS
from cpdata.worker.targets import check_labels_alignment

if TYPE_CHECKING:
    from cpdata.nodes.loader import GraphOptions

__all__ = ["RankPlanRows", "RankRows", "ScheduleRows", "ScheduledPacks", "rank_rows", "source_lengths"]


RankRows = dict[str, np.ndarray]
"""One rank's packs, CSR: pack ``j`` is rows ``offsets[j]:offsets[j + 1]`` of :mod:`cpdata.nodes.served`'s columns."""


def rank_rows(sched: Schedule, dp_rank: int) -> RankRows:
    """Rank ``dp_rank``'s packs of ``sched`` in (step, micro-batch) order."""
    items = np.arange(sched.num_steps * sched.micro_batches, dtype=np.int64)
    packs = schedule_pack(items, sched.micro_batches, dp_rank, sched.dp_size)[2]
    lo, hi = sched.pack_offsets[packs], sched.pack_offsets[packs + 1]
    sizes = hi - lo
    rows = segments(lo, sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return {"offsets": offsets, "doc_index": sched.doc_index[rows], "doc_start": sched.doc_start[rows],
            "doc_len": sched.doc_len[rows], "slot_len": sched.slot_len[rows], "continues": sched.continues[rows]}


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


class RankPlanRows(PlanRows):
    """What the rows of a global schedule share (:class:`ScheduleRows`, a stream's windows:
    :class:`~cpdata.nodes.windowed.WindowRows`): its settings,
    checked by the planner on construction, and the :class:`PackRows` of one rank's pack of it.

    ``config`` (the state's): the options, the overflow default resolved, and ``extra``. Without a
    ``cost``, ``"balanced"`` takes the FlexSP 7B profile, or the token plan when it is cheaper once pads are
    counted; ``fallback=False`` (a window's plan, whose tail applies per window) never takes the token plan.
    """

    def __init__(self, source: Any, options: GraphOptions, extra: Mapping[str, Any], *, fallback: bool) -> None:
        plan, data = options.plan, options.data
        fallback = fallback and plan.kind == "balanced" and plan.cost is None
        cost = (plan.cost or CostModel()) if plan.kind == "balanced" else None
        self.plan_kw = dict(capacity=options.capacity, layout=options.layout, cp_size=options.cp_size,
                            dp_size=int(data.dp_size), micro_batches=plan.micro_batches, cost=cost,
                            max_delay=plan.max_delay, algorithm=plan.algorithm, overflow=plan.overflow,
                            seed=data.seed, tail=plan.tail, fallback=fallback)  # fmt: skip
        probe = plan_schedule(np.zeros(0, dtype=np.int64), **self.plan_kw)  # checks every argument now
        self.config = {
            "schedule": plan.kind, "capacity": int(options.capacity), "layout": options.layout,
            "cp_size": int(options.cp_size), "dp": [int(data.dp_rank), int(data.dp_size)],
            "micro_batches": int(plan.micro_batches), "max_delay": int(plan.max_delay), "algorithm": plan.algorithm,
            "overflow": probe.config.overflow, "seed": int(data.seed), "tail": plan.tail,
            "cost": None if cost is None else [float(cost.a), float(cost.b)], "fallback": fallback,
            "labels_alignment": check_labels_alignment(data.labels_alignment), **extra,
        }  # fmt: skip
        self.source, self.capacity, self.micro_batches = source, int(options.capacity), int(plan.micro_batches)
        self.dp_rank, self.dp_size, self.vocab_size = int(data.dp_rank), int(data.dp_size), data.vocab_size
        self.labels_alignment = data.labels_alignment

    def rank_pack(self, rows: RankRows, item: int, base: int = 0, first_document: int = 0, **extras: Any) -> PackRows:
        """This rank's pack ``item`` of ``rows`` (:func:`schedule_pack`), its id counted after ``base`` packs."""
        step, micro_batch, pack = schedule_pack(item, self.micro_batches, self.dp_rank, self.dp_size)
        return PackRows(columns=rows, rows=slice(int(rows["offsets"][item]), int(rows["offsets"][item + 1])),
                        index=base + pack, first_document=first_document,
                        extras={"step": step, "micro_batch": micro_batch, **extras})  # fmt: skip


class ScheduleRows(RankPlanRows):
    """The rows of :class:`ScheduledPacks`: one block per epoch, planned when first asked for (without
    ``shuffle`` every epoch is epoch 0's)."""

    def __init__(self, source: Any, lengths: np.ndarray, options: GraphOptions) -> None:
        shuffle = options.data.shuffle
        super().__init__(source, options, {"shuffle": shuffle}, fallback=True)
        self.lengths, self.shuffle = lengths, shuffle
        self.plan_kw["shuffle"] = shuffle
        self.schedule: Schedule | None = plan_schedule(lengths, **self.plan_kw, epoch=0)  # None in a worker
        self._rows: tuple[int, RankRows] = (0, rank_rows(self.schedule, self.dp_rank))
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
        return self.rank_pack(self.rows(epoch), item, epoch=epoch)

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

    ``options.plan`` is a :class:`~cpdata.nodes.options.SchedulePlan`; ``worker``: a
    :class:`~cpdata.nodes.served.WorkerShare`. Planned from lengths alone, a document that trains nothing
    is packed like any other; one whose length differs from the lengths raises ``ValueError`` when read.
    """

    rows: ScheduleRows

    def __init__(self, source: Any, options: GraphOptions, *, worker: tuple[int, int] = (0, 1)) -> None:
        source = as_source(source, indexed=True)  # a datasets.Dataset: its lengths; a mix: its draw listing
        rows = ScheduleRows(source, source_lengths(source, options.plan.lengths), options)
        super().__init__(rows, num_epochs=options.data.epochs, worker=worker)

    @property
    def schedule(self) -> Schedule | None:
        """The current epoch's schedule (None in a dataloader worker, which gets this rank's rows only)."""
        return self.rows.schedule

    @property
    def documents_read(self) -> int:
        """Documents read from the source (a split document once per run of packs)."""
        return self.rows.documents_read
