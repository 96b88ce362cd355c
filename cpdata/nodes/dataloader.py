"""``CPDataLoader``: torchdata's ``StatefulDataLoader`` for a :class:`~cpdata.nodes.dataset.CPDataset`.

Differences from ``StatefulDataLoader``:

- ``batch_size=None``, always (a :class:`~cpdata.worker.batch.ShardedBatch` is already a batch);
- ``load_state_dict`` refuses a state saved with another ``num_workers`` with a ``ValueError`` naming both
  (torchdata raises a bare ``AssertionError``; each worker's packer position is its own);
- the default ``collate_fn`` (:func:`hand_over`) passes a ``ShardedBatch`` on as it is, where
  ``default_convert`` would build its host views in the worker;
- its workers keep their freed heap (:func:`cpdata.nodes.worker_process.keep_heap`; ``keep_heap=False``
  opts out).

Epochs: every ``iter()`` that does not resume a loaded state starts the next epoch and tells the dataset
(``CPDataset.set_epoch``) before its workers are made, so a shuffled order advances alike for
``num_workers=0``, fresh and persistent workers. ``dataset.set_epoch(e)`` before an ``iter()`` picks the
epoch (live persistent workers, which never see it, refuse any but the next). The count is saved as
``"cpdata_epoch"``: after ``load_state_dict`` the ``iter()`` resumes the saved epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data._utils.collate import default_convert
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.errors import check_bool
from cpdata.nodes.dataset import WorkerDataset, silence_set_vital_warning
from cpdata.nodes.epochs import EpochClock, check_epoch
from cpdata.nodes.worker_process import keeping_heap
from cpdata.worker.batch import ShardedBatch

__all__ = ["CPDataLoader", "hand_over", "saved_num_workers"]


def hand_over(item: Any) -> Any:
    """A :class:`ShardedBatch` unchanged (it pickles as its one buffer), any other item ``default_convert``ed."""
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
    return 0 if "_num_yielded" in state else None  # a num_workers=0 state


class CPDataLoader(StatefulDataLoader):
    """``StatefulDataLoader(dataset, batch_size=None, **kwargs)`` (see the module docstring)."""

    def __init__(self, dataset: Any, *, batch_size: None = None, keep_heap: bool = True, **kwargs: Any) -> None:
        if batch_size is not None:
            raise ValueError(
                f"CPDataLoader yields the dataset's batches as they are; got batch_size={batch_size!r}, "
                "leave it None and set batch_size on the CPDataset (packs per batch)"
            )
        silence_set_vital_warning()
        kwargs.setdefault("collate_fn", hand_over)
        check_bool("keep_heap", keep_heap)
        if keep_heap:
            kwargs["worker_init_fn"] = keeping_heap(kwargs.get("worker_init_fn"))
        super().__init__(dataset, batch_size=None, **kwargs)
        self.epoch_clock = EpochClock()  # the epoch of the iteration under way
        self._resume_epoch: int | None = None  # a loaded state's, until its iter()

    EPOCH_KEY = "cpdata_epoch"

    def _begin_epoch(self) -> None:
        """Count the next epoch and tell the dataset, before an ``iter()`` makes (or reuses) the workers."""
        ds = self.dataset
        if not isinstance(ds, WorkerDataset):
            return
        following = self.epoch_clock.epoch + 1 if self.epoch_clock.started else 0
        asked = ds.start_epoch if ds.epoch_asked else None
        live = self.persistent_workers and self.num_workers > 0 and self._iterator is not None
        if asked is not None and live and asked != following:
            raise ValueError(
                f"set_epoch({asked}) cannot reach persistent workers, which go on to epoch {following}; build the "
                "CPDataLoader with persistent_workers=False to choose epochs, or let it count them"
            )
        if asked is not None:
            self.epoch_clock.set(asked)
        ds.set_epoch(self.epoch_clock.start())
        ds.epoch_asked = False

    def __iter__(self):  # type: ignore[no-untyped-def]
        if self._resume_epoch is not None:  # the loaded state's epoch resumes; counting goes on from it
            self.epoch_clock.restore(self._resume_epoch)
            self._resume_epoch = None
        elif not self._initial_iter_for_state_dict:  # (state_dict() before the first iter() began it)
            self._begin_epoch()
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        if self._iterator is None and self._resume_epoch is None and self.next_iter_state is None:
            self._begin_epoch()  # its workers are made now: they must start the epoch counted
        state = dict(super().state_dict())
        state[self.EPOCH_KEY] = self.epoch_clock.epoch if self._resume_epoch is None else self._resume_epoch
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        epoch = state_dict.pop(self.EPOCH_KEY, None)
        if epoch is not None:
            check_epoch(epoch, f"the CPDataLoader state's {self.EPOCH_KEY}")
        saved = saved_num_workers(state_dict) if state_dict else None
        if saved is not None and saved != self.num_workers:
            raise ValueError(
                f"this loader state was saved with num_workers={saved}, this CPDataLoader has "
                f"num_workers={self.num_workers}; each worker's packer position is its own: resume with "
                f"num_workers={saved}"
            )
        super().load_state_dict(state_dict)
        self._resume_epoch = epoch
