"""``CPDataLoader``: torchdata's ``StatefulDataLoader`` for a :class:`~cpdata.nodes.dataset.CPDataset`.

Two differences about not failing late or obscurely, and two about speed:

- ``batch_size=None`` by default (a :class:`~cpdata.worker.batch.ShardedBatch` is
  already a batch); any other value is refused.
- ``load_state_dict`` refuses a state saved with another ``num_workers`` with
  a ``ValueError`` naming both counts. torchdata 0.11 raises a bare
  ``AssertionError`` between 0 and N workers (a ``KeyError`` under
  ``python -O``), and each worker's packer position is its own, so a state
  cannot move to another worker count.
- a worker hands a :class:`~cpdata.worker.batch.ShardedBatch` over as it is (the
  default ``collate_fn``, :func:`hand_over`) where ``batch_size=None``'s
  default, torch's ``default_convert``, would copy it and read every key:
  that builds the batch's host views in the worker (~1-3 us per key), which
  only the receiver needs. Any other item still goes through
  ``default_convert``; a ``collate_fn`` given is used as it is.
- its worker processes keep their freed heap (:func:`cpdata.nodes.heap.keep_heap`,
  run before a ``worker_init_fn`` given): without it glibc hands the batch
  memory back to the kernel and faults it in again every pack. Measured in a
  worker, over the faults of the shared-memory handoff that no allocator
  setting avoids: at 128K-token batches, cp 4, 722-727 faults and 2.5 ms of
  system time per batch against 1,670-1,947 and 4.2 ms; at 32K, 175-180
  against 181-192 faults, within the noise in time.
  ``keep_heap=False`` leaves malloc as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data._utils.collate import default_convert
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.dataset import silence_set_vital_warning
from cpdata.nodes.heap import keeping_heap
from cpdata.worker.batch import ShardedBatch

__all__ = ["CPDataLoader", "hand_over", "saved_num_workers"]


def hand_over(item: Any) -> Any:
    """A :class:`ShardedBatch` unchanged (it pickles as its one buffer; views are built where read), any
    other item through torch's ``default_convert``."""
    return item if type(item) is ShardedBatch else default_convert(item)


def saved_num_workers(state: Mapping[str, Any]) -> int | None:
    """The ``num_workers`` a ``StatefulDataLoader`` state was saved with, or None if the layout is unknown."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        main = snapshot.get("_main_snapshot")
        if isinstance(main, Mapping) and isinstance(main.get("_num_workers"), int):
            return int(main["_num_workers"])
        workers = snapshot.get("_worker_snapshots")
        return len(workers) if isinstance(workers, Mapping) else None
    if "_num_yielded" in state:
        return 0
    return None


class CPDataLoader(StatefulDataLoader):
    """``StatefulDataLoader(dataset, batch_size=None, ...)`` that refuses a state from another worker count.

    Takes ``StatefulDataLoader``'s arguments (``num_workers``,
    ``pin_memory``, ``multiprocessing_context``, ``snapshot_every_n_steps``,
    ...); ``batch_size`` must stay None. ``keep_heap``: the workers keep their
    freed heap (see the module docstring; no effect with ``num_workers=0``).
    """

    def __init__(self, dataset: Any, *, batch_size: None = None, keep_heap: bool = True, **kwargs: Any) -> None:
        if batch_size is not None:
            raise ValueError(
                f"CPDataLoader yields the dataset's batches as they are; got batch_size={batch_size!r}, "
                "leave it None and set batch_size on the CPDataset (packs per batch)"
            )
        silence_set_vital_warning()
        kwargs.setdefault("collate_fn", hand_over)
        if not isinstance(keep_heap, bool):
            raise TypeError(f"keep_heap must be True or False, got {type(keep_heap).__name__} {keep_heap!r}")
        if keep_heap:
            kwargs["worker_init_fn"] = keeping_heap(kwargs.get("worker_init_fn"))
        super().__init__(dataset, batch_size=None, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_num_workers(state_dict) if state_dict else None
        if saved is not None and saved != self.num_workers:
            raise ValueError(
                f"this loader state was saved with num_workers={saved}, this CPDataLoader has "
                f"num_workers={self.num_workers}; each worker's packer position is its own: resume with "
                f"num_workers={saved}"
            )
        super().load_state_dict(state_dict)
