"""``PrecomputedPacks``, ``PrecomputedDataset``: a precomputed plan directory served as ``PackPlan``s, batches.

It replaces ``Documents -> Pack`` (``PrecomputedPacks -> Collate -> ShardForRank``): its rows are the plan's
memory-mapped arrays, served by :class:`~cpdata.nodes.served.ServedPacks` (O(1) restore anywhere). A plan for
other documents (their identity, or only their lengths for a plan from a lengths file), another ``cp_size``,
``layout`` or labels alignment, or failing a checksum is refused; the manifest and the documents are checked
again at every epoch start and restore. How DP ranks split a plan and which epochs it holds: docs/usage.md.

:class:`PrecomputedDataset` serves it through ``StatefulDataLoader`` workers: batch ``j`` of a DP rank is
packs ``j·B .. j·B + B − 1`` of its stream; worker ``w`` of ``N`` builds batches ``w, w + N, ...`` and reads
only those packs' documents (unlike :class:`~cpdata.CPDataset`); epochs and resume as for
:class:`~cpdata.nodes.dataset.WorkerDataset`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.dataset import WorkerDataset
from cpdata.nodes.epochs import check_epoch
from cpdata.nodes.loader import GraphOptions, rank_node, shard_graph
from cpdata.nodes.options import DataPolicy, Delivery, check_records, refuse_keywords
from cpdata.nodes.served import PackRows, PlanRows, ServedPacks
from cpdata.nodes.source_kinds import read_document
from cpdata.offline.store import PackStore, read_store, reopen_store
from cpdata.schedule.records import schedule_pack
from cpdata.sources.fingerprint import check_source_unchanged, lengths_sha256, source_identity
from cpdata.sources.open import as_source
from cpdata.sources.protocol import Listed, NamesSources, declared_labels, stated_lengths
from cpdata.worker.targets import LabelsAlignment, declared_alignment

__all__ = ["PrecomputedDataset", "PrecomputedPacks", "StoreRows"]


def _check_documents(store: PackStore, documents: Any) -> None:
    """Refuse documents other than those the plan was precomputed from: their identity (the source's
    fingerprint), or only their lengths for a plan precomputed from a lengths file."""
    source = store.manifest["input"]
    if source["kind"] == "lengths":
        lengths = stated_lengths(documents)
        digest = None if lengths is None else lengths_sha256(lengths)
        if digest != source["lengths_sha256"]:
            n = "?" if lengths is None else len(lengths)
            raise ValueError(
                f"plan {store.path} was precomputed from the lengths file {source['name']!r} "
                f"({source['documents']} documents, lengths sha256 {source['lengths_sha256'][:16]}…) but the "
                f"documents given ({n} documents, lengths sha256 {str(digest)[:16]}…) have other lengths; "
                "serve it with the tokenized dataset those lengths were taken from, or re-run `cpdata precompute`"
            )
        return
    identity = source_identity(documents)
    if identity != source["identity"]:
        raise ValueError(
            f"plan {store.path} was precomputed from {source['name']!r} (identity {source['identity'][:40]}…), "
            f"but the documents given hash to {identity[:40]}…; pass the same dataset, or re-run "
            "`cpdata precompute` on this one"
        )


def _check_planned(store: PackStore, name: str, planned: object, asked: object, *, required: bool = False) -> None:
    """Refuse a pipeline asking for another ``name`` than the plan was precomputed for (``asked`` None: any,
    unless ``required``)."""
    if planned is None or planned == asked or (asked is None and not required):
        return
    raise ValueError(
        f"plan {store.path} was precomputed for {name}={planned!r}, the pipeline asks for {name}={asked!r}; "
        f"run `cpdata precompute ... --{name.replace('_', '-')} {asked}` or use {name}={planned!r}"
    )


def _planned_epochs(store: PackStore) -> np.ndarray | None:
    """int64 ``[epochs + 1]``: the first pack of each epoch of a mix's plan; None for a plan served every epoch."""
    if "mix" not in store.manifest["input"] or "schedule" in store.manifest:
        return None
    return np.asarray(store.manifest["epochs"]["first_pack"], dtype=np.int64)


