"""``CPDataset``: the worker pipeline as an ``IterableDataset`` for ``StatefulDataLoader``.

::

    loader = CPDataLoader(CPDataset(docs, capacity=..., cp_size=2, cp_rank=r, layout="thd"),
                          num_workers=4, pin_memory=True)  # a StatefulDataLoader with batch_size=None

With ``plan=SchedulePlan()`` (a source with known lengths, see
:class:`~cpdata.nodes.scheduled.ScheduledPacks`) the global schedule is
planned once, here, and each worker serves its share of this rank's packs
(:class:`~cpdata.nodes.served.ServedPacks`), reading only their documents:
worker CPU per pack stays flat in ``N``.

Without a schedule, worker ``w`` of ``N`` runs the whole DP-rank stream through the packer
(Documents -> Pack -> Collate, all cheap per pack: no token tensors are built)
and keeps batches ``w, w+N, w+2N, ...``; only those are sharded (the
expensive part). ``StatefulDataLoader`` takes workers round-robin, so the
global batch order is the ``num_workers=0`` order for any ``N``, every CP rank
of a DP group receives the same packs in the same order, and a worker's state
is just its own graph's. Cost: every worker reads and packs the whole stream,
so that part (about a quarter of a batch's worker time at 32K tokens, ~0.4 ms
per pack here) does not parallelize: N workers top out near one batch per
pack time (over 2000 batches/s at 32K tokens), far above a training step's
needs. Memory: one packer window per worker.

State: ``state_dict()`` is the worker's ``Loader.state_dict()`` plus its
``(worker_id, num_workers)``; ``load_state_dict`` keeps it pending until the
next ``__iter__``, which applies it eagerly ("pending resume state"). Resume
needs the same ``num_workers`` and configuration (``ValueError`` otherwise).
Pinning belongs to ``StatefulDataLoader(pin_memory=...)`` in the main process;
workers never pin. Workers die with the training process
(:func:`cpdata.nodes.orphans.exit_with_parent`), even when stuck in a slow read.
:class:`cpdata.nodes.dataloader.CPDataLoader` is the ``StatefulDataLoader`` to use:
``batch_size=None`` and a state from another ``num_workers`` (0 included) is
refused with ``ValueError`` on ``load_state_dict``, and its workers keep
their freed heap (:func:`cpdata.nodes.heap.keep_heap`; with a plain
``StatefulDataLoader`` pass ``worker_init_fn=cpdata.keep_heap``).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torchdata.nodes import BaseNode, Loader, Prefetcher

from cpdata.errors import check_int
from cpdata.nodes.epochs import check_epoch, set_graph_epoch
from cpdata.nodes.loader import GraphOptions, ResumableLoader, close_loader, shard_graph
from cpdata.nodes.options import (
    ENTRY_KEYWORDS,
    DataPolicy,
    Delivery,
    PlanChoice,
    SchedulePlan,
    StreamPlan,
    check_records,
    refuse_keywords,
)
from cpdata.nodes.orphans import exit_with_parent
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.state_version import check_state_version

__all__ = ["CPDataset", "WorkerDataset", "silence_set_vital_warning"]


def silence_set_vital_warning() -> None:
    """Hide the one deprecation warning torchdata 0.11 emits on every ``StatefulDataLoader(...)``.

    Its constructor calls ``torch.set_vital``, which torch 2.13 deprecates with
    a ``UserWarning`` the user can do nothing about. This filters exactly that
    message raised from ``torchdata.stateful_dataloader``; every other warning
    is untouched. Called on import and by each cpdata dataset's constructor
    (idempotent), so it also holds inside a ``warnings.catch_warnings`` block
    that was entered before the dataset was built.
    """
    warnings.filterwarnings(
        "ignore", message="'set_vital' is deprecated", category=UserWarning, module=r"torchdata\.stateful_dataloader"
    )


silence_set_vital_warning()


class _EveryNth(BaseNode[Any]):
    """Items ``offset, offset + stride, ...`` of the source; the rest are read and dropped."""

    SOURCE_KEY = "source"
    INDEX_KEY = "index"

    def __init__(self, source: BaseNode[Any], *, offset: int, stride: int) -> None:
        super().__init__()
        self.source, self.offset, self.stride = source, offset, stride
        self._index = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state[self.SOURCE_KEY])
        self._index = 0 if initial_state is None else int(initial_state[self.INDEX_KEY])

    def next(self) -> Any:
        while True:
            item = next(self.source)
            index, self._index = self._index, self._index + 1
            if index % self.stride == self.offset:
                return item

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.INDEX_KEY: self._index}


class WorkerDataset(IterableDataset):
    """A torchdata node graph per ``StatefulDataLoader`` worker, with exact, pending-state resume.

    Subclasses implement :meth:`_worker_node`: the graph of worker
    ``worker_id`` of ``num_workers`` (every worker keeps its own share, in
    the 0-worker order when the DataLoader interleaves them round-robin).
    ``prefetch`` batches are prepared ahead in a thread (0 here by default: the
    DataLoader's ``prefetch_factor`` already queues batches per worker).
    """

    WORKER_KEY = "worker"
    LOADER_KEY = "loader"
    VERSION_KEY = "version"
    VERSION = 1

    def __init__(self, *, prefetch: int = 0) -> None:
        super().__init__()
        check_int("prefetch", prefetch, min=0)
        silence_set_vital_warning()
        self.prefetch = prefetch
        self._loader: Loader | None = None
        self._worker: tuple[int, int] | None = None
        self._pending: dict[str, Any] | None = None
        self._parent_main_thread: bool | None = None  # set when pickled for spawn/forkserver workers
        self.start_epoch: int | None = None
        """The epoch the next iteration starts (:meth:`set_epoch`; None: the graph counts its own)."""
        self.epoch_asked = False  # set_epoch since the loader last began an epoch (cpdata.nodes.dataloader)

    def _worker_node(self, worker_id: int, num_workers: int) -> BaseNode:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (a shuffled order: that of ``(seed, epoch)``; a mix's plan:
        that epoch's packs): every node with epochs in the graph is told (:func:`~cpdata.nodes.epochs.set_graph_epoch`).

        Call it before every epoch when ``StatefulDataLoader`` workers are not
        persistent (each epoch then starts from a fresh copy of this dataset,
        which would otherwise read epoch 0's order again), as with
        ``DistributedSampler.set_epoch``. A process that keeps its graph
        (``num_workers=0``, ``persistent_workers=True``) counts epochs itself.
        """
        self.start_epoch, self.epoch_asked = check_epoch(epoch), True
        if self._loader is not None:
            set_graph_epoch(self._loader.root, epoch)

    @staticmethod
    def _current_worker() -> tuple[int, int]:
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _ensure_loader(self) -> Loader:
        if get_worker_info() is not None:
            exit_with_parent(deathsig=self._parent_main_thread)  # no orphan outlives a killed trainer
        worker = self._current_worker()
        if self._loader is None or self._worker != worker:
            if self._loader is not None:
                close_loader(self._loader)
            node = self._worker_node(*worker)
            if self.start_epoch is not None:
                set_graph_epoch(node, self.start_epoch)
            if self.prefetch:
                node = Prefetcher(node, prefetch_factor=self.prefetch)
            self._loader = ResumableLoader(node, restart_on_stop_iteration=False)
            self._worker = worker
        return self._loader

    def __iter__(self):
        loader = self._ensure_loader()
        if self._pending is not None:
            state, self._pending = self._pending, None
            saved = tuple(state[self.WORKER_KEY])
            if saved != self._worker:
                raise ValueError(
                    f"{type(self).__name__} state was saved by worker {saved[0]} of {saved[1]}, restoring into worker "
                    f"{self._worker[0]} of {self._worker[1]}; resume with the same num_workers"
                )
            loader.load_state_dict(state[self.LOADER_KEY])
        return iter(loader)

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return self._pending
        loader = self._ensure_loader()
        return {
            self.VERSION_KEY: self.VERSION,
            self.WORKER_KEY: list(self._worker),
            self.LOADER_KEY: loader.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state_version(type(self).__name__, state_dict, self.VERSION_KEY, self.VERSION)
        self._pending = state_dict

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loader"] = state["_worker"] = None  # threads do not pickle; each process builds its own
        state["_parent_main_thread"] = threading.current_thread() is threading.main_thread()
        return state

    def close(self) -> None:
        """Stop this process's prefetch thread, if any."""
        if self._loader is not None:
            close_loader(self._loader)


class CPDataset(WorkerDataset):
    """One CP rank's batches (:class:`~cpdata.worker.batch.ShardedBatch`) for ``StatefulDataLoader(batch_size=None)``.

    Takes :func:`cpdata.nodes.loader.build_node`'s keyword arguments; of :class:`~cpdata.nodes.options.Delivery`,
    ``prefetch`` defaults to 0 here (the DataLoader's own ``prefetch_factor`` already queues batches per
    worker) and ``pin_memory`` belongs to the DataLoader. ``Delivery(kv_exchange=True)``: the workers build
    each batch's K/V exchange plan too (``batch.layout.kv_exchange``).
    """

    def __init__(
        self,
        source: Any,
        *,
        capacity: int,
        cp_size: int,
        cp_rank: int,
        layout: str,
        tile: int | None = None,
        batch_size: int = 1,
        qkv_format: str = "bshd",
        padding_token_id: int = 0,
        plan: PlanChoice = StreamPlan(),
        data: DataPolicy = DataPolicy(),
        delivery: Delivery = Delivery(),
        **removed: Any,
    ) -> None:
        refuse_keywords("CPDataset", removed, ENTRY_KEYWORDS)
        check_records(delivery=delivery)
        if delivery.pin_memory is not None:
            raise TypeError("CPDataset does not pin: leave Delivery.pin_memory out and pass pin_memory to "
                            "StatefulDataLoader (CPDataLoader) instead")  # fmt: skip
        super().__init__(prefetch=0 if delivery.prefetch is None else delivery.prefetch)
        self.source = source
        self.cp_rank = cp_rank
        self.delivery = delivery
        self.options = GraphOptions(capacity=capacity, cp_size=cp_size, layout=layout, tile=tile,
                                    batch_size=batch_size, qkv_format=qkv_format,
                                    padding_token_id=padding_token_id, plan=plan, data=data)  # fmt: skip
        # Validate the configuration now, in the main process, not in every worker.
        graph = shard_graph(source, self.options)
        self._shard(graph)
        # Planned once here; workers receive this rank's rows with the dataset instead of planning again.
        self._scheduled = graph.source if isinstance(plan, SchedulePlan) else None

    def _shard(self, node: BaseNode) -> ShardForRank:
        return ShardForRank(node, cp_size=self.options.cp_size, cp_rank=self.cp_rank, layout=self.options.layout,
                            block_size=self.delivery.block_size, kv_exchange=self.delivery.kv_exchange)  # fmt: skip

    def _worker_node(self, worker_id: int, num_workers: int) -> BaseNode:
        node: BaseNode
        if self._scheduled is not None:  # this worker's packs only: reads only their documents
            node = shard_graph(self.source, self.options, worker=(worker_id, num_workers), packs=self._scheduled)
        else:
            node = _EveryNth(shard_graph(self.source, self.options), offset=worker_id, stride=num_workers)
        return self._shard(node)
