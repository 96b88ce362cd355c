"""``CPDataset``: the worker pipeline as an ``IterableDataset`` for ``StatefulDataLoader``.

::

    loader = CPDataLoader(CPDataset(docs, capacity=..., cp_size=2, cp_rank=r, layout="thd"),
                          num_workers=4, pin_memory=True)  # a StatefulDataLoader with batch_size=None

Workers split the batches with one rule (:class:`~cpdata.nodes.served.WorkerShare`: worker ``w`` of ``N``
keeps items ``w, w + N, ...``), so ``StatefulDataLoader``'s round-robin gives the ``num_workers=0`` order
for any ``N``. With ``plan=SchedulePlan()`` the schedule is planned once, here, and each worker serves its
share of this rank's packs, reading only their documents. Without one, every worker reads and packs the
whole stream (cheap: no token tensors) and shards only its own batches (the expensive part).

State: the worker's ``Loader.state_dict()`` plus its ``(worker_id, num_workers)``, applied at the next
``__iter__``; resume needs the same ``num_workers`` and configuration (``ValueError`` otherwise). Workers
never pin (``StatefulDataLoader(pin_memory=...)`` does) and die with the training process
(:func:`cpdata.nodes.worker_process.exit_with_parent`).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torchdata.nodes import BaseNode, Loader

from cpdata.nodes.epochs import check_epoch, set_graph_epoch
from cpdata.nodes.loader import GraphOptions, ResumableLoader, close_loader, delivered, rank_node, shard_graph
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
from cpdata.nodes.served import WorkerShare
from cpdata.nodes.state_version import VersionedState
from cpdata.nodes.worker_process import exit_with_parent

__all__ = ["CPDataset", "WorkerDataset", "silence_set_vital_warning"]


def silence_set_vital_warning() -> None:
    """Hide torchdata 0.11's ``torch.set_vital`` deprecation warning on every ``StatefulDataLoader(...)``
    (that message from ``torchdata.stateful_dataloader`` only). Called on import and by each cpdata
    dataset's constructor, so it also holds inside a ``warnings.catch_warnings`` block."""
    warnings.filterwarnings(
        "ignore", message="'set_vital' is deprecated", category=UserWarning, module=r"torchdata\.stateful_dataloader"
    )


silence_set_vital_warning()


class _WorkerItems(BaseNode[Any]):
    """The items of ``share`` (:class:`~cpdata.nodes.served.WorkerShare`); the rest are read and dropped."""

    SOURCE_KEY = "source"
    INDEX_KEY = "index"

    def __init__(self, source: BaseNode[Any], share: WorkerShare) -> None:
        super().__init__()
        self.source, self.share = source, share
        self._index = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state[self.SOURCE_KEY])
        self._index = 0 if initial_state is None else int(initial_state[self.INDEX_KEY])

    def next(self) -> Any:
        while True:
            item = next(self.source)
            index, self._index = self._index, self._index + 1
            if self.share.owns(index):
                return item

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict(), self.INDEX_KEY: self._index}


class WorkerDataset(VersionedState, IterableDataset):
    """A torchdata node graph per ``StatefulDataLoader`` worker (:meth:`_worker_node`), with exact,
    pending-state resume; ``delivery.prefetch`` batches are prepared ahead in a thread."""

    WORKER_KEY = "worker"
    LOADER_KEY = "loader"
    VERSION = 1

    def __init__(self, delivery: Delivery) -> None:
        super().__init__()
        check_records(delivery=delivery)
        if delivery.pin_memory is not None:
            raise TypeError(f"{type(self).__name__} does not pin: leave Delivery.pin_memory out and pass "
                            "pin_memory to StatefulDataLoader (CPDataLoader) instead")  # fmt: skip
        silence_set_vital_warning()
        self.prefetch = 0 if delivery.prefetch is None else delivery.prefetch
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
        """Start the next iteration at ``epoch`` in every node with epochs
        (:func:`~cpdata.nodes.epochs.set_graph_epoch`), as ``DistributedSampler.set_epoch``: fresh worker
        copies of the dataset would otherwise replay epoch 0 (``CPDataLoader`` calls it for you)."""
        self.start_epoch, self.epoch_asked = check_epoch(epoch), True
        if self._loader is not None:
            set_graph_epoch(self._loader.root, epoch)

    def _ensure_loader(self) -> Loader:
        info = get_worker_info()
        if info is not None:
            exit_with_parent(deathsig=self._parent_main_thread)  # no orphan outlives a killed trainer
        worker = (0, 1) if info is None else (info.id, info.num_workers)
        if self._loader is None or self._worker != worker:
            if self._loader is not None:
                close_loader(self._loader)
            node = self._worker_node(*worker)
            if self.start_epoch is not None:
                set_graph_epoch(node, self.start_epoch)
            node = delivered(node, Delivery(prefetch=self.prefetch, pin_memory=False))  # workers never pin
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
        return {**self.state_header(), self.WORKER_KEY: list(self._worker),
                self.LOADER_KEY: loader.state_dict()}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_saved(state_dict)
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

    Takes :func:`cpdata.nodes.loader.build_node`'s keywords; ``Delivery.prefetch`` defaults to 0 here
    (the DataLoader's ``prefetch_factor`` already queues batches) and pinning belongs to the DataLoader.
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
        super().__init__(delivery)
        self.source = source
        self.cp_rank = cp_rank
        self.delivery = delivery
        self.options = GraphOptions(capacity=capacity, cp_size=cp_size, layout=layout, tile=tile,
                                    batch_size=batch_size, qkv_format=qkv_format,
                                    padding_token_id=padding_token_id, plan=plan, data=data)  # fmt: skip
        # Validate the configuration now, in the main process, not in every worker.
        graph = shard_graph(source, self.options)
        rank_node(graph, self.options, cp_rank, delivery)
        # Planned once here; workers receive this rank's rows with the dataset instead of planning again.
        self._scheduled = graph.source if isinstance(plan, SchedulePlan) else None

    def _worker_node(self, worker_id: int, num_workers: int) -> BaseNode:
        node: BaseNode
        if self._scheduled is not None:  # this worker's packs only: reads only their documents
            node = shard_graph(self.source, self.options, packs=self._scheduled.with_worker((worker_id, num_workers)))
        else:
            node = _WorkerItems(shard_graph(self.source, self.options), WorkerShare(worker_id, num_workers))
        return rank_node(node, self.options, self.cp_rank, self.delivery)