class StoreRows(PlanRows):
    """This DP rank's packs of a plan directory, one block per epoch, read from the memory-mapped columns."""

    def __init__(self, store: PackStore, documents: Any, data: DataPolicy,
                 labels_alignment: LabelsAlignment | None) -> None:  # fmt: skip
        self.store, self.source, self.data, self.labels_alignment = store, documents, data, labels_alignment
        self.capacity, self.config = int(store.config["capacity"]), {"dp": [data.dp_rank, data.dp_size]}
        self.identity = f"{store.digest}|{source_identity(documents)}"  # the plan, and the documents it serves
        self.epochs = _planned_epochs(store)
        self.first_document = np.asarray(documents.epoch_starts if isinstance(documents, Listed) else [0], dtype=np.int64)
        """Where each epoch of a mix's listing begins: a piece's index counts within its epoch, as online."""
        self.schedule = store.manifest.get("schedule")
        _check_planned(store, "dp_size", None if self.schedule is None else self.schedule["dp_size"], data.dp_size)

    def check_epoch(self, epoch: int) -> None:
        """Raise ``ValueError`` if the plan does not hold ``epoch`` (a mix's plan precomputed for fewer epochs)."""
        if self.epochs is not None and epoch >= len(self.epochs) - 1:
            raise ValueError(
                f"plan {self.store.path} holds {len(self.epochs) - 1} epoch(s) of its mix, this is epoch {epoch}: the "
                f"mix draws other documents every epoch, so epoch {epoch} has no precomputed packs; run `cpdata "
                f"precompute ... --epochs {epoch + 1}` (or more) for the epochs you train, or stream the mix with "
                "build_loader"
            )

    def start(self, epoch: int, block: Mapping[str, Any] | None) -> int:
        """Every epoch start and restore: the plan on disk and the documents are still the ones opened."""
        self.store = reopen_store(self.store.path, self.store.digest)
        check_source_unchanged(self.source, None)
        self.check_epoch(epoch)
        return 0

    def _epoch_packs(self, epoch: int) -> tuple[int, int]:
        """``(first, count)``: the plan's packs of ``epoch``."""
        if self.epochs is None:
            return 0, self.store.n_packs
        self.check_epoch(epoch)
        return int(self.epochs[epoch]), int(self.epochs[epoch + 1] - self.epochs[epoch])

    def packs(self, epoch: int) -> int:
        if self.schedule is not None:
            return int(self.schedule["num_steps"]) * int(self.schedule["micro_batches"])
        return self._epoch_packs(epoch)[1] // self.data.dp_size

    def pack(self, epoch: int, item: int) -> PackRows:
        n = self.packs(epoch)
        if not 0 <= item < n:
            raise IndexError(f"pack {item} out of range: this DP rank serves packs 0..{n - 1} in epoch {epoch}")
        micro = 1 if self.schedule is None else int(self.schedule["micro_batches"])  # a plan: one pack per step
        pack = self._epoch_packs(epoch)[0] + schedule_pack(item, micro, self.data.dp_rank, self.data.dp_size)[2]
        base = int(self.first_document[epoch]) if self.epochs is not None else 0
        return PackRows(columns=self.store.arrays, rows=self.store.pack_slice(pack), index=pack, first_document=base)

    def document(self, index: int) -> Mapping[str, np.ndarray]:
        return read_document(self.source, index, self.data.vocab_size, self.labels_alignment).arrays


