"""Reading a packing window from :class:`~cpdata.nodes.source.Documents`: a sequence by slices, as columns.

A sequence source is read by slices of this rank's positions, the window rule applied with one cumulative
sum (:class:`~cpdata.nodes.window.WindowFill`) and the window validated at once
(:func:`~cpdata.nodes.validate.to_window`). Items read past the window's end are a cache for the next
window, not state: a reset, restore, ``next()`` or new pass drops them. Other sources are read one item
at a time, as by ``next()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cpdata.nodes.document_names import name_document_error
from cpdata.nodes.validate import Scratch, document_ids, plain_ids, to_window
from cpdata.nodes.window import DocumentWindow, WindowFill

if TYPE_CHECKING:
    from cpdata.nodes.source import Documents

__all__ = ["SourceWindows"]


class SourceWindows:
    """The windows of one ``Documents`` node: the node keeps the reading state (position, order, epochs),
    this part only a window's caches; it moves the node's position as ``next()`` would."""

    def __init__(self, documents: Documents) -> None:
        self.documents = documents
        self.mean = 0.0  # counted tokens per document of the last window (the read-ahead estimate)
        self.scratch = Scratch()  # the window's ids, concatenated to check them
        self.ahead: tuple[tuple[int, int], list[Any]] | None = None  # ((epoch, first position), items) read past

    def _read_ahead(self, count: int) -> tuple[list[int], list[int], list[Any], Exception | None]:
        """Up to ``count`` of this rank's next items of a sequence in this pass, the position left as is:
        ``(positions, source indices, items, error)`` (``error``: raised only if the window gets to it)."""
        docs = self.documents
        first = docs.position + (docs.dp_rank - docs.position) % docs.dp_size
        positions = range(first, min(len(docs.source), first + count * docs.dp_size), docs.dp_size)
        indices = docs.permutation()[positions].tolist() if docs.shuffle else list(positions)
        ahead, self.ahead = self.ahead, None
        kept = ahead[1][: len(indices)] if ahead is not None and ahead[0] == (docs.epoch, first) else []
        items, error = docs.reader.read_many(indices[len(kept) :])
        return list(positions), indices, kept + items, error

    def _chunk(self, limit: int | None, floor: int, count: int, tokens: int) -> int:
        """Items to read ahead for a window holding ``count`` documents and ``tokens`` counted tokens."""
        if limit is None:
            return 4096
        mean = tokens / count if count else self.mean
        more = int((floor - tokens) / mean * 1.05) + 8 if tokens < floor and mean > 0 else 8
        return min(max(limit - count, more), 1 << 14)

    def next_window(self, limit: int | None, floor: int, capacity: int, room: int = 0) -> tuple[DocumentWindow, bool]:
        """:meth:`_next_window`, its errors naming a document as ``next()`` does (not once it ran into the next pass)."""
        epoch = self.documents.epoch
        try:
            return self._next_window(limit, floor, capacity, room)
        except (TypeError, ValueError) as exc:
            if self.documents.epoch == epoch:
                name_document_error(exc, self.documents.source)
            raise

    def _next_window(self, limit: int | None, floor: int, capacity: int, room: int) -> tuple[DocumentWindow, bool]:
        """The documents ``next()`` gives one by one until a packing window is full (:class:`WindowFill`),
        validated together: ``(window, exhausted)``. Errors and the state after it are ``next()``'s; the
        window's ``ids`` keep ``room`` elements after the documents' (for the packer's carried pieces)."""
        docs = self.documents
        fill, exhausted = WindowFill(limit, floor, capacity), False
        while fill.wants():
            if docs.reader.kind == "sequence":
                count = self._chunk(limit, floor, len(fill.items), fill.tokens)
                positions, chunk_indices, chunk, error = self._read_ahead(count)
                if not chunk and error is None:
                    docs.position = max(docs.position, len(docs.source))
                    if docs.pass_ended():
                        continue
                    exhausted = True
                    break
            else:
                try:
                    index, item = docs.next_item()
                except StopIteration:
                    exhausted = True
                    break
                positions, chunk_indices, chunk, error = [], [index], [item], None
            taken = self._take(fill, positions, chunk, chunk_indices)
            if error is not None and taken == len(chunk) and fill.wants():
                raise error
        window = to_window(fill.items, fill.indices, fill.ids, docs.vocab_size, docs.labels_alignment, self.scratch,
                           room, fill.lengths())  # fmt: skip
        docs.consumed += len(window)
        if len(window):
            self.mean = fill.tokens / len(window)
        return window, exhausted

    def _take(self, fill: WindowFill, positions: list[int], chunk: list[Any], chunk_indices: list[int]) -> int:
        """Add the items of ``chunk`` to ``fill`` until it is full; returns how many (a sequence's position moves)."""
        docs = self.documents
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
                        docs.position = positions[taken] + 1
                    to_window(fill.items, fill.indices, fill.ids, docs.vocab_size, docs.labels_alignment)
                    raise  # the earlier documents are fine: this one's own error
                fill.add(item, index, doc_ids)
                taken += 1
        if positions and taken:
            docs.position = positions[taken - 1] + 1
        if positions and taken < len(chunk):  # read past the window's end: the next window starts with them
            self.ahead = ((docs.epoch, positions[taken]), chunk[taken:])
        return taken
