"""Reading a packing window at a time: the part of :class:`~cpdata.nodes.source.Documents` that gives the packers
their documents in windows (:meth:`WindowReads.next_window`) rather than one by one.

A sequence is read by slices of this rank's positions (:meth:`~cpdata.nodes.source_kinds.SourceReader.read_many`),
sized from the tokens a document has counted so far, and validated together
(:func:`~cpdata.nodes.validate.to_window`); items read past a window's end are kept for the next window of the same
pass (a cache, not state). Other sources are read one item at a time through ``next_item``. Errors name the
document, as ``next()`` does.
"""

from __future__ import annotations

from typing import Any

from cpdata.nodes.source_kinds import name_document_error
from cpdata.nodes.validate import document_ids, plain_ids, to_window
from cpdata.nodes.window import DocumentWindow, WindowFill

__all__ = ["WindowReads"]


class WindowReads:
    """The window reads of :class:`~cpdata.nodes.source.Documents`, whose state they read and move: ``source``,
    ``reader``, ``position``, ``consumed``, ``epoch``, ``dp_rank``, ``dp_size``, ``shuffle``, ``vocab_size``,
    ``labels_alignment``, :meth:`permutation`, :meth:`pass_ended`, :meth:`next_item`; and their own ``_mean``
    (counted tokens per document of the last window), ``_scratch`` (the windows' ids buffer) and ``_ahead``
    (``((epoch, first position), items)`` read past the last window)."""

    source: Any
    reader: Any
    position: int
    consumed: int
    epoch: int
    dp_rank: int
    dp_size: int
    shuffle: bool
    vocab_size: int | None
    labels_alignment: Any
    _mean: float
    _scratch: Any
    _ahead: tuple[tuple[int, int], list[Any]] | None

    def _read_ahead(self, count: int) -> tuple[list[int], list[int], list[Any], Exception | None]:
        """Up to ``count`` of this rank's next items of a sequence in this pass, the position left as is:
        ``(positions, source indices, items, error)`` (``error``: raised only if the window gets to it)."""
        first = self.position + (self.dp_rank - self.position) % self.dp_size
        positions = range(first, min(len(self.source), first + count * self.dp_size), self.dp_size)
        indices = self.permutation()[positions].tolist() if self.shuffle else list(positions)
        ahead, self._ahead = self._ahead, None
        kept = ahead[1][: len(indices)] if ahead is not None and ahead[0] == (self.epoch, first) else []
        items, error = self.reader.read_many(indices[len(kept) :])
        return list(positions), indices, kept + items, error

    def _chunk(self, fill: WindowFill) -> int:
        """Items to read ahead for ``fill``, from its documents' counted tokens so far (or the last window's)."""
        if fill.limit is None:
            return 4096
        count, tokens = len(fill.items), fill.tokens
        mean = tokens / count if count else self._mean
        more = int((fill.floor - tokens) / mean * 1.05) + 8 if tokens < fill.floor and mean > 0 else 8
        return min(max(fill.limit - count, more), 1 << 14)

    def next_window(self, limit: int | None, floor: int, capacity: int, room: int = 0) -> tuple[DocumentWindow, bool]:
        """The documents ``next()`` gives one by one until a packing window is full (:class:`WindowFill`),
        validated together: ``(window, exhausted)``. Errors (naming a document as ``next()`` does, but not once
        the window ran into the next pass) and the state after it are ``next()``'s; the window's ``ids`` keep
        ``room`` elements after the documents' (for the packer's carried pieces)."""
        epoch = self.epoch
        try:
            return self._fill_window(WindowFill(limit, floor, capacity), room)
        except (TypeError, ValueError) as exc:
            if self.epoch == epoch:
                name_document_error(exc, self.source)
            raise

    def _fill_window(self, fill: WindowFill, room: int) -> tuple[DocumentWindow, bool]:
        exhausted = False
        while fill.wants():
            if self.reader.kind == "sequence":
                positions, chunk_indices, chunk, error = self._read_ahead(self._chunk(fill))
                if not chunk and error is None:
                    self.position = max(self.position, len(self.source))
                    if self.pass_ended():
                        continue
                    exhausted = True
                    break
            else:
                try:
                    index, item = self.next_item()
                except StopIteration:
                    exhausted = True
                    break
                positions, chunk_indices, chunk, error = [], [index], [item], None
            taken = self._take(fill, positions, chunk, chunk_indices)
            if error is not None and taken == len(chunk) and fill.wants():
                raise error
        window = to_window(fill.items, fill.indices, fill.ids, self.vocab_size, self.labels_alignment, self._scratch,
                           room, fill.lengths())  # fmt: skip
        self.consumed += len(window)
        if len(window):
            self._mean = fill.tokens / len(window)
        return window, exhausted

    def _take(self, fill: WindowFill, positions: list[int], chunk: list[Any], chunk_indices: list[int]) -> int:
        """Add the items of ``chunk`` to ``fill`` until it is full; returns how many (a sequence's position moves)."""
        plain = plain_ids(chunk)
        if plain is not None:
            taken = fill.add_run(chunk, chunk_indices, *plain)
        else:
            taken = 0
            for item, index in zip(chunk, chunk_indices, strict=False):  # indices run on past a read error
                if not fill.wants():
                    break
                try:
                    doc_ids = document_ids(item, index)
                except Exception:
                    if positions:
                        self.position = positions[taken] + 1
                    to_window(fill.items, fill.indices, fill.ids, self.vocab_size, self.labels_alignment)
                    raise  # the earlier documents are fine: this one's own error
                fill.add(item, index, doc_ids)
                taken += 1
        if positions and taken:
            self.position = positions[taken - 1] + 1
        if positions and taken < len(chunk):  # read past the window's end: the next window starts with them
            self._ahead = ((self.epoch, positions[taken]), chunk[taken:])
        return taken