class PrecomputedPacks(ServedPacks):
    """Emit the plan directory's packs as :class:`~cpdata.worker.plan.PackPlan`, in order.

    ``documents``: the dataset the plan was computed over (or the ``datasets.Dataset`` or mix it came from).
    ``cp_size`` and ``layout`` are checked against the plan when given; ``data``'s DP rank and size pick this
    rank's share, its ``vocab_size`` and ``labels_alignment`` validate documents as
    :class:`~cpdata.nodes.source.Documents` does (the plan fixed the order: ``seed``, ``shuffle`` and
    ``epochs`` are refused); ``verify`` checks every array's sha256 on open. State:
    :class:`~cpdata.nodes.served.ServedPacks`'s, refused from another plan, DP split or version."""

    rows: StoreRows

    def __init__(
        self,
        path: str | os.PathLike[str],
        documents: Any,
        *,
        cp_size: int | None = None,
        layout: str | None = None,
        data: DataPolicy = DataPolicy(),
        verify: bool = True,
        **removed: Any,
    ) -> None:
        refuse_keywords("PrecomputedPacks", removed, ("cp_size", "layout", "data", "verify"))
        check_records(data=data)
        fixed = [f"{k}={getattr(data, k)!r}" for k in ("seed", "shuffle", "epochs")
                 if getattr(data, k) != getattr(DataPolicy(), k)]  # fmt: skip
        if fixed:
            raise ValueError(f"a precomputed plan ({path}) fixed its order when it was computed; DataPolicy("
                             f"{', '.join(fixed)}) does not apply here: pass them to cpdata precompute "
                             "instead")  # fmt: skip
        store = read_store(path, verify=verify)
        planned = _planned_epochs(store)
        documents = as_source(documents, indexed=True, epochs=1 if planned is None else len(planned) - 1)
        _check_planned(store, "cp_size", store.config["cp_size"], cp_size)
        _check_planned(store, "layout", store.config["layout"], layout)
        _check_documents(store, documents)
        declared = declared_labels(documents)
        labels_alignment = declared_alignment("PrecomputedPacks", data.labels_alignment, declared, documents)
        _check_planned(store, "labels_alignment", store.config["labels_alignment"], labels_alignment, required=True)
        super().__init__(StoreRows(store, documents, data, labels_alignment))
        self.labels_alignment, self.documents, self.capacity = labels_alignment, documents, self.rows.capacity
        named = isinstance(documents, NamesSources) and callable(documents.document_sources)
        self.document_sources = self._mix_sources if named else None
        """A mix's (source name, index) of pieces (:func:`cpdata.nodes.source_kinds.document_sources_of`)."""

    @property
    def store(self) -> PackStore:
        return self.rows.store

    def graph_options(self, *, batch_size: int, qkv_format: str, padding_token_id: int) -> GraphOptions:
        """The options of a graph serving these packs: the plan's capacity, ``cp_size`` and layout, this
        ``data`` (the pads checked against its vocabulary, as :class:`~cpdata.CPDataset`'s are)."""
        config = self.store.config
        return GraphOptions(capacity=int(config["capacity"]), cp_size=int(config["cp_size"]),
                            layout=str(config["layout"]), batch_size=batch_size, qkv_format=qkv_format,
                            padding_token_id=padding_token_id, data=self.rows.data)  # fmt: skip

    @property
    def epochs(self) -> int | None:
        """Epochs the plan holds (a mix's plan), or None: the same packs every epoch."""
        return None if self.rows.epochs is None else len(self.rows.epochs) - 1

    def _mix_sources(self, index: np.ndarray) -> tuple[list[str], np.ndarray]:
        """The mix's ``document_sources`` of this epoch's pieces (their index counts from the epoch's first draw)."""
        base = int(self.rows.first_document[self.epoch]) if self.rows.epochs is not None else 0
        return self.documents.document_sources(np.asarray(index, dtype=np.int64) + base)


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
        self.plans = PrecomputedPacks(path, documents, cp_size=cp_size, layout=layout, data=data)
        self.options = self.plans.graph_options(batch_size=batch_size, qkv_format=qkv_format,
                                                padding_token_id=padding_token_id)  # fmt: skip
        self.cp_rank, self.delivery = cp_rank, delivery
        self._worker_node(0, 1)  # validate the configuration in the main process

    def __len__(self) -> int:
        """Batches of epoch 0 (or the epoch :meth:`set_epoch` named) for this DP rank (the last may hold
        fewer than ``batch_size`` packs; a mix's epochs differ)."""
        return -(-self.plans.rows.packs(self.start_epoch or 0) // self.options.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at ``epoch`` (a mix's plan: that epoch's packs; others: the same packs);
        an epoch the plan does not hold is refused here."""
        self.plans.rows.check_epoch(check_epoch(epoch))
        super().set_epoch(epoch)

    def _worker_node(self, worker_id: int, num_workers: int) -> BaseNode:
        packs = self.plans.with_worker((worker_id, num_workers), batch=self.options.batch_size)
        return rank_node(shard_graph(None, self.options, packs=packs), self.options, self.cp_rank, self.delivery)
