"""``PrecomputedPacks``: serve a precomputed plan directory as ``PackPlan``s.

The node replaces ``Documents -> Pack`` in the worker pipeline
(``PrecomputedPacks -> Collate -> ShardForRank``). Each ``next()`` reads the
pieces of one pack from memory-mapped arrays and the tokens of its documents
from ``documents`` by index, so the node holds no buffer: its state is the pack
index (plus version and the plan's manifest digest) and a restore is O(1), at
any point of a 10M-pack plan.

At every epoch start and restore the node re-reads the manifest digest from
disk and asks the documents whether they changed since they were opened
(:mod:`cpdata.sources.fingerprint`); a document whose bytes changed raises when read.

Nothing is served from a plan that does not match: the constructor refuses a
plan written for other documents (input sha256, or the lengths' sha256 for a
plan precomputed from lengths only), for another ``cp_size`` or ``layout`` than
the caller asks, or whose manifest or any array fails its checksum.

A document cut into several pieces is read and validated once while its
pieces follow one another, not once per piece (see :meth:`PrecomputedPacks._document`).

Epochs: a plan of a :func:`cpdata.mix` holds the epochs it was precomputed
for (``precompute(..., epochs=n)``, default 1), each with its own packs over
the documents the mix draws in that epoch; the node serves epoch ``e`` (counted
per fresh ``reset()``, or :meth:`PrecomputedPacks.set_epoch`) from epoch ``e``'s
packs and refuses epoch ``n`` with ``ValueError`` naming the fix, never serving an
earlier epoch's draws as a later one's. Any other plan (one dataset, or a
schedule, which plans a mix's epoch-0 draws for every epoch) is served whole
every epoch, as the loader packs it.

Data parallelism, global schedule (``cpdata precompute --dp-size R --micro-batches M``):
the plan holds ``num_steps x R x M`` packs in (step, rank, micro-batch) order;
rank ``dp_rank`` serves its ``num_steps x M`` packs (every rank the same
count), reading only their documents; ``dp_size`` must be the plan's ``R``.

Data parallelism, plan without a schedule: with ``dp_size > 1`` rank ``dp_rank`` serves packs
``dp_rank, dp_rank + dp_size, ...`` of the whole-dataset plan, and every rank
serves ``n_packs // dp_size`` of them (the last ``n_packs % dp_size`` packs are
left out) so no rank runs out a step early. The online pipeline instead shards
documents by DP rank before packing; with ``dp_size = 1`` the two give the
same packs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.document_names import name_document_error
from cpdata.nodes.mixed import as_mixed_dataset
from cpdata.nodes.source import to_document
from cpdata.nodes.state_version import check_state_version
from cpdata.offline.store import PackStore, read_store
from cpdata.sources.fingerprint import check_source_unchanged
from cpdata.sources.hf import indexed_hf_documents
from cpdata.worker.keys import IGNORE_INDEX, INPUT_IDS
from cpdata.worker.plan import DocPiece, PackPlan, PieceColumns
from cpdata.worker.targets import LabelsAlignment, declared_alignment, piece_arrays

__all__ = ["EpochCount", "PrecomputedPacks"]


class _Documents(Protocol):
    def __getitem__(self, i: int) -> Any: ...
    def checksum(self) -> str: ...


def _check_documents(store: PackStore, documents: _Documents) -> None:
    source = store.manifest["input"]
    if not callable(getattr(documents, "checksum", None)):
        raise TypeError(
            f"documents must provide checksum() (e.g. cpdata.sources.open_dataset(path)), got {type(documents).__name__}"
        )
    if source["kind"] == "lengths":
        lengths = getattr(documents, "lengths", None)
        digest = documents.lengths_checksum() if hasattr(documents, "lengths_checksum") else None
        if lengths is None or digest != source["lengths_sha256"]:
            n = "?" if lengths is None else len(lengths)
            raise ValueError(
                f"plan {store.path} was precomputed from the lengths file {source['name']!r} "
                f"({source['documents']} documents, lengths sha256 {source['lengths_sha256'][:16]}…) but the "
                f"documents given ({n} documents, lengths sha256 {str(digest)[:16]}…) have other lengths; "
                "serve it with the tokenized dataset those lengths were taken from, or re-run `cpdata precompute`"
            )
        return
    digest = documents.checksum()
    if digest != source["sha256"]:
        raise ValueError(
            f"plan {store.path} was precomputed from {source['name']!r} (sha256 {source['sha256'][:16]}…), "
            f"but the documents given hash to {digest[:16]}…; pass the same dataset, or re-run "
            "`cpdata precompute` on this one"
        )


def _check_expected(store: PackStore, name: str, expected: object) -> None:
    actual = store.config[name]
    if expected is not None and expected != actual:
        raise ValueError(
            f"plan {store.path} was precomputed for {name}={actual!r}, the pipeline asks for {name}={expected!r}; "
            f"run `cpdata precompute ... --{name.replace('_', '-')} {expected}` or use {name}={actual!r}"
        )


class EpochCount:
    """The epoch a node serves: 0 at first, +1 at each later fresh ``reset()``, or what :meth:`set` named."""

    def __init__(self, start: int | None = None) -> None:
        self.epoch, self._next, self._started = 0, None, False
        if start is not None:
            self.set(start)

    def set(self, epoch: int) -> None:
        """The next fresh start is ``epoch`` (as ``DistributedSampler.set_epoch``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._next = int(epoch)

    def start(self, restored: int | None = None) -> int:
        """A ``reset()``: the restored state's epoch, else the next epoch; returns it."""
        if restored is not None:
            self.epoch = int(restored)
        elif self._next is not None:
            self.epoch, self._next = self._next, None
        elif self._started:
            self.epoch += 1
        self._started = True
        return self.epoch


def _planned_epochs(store: PackStore) -> np.ndarray | None:
    """int64 ``[epochs + 1]``: the first pack of each epoch of a mix's plan; None for a plan served every epoch."""
    if "mix" not in store.manifest["input"] or "schedule" in store.manifest:
        return None
    planned = store.manifest.get("epochs", {"first_pack": [0, store.n_packs]})  # a plan from before epochs=: one
    return np.asarray(planned["first_pack"], dtype=np.int64)


class PrecomputedPacks(BaseNode[PackPlan]):
    """Emit the plan directory's packs as :class:`~cpdata.worker.plan.PackPlan`, in order.

    Args:
        path: a directory written by :func:`cpdata.offline.precompute` / ``cpdata precompute``.
        documents: the dataset the plan was computed over, indexable by source
            index and providing ``checksum()`` (a :class:`~cpdata.sources.TokenizedDataset`),
            or the ``datasets.Dataset`` it was computed from.
        cp_size, layout: what the pipeline will shard for; checked against the
            plan when given.
        dp_rank, dp_size: this rank's share of the packs (see the module docstring).
        vocab_size: token ids ``>= vocab_size`` raise ``ValueError`` (documents are
            validated as by :class:`~cpdata.nodes.source.Documents`).
        labels_alignment: the documents' label convention (:mod:`cpdata.worker.targets`);
            refused when the plan was precomputed under another one.
        verify: check every array's sha256 on open (reads each array once).

    State: ``{"version", "manifest_sha256", "dp", "epoch", "pack_index"}``. A state from
    another plan, DP split or version is refused.
    """

    VERSION_KEY = "version"
    DIGEST_KEY = "manifest_sha256"
    DP_KEY = "dp"
    EPOCH_KEY = "epoch"
    INDEX_KEY = "pack_index"
    VERSION = 2  # 2: the epoch (a mix plan's epochs have their own packs)

    def __init__(
        self,
        path: str | os.PathLike[str],
        documents: _Documents,
        *,
        cp_size: int | None = None,
        layout: str | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
        labels_alignment: LabelsAlignment | None = None,
        verify: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in (("dp_size", dp_size, 1), ("dp_rank", dp_rank, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank must be < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        self.store = read_store(path, verify=verify)
        self._epochs = _planned_epochs(self.store)
        documents = as_mixed_dataset(indexed_hf_documents(documents), epochs=self.epochs or 1)
        _check_expected(self.store, "cp_size", cp_size)
        _check_expected(self.store, "layout", layout)
        _check_documents(self.store, documents)
        self.labels_alignment = declared_alignment("PrecomputedPacks", labels_alignment, documents)
        planned = self.store.config.get("labels_alignment")
        if planned is not None and planned != self.labels_alignment:
            raise ValueError(
                f"plan {self.store.path} was precomputed with labels_alignment={planned!r}, the pipeline asks for "
                f"labels_alignment={self.labels_alignment!r}; pass labels_alignment={planned!r} or re-run "
                f"`cpdata precompute ... --labels-alignment {self.labels_alignment}`"
            )
        self.documents = documents
        self.document_sources = self._mix_sources if callable(getattr(documents, "document_sources", None)) else None
        """A mix's (source name, index) of pieces (:func:`cpdata.nodes.document_names.document_sources_of`)."""
        self._first_document = np.asarray(getattr(documents, "epoch_starts", [0]), dtype=np.int64)
        """Where each epoch of a mix's listing begins: a piece's index counts within its epoch, as online."""
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.vocab_size = vocab_size
        self.capacity = int(self.store.config["capacity"])
        self._schedule = self.store.manifest.get("schedule")
        if self._schedule is not None and self._schedule["dp_size"] != self.dp_size:
            raise ValueError(
                f"plan {self.store.path} is a schedule for dp_size={self._schedule['dp_size']}, this node has "
                f"dp_size={self.dp_size}; serve it with the DP size it was planned for, or re-run "
                f"`cpdata precompute ... --dp-size {self.dp_size}`"
            )
        self._index, self._clock = 0, EpochCount()
        self._open: tuple[int, Mapping[str, np.ndarray]] | None = None  # a document whose pieces go on

    @property
    def epochs(self) -> int | None:
        """Epochs the plan holds (a mix's plan), or None: the same packs every epoch."""
        return None if self._epochs is None else len(self._epochs) - 1

    @property
    def epoch(self) -> int:
        """The epoch being served (0-based; counts on across fresh ``reset()`` calls and restores)."""
        return self._clock.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next fresh ``reset()`` start epoch ``epoch`` (a process that rebuilds the node every epoch)."""
        self._clock.set(epoch)

    def check_epoch(self, epoch: int) -> None:
        """Raise ``ValueError`` if the plan does not hold ``epoch`` (a mix's plan precomputed for fewer epochs)."""
        if self.epochs is not None and epoch >= self.epochs:
            raise ValueError(
                f"plan {self.store.path} holds {self.epochs} epoch(s) of its mix, this is epoch {epoch}: the mix draws "
                f"other documents every epoch, so epoch {epoch} has no precomputed packs; run `cpdata precompute ... "
                f"--epochs {epoch + 1}` (or more) for the epochs you train, or stream the mix with build_loader"
            )

    def _epoch_packs(self, epoch: int) -> tuple[int, int]:
        """``(first, count)``: the plan's packs of ``epoch``."""
        if self._epochs is None:
            return 0, self.store.n_packs
        self.check_epoch(epoch)
        return int(self._epochs[epoch]), int(self._epochs[epoch + 1] - self._epochs[epoch])

    def __len__(self) -> int:
        """Packs this DP rank serves in the current epoch (equal for every rank)."""
        return self.packs_in(self._clock.epoch)

    def packs_in(self, epoch: int) -> int:
        """Packs this DP rank serves in ``epoch``."""
        if self._schedule is not None:
            return int(self._schedule["num_steps"]) * int(self._schedule["micro_batches"])
        return self._epoch_packs(epoch)[1] // self.dp_size

    def _check_unchanged(self) -> None:
        """Every epoch start and restore: the plan on disk and the documents are still the ones opened."""
        on_disk = read_store(self.store.path, verify=False).digest
        if on_disk != self.store.digest:
            raise ValueError(
                f"plan {self.store.path} changed on disk since this node opened it (manifest sha256 "
                f"{self.store.digest[:16]}… then, {on_disk[:16]}… now: it was precomputed again); its packs differ: "
                "build a new pipeline on the new plan, as a new run, or restore the old plan"
            )
        check_source_unchanged(self.documents, None)

    def _pack_id(self, index: int, epoch: int) -> int:
        """Row of this rank's ``index``-th pack of ``epoch`` in the plan."""
        if self._schedule is None:
            return self._epoch_packs(epoch)[0] + index * self.dp_size + self.dp_rank
        step, micro_batch = divmod(index, int(self._schedule["micro_batches"]))
        return (step * self.dp_size + self.dp_rank) * int(self._schedule["micro_batches"]) + micro_batch

    def _dp(self) -> list[int]:
        return [self.dp_rank, self.dp_size]

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._open = None
        self._check_unchanged()
        if initial_state is None:
            self._index = 0
            self.check_epoch(self._clock.start())
            return
        check_state_version("PrecomputedPacks", initial_state, self.VERSION_KEY, self.VERSION)
        digest = initial_state.get(self.DIGEST_KEY)
        if digest != self.store.digest:
            raise ValueError(
                f"PrecomputedPacks state belongs to the plan with manifest sha256 {str(digest)[:16]}…, this node "
                f"serves {self.store.path} ({self.store.digest[:16]}…); resume with the plan the state was saved from"
            )
        if list(initial_state.get(self.DP_KEY, [])) != self._dp():
            raise ValueError(
                f"PrecomputedPacks state was saved as [dp_rank, dp_size]={initial_state.get(self.DP_KEY)}, this node "
                f"is {self._dp()}; resume with the same data-parallel split"
            )
        epoch = initial_state.get(self.EPOCH_KEY)
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"PrecomputedPacks state has epoch={epoch!r}, expected an int >= 0")
        self.check_epoch(int(epoch))
        index = initial_state.get(self.INDEX_KEY)
        n = self.packs_in(int(epoch))
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index <= n:
            raise ValueError(f"PrecomputedPacks state has pack_index={index!r}, expected 0..{n}")
        self._clock.start(int(epoch))
        self._index = int(index)

    def next(self) -> PackPlan:
        if self._index >= len(self):
            raise StopIteration
        plan = self.plan(self._index)
        self._index += 1
        return plan

    def plan(self, index: int, epoch: int | None = None) -> PackPlan:
        """The ``index``-th pack of this DP rank's stream in ``epoch`` (default: the current one; random access,
        O(pack))."""
        epoch = self._clock.epoch if epoch is None else int(epoch)
        n = self.packs_in(epoch)
        if not 0 <= index < n:
            raise IndexError(f"pack {index} out of range: this DP rank serves packs 0..{n - 1} in epoch {epoch}")
        a = self.store.arrays
        pack = self._pack_id(index, epoch)
        rows = self.store.pack_slice(pack)
        base = int(self._first_document[epoch]) if self._epochs is not None else 0
        pieces = []
        for j in range(rows.start, rows.stop):
            doc, start, length = int(a["doc_index"][j]), int(a["doc_start"][j]), int(a["doc_len"][j])
            arrays = self._document(doc, more=bool(a["continues"][j]))
            n = int(arrays[INPUT_IDS].shape[0])
            if start + length > n:
                raise ValueError(
                    f"plan {self.store.path} places tokens {start}:{start + length} of document {doc}, which has "
                    f"{n} tokens; the documents do not match the plan, re-run `cpdata precompute` on them"
                )
            end = start + length
            next_label = int(arrays[INPUT_IDS][end]) if a["continues"][j] else IGNORE_INDEX
            pieces.append(
                DocPiece(
                    index=doc - base,
                    start=start,
                    arrays=piece_arrays(arrays, start, length, bool(a["continues"][j])),
                    next_label=next_label,
                )
            )
        return PackPlan(
            pieces=PieceColumns.of(pieces),  # as the online Pack emits them
            slot_lens=np.array(a["slot_len"][rows], dtype=np.int64),
            capacity=self.capacity,
            index=pack,  # the plan's own pack id (row of the store), not this rank's ordinal
        )

    def _mix_sources(self, index: np.ndarray) -> tuple[list[str], np.ndarray]:
        """The mix's ``document_sources`` of this epoch's pieces (their index counts from the epoch's first draw)."""
        base = int(self._first_document[self._clock.epoch]) if self._epochs is not None else 0
        return self.documents.document_sources(np.asarray(index, dtype=np.int64) + base)

    def _document(self, i: int, *, more: bool) -> Mapping[str, np.ndarray]:
        """Document ``i``, validated; read once for all its pieces.

        A document cut into pieces (``overflow="split"``, ``concat``) is kept
        while pieces of it follow (``more``), so a 5M-token JSONL row cut into
        153 pieces is parsed once per epoch, not 153 times; at most one such
        document is held (its pieces sit in consecutive packs).
        """
        if self._open is not None and self._open[0] == i:
            arrays = self._open[1]
        else:
            try:
                arrays = to_document(self.documents[i], i, self.vocab_size, self.labels_alignment).arrays
            except (TypeError, ValueError) as exc:
                name_document_error(exc, self.documents)  # a mix: document i of source 'b'
                raise
            if more:
                self._open = (i, arrays)
        if not more and self._open is not None and self._open[0] == i:
            self._open = None  # its last piece
        return arrays

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes reopen the memory maps instead of receiving copies of the arrays.
        state = self.__dict__.copy()
        state["store"] = (str(self.store.path), self.store.digest)
        state["_open"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        path, digest = state["store"]
        store = read_store(path, verify=False)
        if store.digest != digest:
            raise ValueError(f"plan {path} changed on disk since this node was built (manifest sha256 differs)")
        self.__dict__.update(state, store=store)

    def get_state(self) -> dict[str, Any]:
        return {
            self.VERSION_KEY: self.VERSION,
            self.DIGEST_KEY: self.store.digest,
            self.DP_KEY: self._dp(),
            self.EPOCH_KEY: self._clock.epoch,
            self.INDEX_KEY: self._index,
        }
