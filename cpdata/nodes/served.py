"""``ServedPacks``: the one node that serves planned rows as ``PackPlan``s.

A plan is CSR rows (``doc_index``, ``doc_start``, ``doc_len``, ``slot_len``, ``continues``; pack ``p``
is rows ``offsets[p]:offsets[p + 1]``) from a :class:`PlanRows` provider: a schedule planned from
lengths (:class:`~cpdata.nodes.scheduled.ScheduledPacks`), a stream planned window by window
(:class:`~cpdata.nodes.windowed.WindowedPacks`) or a plan directory
(:class:`~cpdata.offline.reader.PrecomputedPacks`). This node owns, once for all three: the rows ->
``PackPlan`` loop (:func:`emit_plan`), the one-document cache, worker striding (:class:`WorkerShare`),
epochs (:class:`~cpdata.nodes.epochs.EpochClock`) and the state ``{"version", "config", "identity",
"epoch", "first_epoch", "item", "block"}`` (``item``: this rank's next pack in the current block, an
epoch or a stream's window; ``block``: the provider's position). A restore is O(1) but for a stream,
which replays up to its window; a state from another configuration, identity or version is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cpdata.errors import check_int
from cpdata.nodes.epochs import EpochClock, EpochNode, check_num_epochs
from cpdata.nodes.state_version import VersionedState
from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.worker.plan import DocPiece, PackPlan, PieceColumns
from cpdata.worker.targets import piece_arrays

__all__ = ["PackRows", "PlanRows", "ServedPacks", "WorkerShare", "emit_plan"]


@dataclass(frozen=True, slots=True)
class WorkerShare:
    """Dataloader worker ``worker_id`` of ``num_workers``'s items of a sequence: runs of ``run`` items dealt
    round-robin (``run=1``: items ``w, w + N, ...``), so a ``StatefulDataLoader`` taking workers round-robin
    yields the ``num_workers=0`` order for any ``N``."""

    worker_id: int = 0
    num_workers: int = 1
    run: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"need 0 <= worker_id < num_workers, got worker={(self.worker_id, self.num_workers)}")
        check_int("batch", self.run, min=1, fix=" (packs a worker serves in a run)")

    @property
    def first(self) -> int:
        return self.worker_id * self.run

    def owns(self, item: int) -> bool:
        return item // self.run % self.num_workers == self.worker_id

    def after(self, item: int) -> int:
        """The share's next item after its ``item``."""
        return item + 1 if (item + 1) % self.run else item + 1 + (self.num_workers - 1) * self.run

    def count(self, total: int) -> int:
        """The share's items among the first ``total``."""
        span = self.num_workers * self.run
        return total // span * self.run + min(max(total % span - self.first, 0), self.run)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackRows:
    """Where one pack's ``rows`` of the plan's ``columns`` are, and what names it: ``index`` (``PackPlan.index``),
    ``first_document`` (subtracted from ``doc_index`` for a piece's ``index``) and ``extras``."""

    columns: Mapping[str, np.ndarray]
    rows: slice
    index: int
    first_document: int = 0
    extras: Mapping[str, object] = field(default_factory=dict)


class PlanRows:
    """A provider of plan rows for :class:`ServedPacks`; the defaults serve one block per epoch."""

    config: dict[str, Any]  # compared on restore, as is identity (the data the rows were planned over)
    identity: str | None
    capacity: int
    source: Any  # the documents the rows read (what names them in errors and batches)

    def start(self, epoch: int, block: Mapping[str, Any] | None) -> int:
        """Begin ``epoch`` at a saved ``block`` position (None: its start); returns the block to load first."""
        return 0

    def packs(self, epoch: int) -> int | None:
        """This rank's packs in ``epoch`` when known before reading (None: a stream's)."""
        raise NotImplementedError

    def load(self, epoch: int, block: int) -> int | None:
        """Make block ``block`` of ``epoch`` current; its count of this rank's packs, None past the last."""
        return self.packs(epoch) if block == 0 else None

    def pack(self, epoch: int, item: int) -> PackRows:
        """This rank's pack ``item`` of the current block."""
        raise NotImplementedError

    def document(self, index: int) -> Mapping[str, np.ndarray]:
        """Document ``index`` (as the columns number it), validated."""
        raise NotImplementedError

    def position(self) -> Mapping[str, Any] | None:
        """The current block's position for a state (None: a block needs none)."""
        return None


def emit_plan(pack: PackRows, capacity: int, read: Any) -> PackPlan:
    """The :class:`~cpdata.worker.plan.PackPlan` of ``pack``'s rows, documents from ``read(index, more)``
    (``more``: a piece of the document follows in a later row)."""
    c, pieces = pack.columns, []
    for j in range(pack.rows.start, pack.rows.stop):
        doc, start, length = int(c["doc_index"][j]), int(c["doc_start"][j]), int(c["doc_len"][j])
        continues = bool(c["continues"][j])
        arrays = read(doc, continues)
        n = int(arrays[INPUT_IDS].shape[0])
        if start + length > n:
            raise ValueError(
                f"the plan places tokens {start}:{start + length} of document {doc}, which has {n} tokens; the "
                "documents do not match the plan: re-plan them (re-run `cpdata precompute`, re-read the lengths)"
            )
        next_label = int(arrays[INPUT_IDS][start + length]) if continues else IGNORE_INDEX
        pieces.append(DocPiece(index=doc - pack.first_document, start=start,
                               arrays=piece_arrays(arrays, start, length, continues), next_label=next_label))  # fmt: skip
    return PackPlan(pieces=PieceColumns.of(pieces), slot_lens=np.array(c["slot_len"][pack.rows], dtype=np.int64),
                    capacity=capacity, index=pack.index, extras=dict(pack.extras))  # fmt: skip


