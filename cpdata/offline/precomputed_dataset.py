"""``PrecomputedDataset``: a precomputed plan served by ``StatefulDataLoader`` workers, O(1) resume.

::

    ds = PrecomputedDataset("plan/", open_dataset("tokens/"), cp_rank=r, cp_size=4, batch_size=2)
    loader = CPDataLoader(ds, num_workers=4, pin_memory=True)  # a StatefulDataLoader(ds, batch_size=None, ...)

Batch ``j`` of a DP rank is packs ``j·B .. j·B + B − 1`` of its stream
(:class:`~cpdata.offline.reader.PrecomputedPacks`); worker ``w`` of ``N`` builds
batches ``w, w + N, ...`` and reads only those packs' documents. The
DataLoader takes workers round-robin, so the batches arrive in the
``num_workers=0`` order for any ``N``, and unlike :class:`~cpdata.CPDataset`
(where every worker packs the whole stream) no work is repeated across
workers. A worker's state is the index of its next pack plus the plan's
digest: a restore seeks in O(1) at any point of the plan.

Epochs: a mix's plan holds its epochs' own packs (see
:mod:`cpdata.offline.reader`); each worker counts epochs per ``iter()``, and
:meth:`PrecomputedDataset.set_epoch` starts the next one at a given epoch (call
it every epoch when workers are not persistent, as ``DistributedSampler.set_epoch``).
An epoch the plan does not hold is refused with ``ValueError``.
"""

from __future__ import annotations

import os
from typing import Any

from torchdata.nodes import BaseNode

from cpdata.nodes.collate import Collate
from cpdata.nodes.dataset import WorkerDataset
from cpdata.nodes.loader import _graph
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.state_version import check_saved_config, check_state_version
from cpdata.offline.reader import EpochCount, PrecomputedPacks
from cpdata.worker.plan import PackPlan

__all__ = ["PrecomputedDataset"]


class _WorkerPacks(BaseNode[PackPlan]):
    """The packs of batches ``offset, offset + stride, ...`` (``batch_size`` packs each), by random access."""

    VERSION = 2  # 2: the epoch
    VERSION_KEY = "version"
    CONFIG_KEY = "config"
    EPOCH_KEY = "epoch"
    POSITION_KEY = "position"

    def __init__(self, plans: PrecomputedPacks, *, offset: int, stride: int, batch_size: int,
                 epoch: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.plans, self.offset, self.stride, self.batch_size = plans, offset, stride, batch_size
        self._position, self._clock = 0, EpochCount(epoch)

    def _config(self) -> dict[str, Any]:
        return {"plan": self.plans.store.digest, "dp": self.plans._dp(), "worker": [self.offset, self.stride],
                "batch_size": self.batch_size}  # fmt: skip

    def _pack(self, position: int) -> int:
        batch = self.offset + (position // self.batch_size) * self.stride
        return batch * self.batch_size + position % self.batch_size

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._position = 0
        if initial_state is not None:
            check_state_version("PrecomputedDataset worker", initial_state, self.VERSION_KEY, self.VERSION)
            check_saved_config("PrecomputedDataset worker", initial_state[self.CONFIG_KEY], self._config())
            self._position = int(initial_state[self.POSITION_KEY])
        self.plans.check_epoch(self._clock.start(None if initial_state is None else initial_state[self.EPOCH_KEY]))

    def next(self) -> PackPlan:
        pack = self._pack(self._position)
        if pack >= self.plans.packs_in(self._clock.epoch):
            raise StopIteration
        self._position += 1
        return self.plans.plan(pack, self._clock.epoch)

    def get_state(self) -> dict[str, Any]:
        return {self.VERSION_KEY: self.VERSION, self.CONFIG_KEY: self._config(), self.EPOCH_KEY: self._clock.epoch,
                self.POSITION_KEY: self._position}  # fmt: skip


class PrecomputedDataset(WorkerDataset):
    """One CP rank's batches from a plan directory, for ``StatefulDataLoader(batch_size=None, num_workers=N)``.

    Args:
        path, documents: the plan directory and the documents it was computed
            over (as for :class:`~cpdata.offline.reader.PrecomputedPacks`; a
            ``datasets.Dataset`` or token store works).
        cp_rank: this rank; ``cp_size`` (default: the plan's) and ``layout``
            are checked against the plan.
        dp_rank, dp_size, vocab_size, labels_alignment: as for ``PrecomputedPacks``
            (``labels_alignment`` defaults to what the documents declare, e.g. a token
            store written by ``cpdata tokenize --assistant-only``).
        batch_size, qkv_format, padding_token_id: as for :class:`~cpdata.nodes.collate.Collate`.
        prefetch: batches prepared ahead per worker in a thread (default 0).
        block_size, kv_exchange: as for :class:`~cpdata.nodes.shard.ShardForRank` (and ``CPDataset``):
            batches prepared at once, and each batch's K/V exchange plan (``batch.layout.kv_exchange``,
            which the ``"cpdata"`` attention and :func:`cpdata.exchange_tokens` use instead of an all-gather).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        documents: Any,
        *,
        cp_rank: int,
        cp_size: int | None = None,
        layout: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
        labels_alignment: str | None = None,
        batch_size: int = 1,
        qkv_format: str = "bshd",
        padding_token_id: int = 0,
        prefetch: int = 0,
        block_size: int | None = None,
        kv_exchange: bool = False,
    ) -> None:
        super().__init__(prefetch=prefetch)
        self.plans = PrecomputedPacks(path, documents, cp_size=cp_size, layout=layout, dp_rank=dp_rank,
                                      dp_size=dp_size, vocab_size=vocab_size,
                                      labels_alignment=labels_alignment)  # fmt: skip
        self.cp_rank = cp_rank
        self.cp_size = int(self.plans.store.config["cp_size"])
        self.layout = str(self.plans.store.config["layout"])
        self.collate_kwargs = {"batch_size": batch_size, "qkv_format": qkv_format, "padding_token_id": padding_token_id}
        self.block_size, self.kv_exchange = block_size, kv_exchange
        self._worker_node(0, 1)  # validate the configuration in the main process

    def __len__(self) -> int:
        """Batches of epoch 0 (or the epoch :meth:`set_epoch` named) for this DP rank (the last may hold
        fewer than ``batch_size`` packs; a mix's epochs differ)."""
        b = self.collate_kwargs["batch_size"]
        return -(-self.plans.packs_in(getattr(self, "_start_epoch", None) or 0) // b)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (a mix's plan: that epoch's packs; others: the same packs)."""
        EpochCount().set(epoch)  # refuses a non-int or negative epoch
        self.plans.check_epoch(epoch)
        self._start_epoch, self._epoch_asked = epoch, True  # (a CPDataLoader starts it, counting on)
        if self._loader is not None:
            for node in _graph(self._loader.root):
                if isinstance(node, _WorkerPacks):
                    node._clock.set(epoch)

    def _worker_node(self, worker_id: int, num_workers: int) -> BaseNode:
        packs = _WorkerPacks(self.plans, offset=worker_id, stride=num_workers,
                             batch_size=self.collate_kwargs["batch_size"],
                             epoch=getattr(self, "_start_epoch", None))  # fmt: skip
        return ShardForRank(Collate(packs, **self.collate_kwargs), cp_size=self.cp_size, cp_rank=self.cp_rank,
                            layout=self.layout, block_size=self.block_size, kv_exchange=self.kv_exchange)  # fmt: skip
