"""``PrecomputedDataset``: a precomputed plan served by ``StatefulDataLoader`` workers, O(1) resume.

Batch ``j`` of a DP rank is packs ``j·B .. j·B + B − 1`` of its stream; worker ``w`` of ``N`` builds batches
``w, w + N, ...`` and reads only those packs' documents, so no work is repeated across workers (unlike
:class:`~cpdata.CPDataset`). Epochs and resume as for :class:`~cpdata.nodes.dataset.WorkerDataset`.
"""

from __future__ import annotations

import os
from typing import Any

from torchdata.nodes import BaseNode

from cpdata.nodes.collate import Collate
from cpdata.nodes.dataset import WorkerDataset
from cpdata.nodes.epochs import check_epoch
from cpdata.nodes.options import DataPolicy, Delivery, refuse_keywords
from cpdata.nodes.shard import ShardForRank
from cpdata.offline.reader import PrecomputedPacks
from cpdata.worker.collate import check_padding_token_id

__all__ = ["PrecomputedDataset"]


class PrecomputedDataset(WorkerDataset):
    """One CP rank's batches from a plan directory, for ``StatefulDataLoader(batch_size=None, num_workers=N)``.

    Plan, documents and ``data`` as for :class:`~cpdata.offline.reader.PrecomputedPacks` (``cp_size``
    defaults to the plan's); ``batch_size``, ``qkv_format`` and ``padding_token_id`` as for
    :class:`~cpdata.nodes.collate.Collate`; ``delivery`` as for :class:`~cpdata.CPDataset`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        documents: Any,
        *,
        cp_rank: int,
        cp_size: int | None = None,
        layout: str | None = None,
        batch_size: int = 1,
        qkv_format: str = "bshd",
        padding_token_id: int = 0,
        data: DataPolicy = DataPolicy(),
        delivery: Delivery = Delivery(),
        **removed: Any,
    ) -> None:
        accepted = ("cp_rank", "cp_size", "layout", "batch_size", "qkv_format", "padding_token_id", "data", "delivery")
        refuse_keywords("PrecomputedDataset", removed, accepted)
        super().__init__(delivery)
        check_padding_token_id(padding_token_id, data.vocab_size)  # as CPDataset: pads must be embeddable
        self.plans = PrecomputedPacks(path, documents, cp_size=cp_size, layout=layout, data=data)
        self.cp_rank = cp_rank
        self.cp_size = int(self.plans.store.config["cp_size"])
        self.layout = str(self.plans.store.config["layout"])
        self.collate_kwargs = {"batch_size": batch_size, "qkv_format": qkv_format, "padding_token_id": padding_token_id}
        self.delivery = delivery
        self._worker_node(0, 1)  # validate the configuration in the main process

    def __len__(self) -> int:
        """Batches of epoch 0 (or the epoch :meth:`set_epoch` named) for this DP rank (the last may hold
        fewer than ``batch_size`` packs; a mix's epochs differ)."""
        b = self.collate_kwargs["batch_size"]
        return -(-self.plans.rows.packs(self.start_epoch or 0) // b)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (a mix's plan: that epoch's packs; others: the same packs);
        an epoch the plan does not hold is refused here."""
        self.plans.rows.check_epoch(check_epoch(epoch))
        super().set_epoch(epoch)

    def _worker_node(self, worker_id: int, num_workers: int) -> BaseNode:
        packs = self.plans.with_worker((worker_id, num_workers), batch=self.collate_kwargs["batch_size"])
        return ShardForRank(Collate(packs, **self.collate_kwargs), cp_size=self.cp_size, cp_rank=self.cp_rank,
                            layout=self.layout, block_size=self.delivery.block_size,
                            kv_exchange=self.delivery.kv_exchange)  # fmt: skip