class ServedPacks(VersionedState, EpochNode[PackPlan]):
    """This DP rank's packs from a :class:`PlanRows` provider: ``worker``'s share, ``num_epochs`` per ``iter()``
    (None: one; the next ``iter()`` starts the next)."""

    VERSION = 3  # 3: one state for every plan provider
    KEYS = ("version", "config", "identity", "epoch", "first_epoch", "item", "block")

    def __init__(self, rows: PlanRows, *, num_epochs: int | None = None, worker: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        self.rows, self.num_epochs = rows, check_num_epochs(num_epochs)
        self._share(worker, 1)

    def _share(self, worker: tuple[int, int], batch: int) -> None:
        self.share = WorkerShare(*worker, batch)
        self._count: int | None = None  # packs of the current block; None: not loaded
        self._cached: tuple[int, Mapping[str, np.ndarray]] | None = None
        self._item, self._block = self.share.first, 0

    def with_worker(self, worker: tuple[int, int], batch: int = 1) -> ServedPacks:
        """The same rank's packs for dataloader worker ``worker`` serving runs of ``batch``, not planned again."""
        other = copy.copy(self)
        EpochNode.__init__(other)
        other.epoch_clock = copy.copy(self.epoch_clock)
        other.rows = copy.copy(self.rows)
        other._share(worker, batch)
        return other

    @property
    def source(self) -> Any:
        """The documents the rows read (not a node: a walk of the graph ends here)."""
        return self.rows.source

    def config(self) -> dict[str, Any]:
        s = self.share
        return {**self.rows.config, "worker": [s.worker_id, s.num_workers], "batch": s.run, "num_epochs": self.num_epochs}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cached": None}

    def __len__(self) -> int:
        """Items this worker serves of the current epoch (a plan known up front; a stream has no length)."""
        total = self.rows.packs(self.epoch)
        if total is None:
            raise TypeError(f"{type(self).__name__} plans a stream as it reads it: its length is not known")
        return self.share.count(total)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._count, self._cached = None, None
        if initial_state is None:
            self._block, self._item = self.rows.start(self.epoch_clock.start(), None), self.share.first
            return
        name = type(self).__name__
        self.check_saved(initial_state, self.config())
        if initial_state.get("identity") != self.rows.identity:
            raise ValueError(
                f"{name} state was saved over other data (identity {str(initial_state.get('identity'))[:24]}…, "
                f"now {str(self.rows.identity)[:24]}…: other document lengths, or another plan); resume on the same "
                "dataset and plan"
            )
        item = check_int(f"{name} state's item", initial_state.get("item"), min=0)
        saved = EpochClock()
        saved.restore(initial_state.get("epoch"), initial_state.get("first_epoch"))
        self._block = self.rows.start(saved.epoch, initial_state.get("block"))  # refuses an epoch not planned
        total = self.rows.packs(saved.epoch)
        if total is not None and item >= total + self.share.num_workers * self.share.run:
            raise ValueError(f"{name} state has item={item}, but this rank's epoch {saved.epoch} has {total} packs; "
                             "it is not a state of this plan")  # fmt: skip
        self.epoch_clock.restore(saved.epoch, saved.first)
        self._item = item

    def _document(self, index: int, more: bool) -> Mapping[str, np.ndarray]:
        """Document ``index``, read once for all its pieces: kept while pieces of it follow (``more``; they
        sit in consecutive packs, so at most one document is held)."""
        cached = self._cached if self._cached is not None and self._cached[0] == index else None
        arrays = self.rows.document(index) if cached is None else cached[1]
        if more:
            self._cached = (index, arrays)
        elif cached is not None:
            self._cached = None  # its last piece
        return arrays

    def plan(self, item: int, epoch: int | None = None) -> PackPlan:
        """This rank's pack ``item`` (all workers together) of the current block of ``epoch`` (default: current)."""
        epoch = self.epoch if epoch is None else int(epoch)
        return emit_plan(self.rows.pack(epoch, item), self.rows.capacity, self._document)

    def next(self) -> PackPlan:
        if self._count is None:
            self._count = self.rows.load(self.epoch, self._block) or 0
        while self._item >= self._count:  # past the block: the next block, else the next epoch of this iter()
            count = self.rows.load(self.epoch, self._block + 1)
            if count is not None:
                self._block += 1
            elif self.epoch_clock.advance(self.num_epochs):  # the items go on in one sequence across the epoch's end
                self._block = self.rows.start(self.epoch, None)
                count = self.rows.load(self.epoch, self._block) or 0
            else:
                raise StopIteration
            self._item, self._count, self._cached = self._item - self._count, count, None
        plan = self.plan(self._item)
        self._item = self.share.after(self._item)
        return plan

    def get_state(self) -> dict[str, Any]:
        return dict(zip(self.KEYS, (self.VERSION, self.config(), self.rows.identity, self.epoch, self.epoch_clock.first,
                                    self._item, self.rows.position()), strict=True))  # fmt: skip
