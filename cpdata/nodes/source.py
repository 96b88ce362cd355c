"""``Documents``: the source node. Validates user documents and shards them by DP rank.

Document ``i`` of the source goes to DP rank ``i % dp_size`` (every CP rank of a DP group reads the same
documents). Sources and how a restore finds its place (read through
:class:`~cpdata.nodes.source_kinds.SourceReader`):

| source | resume |
|---|---|
| sequence (``__len__`` + ``__getitem__``: list, map-style or ``datasets.Dataset``) | O(1) seek |
| re-iterable (``__iter__`` returns a fresh iterator; ``datasets.IterableDataset``) | re-iterate and skip |
| ``torchdata.nodes.BaseNode`` | its own state, nested under ``"source"`` |

A one-shot iterator cannot be restarted, so it is refused. An item is a dict with ``input_ids`` (1-D
non-negative ints) and optional per-token arrays of the same length; other values are metadata, not
carried (:func:`~cpdata.nodes.validate.to_document`). A packer reads a window at a time
(:meth:`Documents.next_window`): a sequence by slices of this rank's positions, validated at once
(:func:`~cpdata.nodes.validate.to_window`); items read past a window's end are a cache, not state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.epochs import EpochNode, check_num_epochs
from cpdata.nodes.options import DataPolicy
from cpdata.nodes.shuffle_buffer import DEFAULT_SHUFFLE_BUFFER, ShuffleBuffer
from cpdata.nodes.source_kinds import SourceReader, name_document_error, read_document, source_kind
from cpdata.nodes.source_windows import WindowReads
from cpdata.nodes.state_version import VersionedState
from cpdata.nodes.validate import to_document
from cpdata.sources.fingerprint import check_source_unchanged, source_fingerprint
from cpdata.sources.open import as_source
from cpdata.sources.protocol import Mixture, NamesSources, declared_labels
from cpdata.worker.plan import Document
from cpdata.worker.targets import LabelsAlignment, declared_alignment
from cpdata.worker.token_buffer import BufferPool

__all__ = ["Documents", "source_kind", "to_document"]


class Documents(WindowReads, VersionedState, EpochNode[Document]):
    """Validated, DP-sharded documents from a sequence, a re-iterable or a node.

    The arguments are :class:`~cpdata.nodes.options.DataPolicy`'s fields. ``shuffle``: a sequence is read
    in the permutation of ``(seed, epoch)`` (position ``j`` to DP rank ``j % dp_size``); a stream through
    a :class:`~cpdata.nodes.shuffle_buffer.ShuffleBuffer` of ``shuffle_buffer`` documents of this rank's share.

    State: ``{"version", "consumed", "position", "shard", "length", "fingerprint", ...}``. A restore
    under another DP split, onto another dataset, or onto a source changed since it was opened (checked at
    every epoch start and restore, :mod:`cpdata.sources.fingerprint`) raises ``ValueError``.
    """

    VERSION = 2  # 2: the epoch (and the order it implies) is part of the state
    EPOCH_KEY = "epoch"
    FIRST_EPOCH_KEY = "first_epoch"
    ORDER_KEY = "order"
    CONSUMED_KEY = "consumed"
    POSITION_KEY = "position"
    SHARD_KEY = "shard"
    LENGTH_KEY = "length"
    FINGERPRINT_KEY = "fingerprint"
    BUFFER_KEY = "buffer_drawn"

    def __init__(
        self,
        source: Sequence[Mapping[str, Any]] | Iterable[Mapping[str, Any]] | BaseNode,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
        labels_alignment: LabelsAlignment | None = None,
        shuffle: bool = False,
        seed: int = 0,
        num_epochs: int | None = None,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    ) -> None:
        super().__init__()
        DataPolicy(dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle, vocab_size=vocab_size)  # their checks
        check_num_epochs(num_epochs)
        self.source = source = as_source(source)
        self.reader = SourceReader(source)
        self._mixture = self.reader.kind == "node" and isinstance(source, Mixture)  # asked once: not per document
        self.labels_alignment = declared_alignment("Documents", labels_alignment, declared_labels(source), source)
        buffer = ShuffleBuffer(shuffle_buffer, int(seed), int(dp_rank))  # validates shuffle_buffer
        self._buffer = buffer if shuffle and self.reader.kind != "sequence" else None
        self.dp_rank, self.dp_size, self.vocab_size = int(dp_rank), int(dp_size), vocab_size
        self.shuffle, self.seed, self.num_epochs = shuffle, int(seed), num_epochs
        self._order: tuple[int, np.ndarray] | None = None
        self.position = 0  # source items of this pass read so far (every rank's)
        self.consumed = 0  # documents this rank emitted
        self._fingerprint: str | None = None
        self._fingerprinted = False
        self._mean = 0.0  # counted tokens per document of the last window (the read-ahead estimate)
        self._scratch = BufferPool()  # the windows' ids, concatenated to check them
        self._ahead: tuple[tuple[int, int], list[Any]] | None = None  # ((epoch, first position), items) read past

    @property
    def seekable(self) -> bool:
        """Whether :meth:`fetch` works (sequence sources): packers then keep only references in their state."""
        return self.reader.kind == "sequence"

    @property
    def source_counts(self) -> dict[str, dict[str, int]] | None:
        """Per-source counters of a :func:`cpdata.mix` source (``Mix.counts``), else None."""
        return self.source.counts if self._mixture else None

    @property
    def document_sources(self) -> Any:
        """A :func:`cpdata.mix` source's ``document_sources`` (batches name each slot's source), or None; None
        with ``num_epochs > 1`` too (a pack may then hold draws of two epochs, which positions cannot tell)."""
        found = self.source.document_sources if isinstance(self.source, NamesSources) else None
        return found if callable(found) and (self.num_epochs or 1) == 1 else None

    def fetch(self, index: int) -> Document:
        """Source document ``index`` (a global index), validated; O(1), sequence sources only."""
        if not self.seekable:
            raise TypeError(f"fetch needs a sequence source, this node reads a {self.reader.kind}")
        return read_document(self.source, index, self.vocab_size, self.labels_alignment)

    def _length(self) -> int | None:
        return len(self.source) if self.reader.kind == "sequence" else None  # type: ignore[arg-type]

    def permutation(self) -> np.ndarray:
        """int64 ``[len(source)]``: this epoch's order of a shuffled sequence (source index at each position)."""
        if self._order is None or self._order[0] != self.epoch:
            perm = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.source))  # type: ignore[arg-type]
            self._order = (self.epoch, perm)
        return self._order[1]

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.position, self.consumed, self._ahead = 0, 0, None
        self._check_source()
        if initial_state is None:
            self.epoch_clock.start()  # a new iter(): the next epoch
            self._restart_source()
            return
        self._check(initial_state)
        self.epoch_clock.restore(initial_state[self.EPOCH_KEY], initial_state[self.FIRST_EPOCH_KEY])
        self.consumed, position = int(initial_state[self.CONSUMED_KEY]), int(initial_state[self.POSITION_KEY])
        if self._buffer is None:
            self.position = position
            self._restart_source(initial_state.get(self.SOURCE_KEY))
            return
        self._restart_source()
        self._buffer.replay(self.epoch, initial_state[self.BUFFER_KEY], self._next_own)
        if self.position != position:
            raise ValueError(
                f"replaying the shuffle buffer read {self.position} source items, the saved state had read "
                f"{position}; the source changed since the state was saved"
            )

    def _restart_source(self, nested: dict[str, Any] | None = None) -> None:
        if self._buffer is not None:
            self._buffer.start(self.epoch)
        if self.reader.kind == "node" and nested is None and isinstance(self.source, EpochNode):
            self.source.set_epoch(self.epoch)  # a node with epochs (cpdata.mix) follows ours
        self.reader.open(self.position, nested)

    def _check_source(self) -> None:
        """The source is the one first read, unchanged (at every epoch start and restore)."""
        if not self._fingerprinted:
            self._fingerprint, self._fingerprinted = source_fingerprint(self.source), True
        check_source_unchanged(self.source, self._fingerprint)

    def _check(self, state: dict[str, Any]) -> None:
        self.check_saved(state)
        shard, mine = tuple(state[self.SHARD_KEY]), (self.dp_rank, self.dp_size)
        length, order, saved = state.get(self.LENGTH_KEY), state.get(self.ORDER_KEY), state.get(self.FINGERPRINT_KEY)
        names = "shuffle, seed, num_epochs" + (", shuffle_buffer" if self._buffer is not None else "")
        for wrong, message in (  # the first that differs is refused
            (shard != mine, f"for (dp_rank, dp_size)={shard}, this node has {mine}; restore each rank's own state "
             "with the same DP size"),
            (length != self._length(), f"for a source of length {length}, this source has length {self._length()}; "
             "restore onto the same dataset"),
            (order != self._order_config(), f"with ({names})={tuple(order or ())}, this node has "
             f"{tuple(self._order_config())}; restore with the order the state was saved with"),
            (saved is not None and self._fingerprint is not None and saved != self._fingerprint, f"for the source "
             f"with fingerprint {saved}, this source has {self._fingerprint} (same length, other content); restore "
             "onto the same dataset"),
        ):  # fmt: skip
            if wrong:
                raise ValueError(f"Documents state was saved {message}")

    def _order_config(self) -> list[Any]:
        config = [self.shuffle, self.seed, self.num_epochs]
        return config + [self._buffer.size] if self._buffer is not None else config

    def _read(self) -> tuple[int, int, Any]:
        """The next item of this pass: ``(position, source index, item)`` (StopIteration at the pass's end)."""
        position = index = self.position
        if self.reader.kind == "sequence":
            position += (self.dp_rank - position) % self.dp_size  # jump straight to this rank's next item
            if position >= len(self.source):  # type: ignore[arg-type]
                self.position = max(self.position, len(self.source))  # type: ignore[arg-type]
                raise StopIteration
            index = int(self.permutation()[position]) if self.shuffle else position
            item = self.reader.read(index)
        else:
            item = self.reader.next(index)
        self.position = position + 1
        return position, index, item

    def _next_own(self) -> tuple[int, int, Any]:
        """This rank's next ``(position, source index, item)``; a mix skips other ranks' items unread."""
        while True:
            if self._mixture and self.position % self.dp_size != self.dp_rank:
                self.source.skip_unread()  # StopIteration at the stream's end
                self.position += 1
                continue
            position, index, item = self._read()
            if position % self.dp_size == self.dp_rank:
                return position, index, item

    def pass_ended(self) -> bool:
        """At the end of a pass: start the next one (``num_epochs``) and return True; False after the last."""
        if not self.epoch_clock.advance(self.num_epochs):
            return False
        self.position = 0  # num_epochs: the next pass, same iter()
        self._check_source()
        self._restart_source()
        return True

    def next_item(self) -> tuple[int, Any]:
        """This rank's next ``(source index, item)``, across epochs (StopIteration after the last)."""
        while True:
            try:
                _, index, item = self._next_own() if self._buffer is None else self._buffer.next(self._next_own)
                return index, item
            except StopIteration:
                if not self.pass_ended():  # else the next pass goes on
                    raise

    def next(self) -> Document:
        index, item = self.next_item()
        try:
            document = to_document(item, index, self.vocab_size, self.labels_alignment)
        except (TypeError, ValueError) as exc:
            name_document_error(exc, self.source)  # a mix: document i of source 'b', not draw j
            raise
        self.consumed += 1
        return document

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            **self.state_header(),
            self.CONSUMED_KEY: self.consumed,
            self.POSITION_KEY: self.position,
            self.SHARD_KEY: (self.dp_rank, self.dp_size),
            self.LENGTH_KEY: self._length(),
            self.FINGERPRINT_KEY: self._fingerprint,
            self.EPOCH_KEY: self.epoch,
            self.FIRST_EPOCH_KEY: self.epoch_clock.first,
            self.ORDER_KEY: self._order_config(),
        }
        if self._buffer is not None:  # a restore replays the epoch up to here (cpdata.nodes.shuffle_buffer)
            state[self.BUFFER_KEY] = self._buffer.drawn
        elif self.reader.kind == "node":
            state[self.SOURCE_KEY] = self.reader.node_state()
        return state
