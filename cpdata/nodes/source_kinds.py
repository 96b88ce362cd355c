"""How a document source is read and restarted: its kind, :class:`SourceReader`, errors naming a document.

:class:`SourceReader` is the one reader of a user source, shared by ``Documents``, each source of a
:func:`cpdata.mix`, ``Tokenize``'s rows and ``WindowedPacks``; :func:`read_document` is the read of a
plan served by index. A validation error names a document by its index in the stream read, in a
:func:`cpdata.mix` a position in the mixed stream: a source with ``describe_document(index)`` (the mix
node, :class:`~cpdata.nodes.mixed.MixedDataset`) renames it ``"document 3 of mix source 'b' ..."``
(:func:`name_document_error`, nothing spent until an error); a draw the packer finds too long for a pack is named
the same way (:func:`name_mixed_overlong`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from cpdata.nodes.epochs import upstream
from cpdata.nodes.validate import to_document
from cpdata.packing.pieces import OverlongDocumentError
from cpdata.sources.protocol import Described, NamesSources
from cpdata.worker.plan import Document
from cpdata.worker.targets import LabelsAlignment

__all__ = ["SourceReader", "document_sources_of", "name_document_error", "name_mixed_overlong", "read_document",
           "reading_error", "source_kind"]


def source_kind(source: Any, items: str = "documents") -> str:
    """``"node"``, ``"sequence"`` or ``"iterable"``; ``TypeError`` for a string, a mapping, a one-shot
    iterator (it cannot be restarted) or something not iterable."""
    if isinstance(source, BaseNode):
        return "node"
    plain = not isinstance(source, (str, bytes, Mapping))  # text and dicts are iterable, but not of documents
    if plain and hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return "sequence"
    if plain and isinstance(source, Iterator):
        raise TypeError(
            f"source is a one-shot iterator ({type(source).__name__}) that cannot be restarted for resume "
            "or a new epoch; pass a list, a re-iterable (an object whose __iter__ returns a fresh "
            "iterator) or a torchdata BaseNode"
        )
    if plain and isinstance(source, Iterable):
        return "iterable"
    raise TypeError(f"source must be a sequence or iterable of {items}, got {type(source).__name__}")


class SourceReader:
    """One user source (a sequence, a re-iterable or a node), read by index or as a stream; read errors
    say ``"reading document 7 {label} failed: ..."``. ``TypeError`` (:func:`source_kind`) if it cannot be
    read and restarted."""

    def __init__(self, source: Any, label: str = "from the source", items: str = "documents") -> None:
        self.source, self.label, self.items = source, label, items
        self.kind = source_kind(source, items)
        self._it: Iterator[Any] | None = None

    def open(self, position: int = 0, nested: Mapping[str, Any] | None = None) -> None:
        """Start reading again at ``position`` (a stream: its first ``position`` items read and dropped) or
        from ``nested`` (a node's saved state)."""
        self._it = None
        if self.kind == "node":
            self.source.reset(nested)
        elif self.kind == "iterable":
            it = iter(self.source)
            for skipped in range(position):
                try:
                    next(it)
                except StopIteration:
                    raise ValueError(f"the saved state has read {position} {self.items} but the source ends "
                                     f"after {skipped}; restore onto the same source") from None
            self._it = it

    def read(self, index: int) -> Any:
        """Item ``index`` of a sequence; errors name the document and the source."""
        try:
            return self.source[index]
        except Exception as exc:
            raise self.error(exc, index) from exc

    def read_many(self, indices: Sequence[int]) -> tuple[list[Any], Exception | None]:
        """Items ``indices`` of a sequence up to the first that fails: ``(items, error or None)``, not raised."""
        source = self.source
        try:
            return [source[i] for i in indices], None
        except Exception:
            items: list[Any] = []
            for i in indices:
                try:
                    items.append(source[i])
                except Exception as exc:
                    error = self.error(exc, i)
                    error.__cause__ = exc
                    return items, error
            raise

    def next(self, index: int) -> Any:
        """Item ``index`` of a pass: a sequence's, or the next of a stream (a stream not open is opened there);
        StopIteration at the pass's end."""
        if self.kind == "sequence":
            if index >= len(self.source):
                raise StopIteration
            return self.read(index)
        if self.kind == "iterable" and self._it is None:
            self.open(index)
        try:
            return next(self._it if self.kind == "iterable" else self.source)  # type: ignore[arg-type]
        except StopIteration:
            raise
        except Exception as exc:
            raise self.error(exc, index) from exc

    def error(self, exc: Exception, index: int) -> Exception:
        """``exc``'s type, its message naming document ``index`` and the source."""
        return reading_error(exc, f"reading document {index} {self.label} failed")

    def node_state(self) -> dict[str, Any]:
        """A node source's own state (a copy), for the reader's state."""
        return copy.deepcopy(self.source.state_dict())

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_it": None}  # an open iterator does not pickle; the next read reopens it


def read_document(source: Any, index: int, vocab_size: int | None,
                  labels_alignment: LabelsAlignment | None) -> Document:  # fmt: skip
    """Document ``index`` of an indexed source, validated; errors name where it came from (a mix's source)."""
    try:
        item = source[index]
    except Exception as exc:
        raise reading_error(exc, f"reading document {index} from the source failed") from exc
    try:
        return to_document(item, index, vocab_size, labels_alignment)
    except (TypeError, ValueError) as exc:
        name_document_error(exc, source)
        raise


def reading_error(exc: Exception, what: str) -> Exception:
    """``exc``'s type with ``what`` before its message (RuntimeError if the type is not constructible so)."""
    message = f"{what}: {type(exc).__name__}: {exc}"
    try:
        return type(exc)(message)
    except Exception:
        return RuntimeError(message)


_LEADING = re.compile(r"document (\d+)")


def name_document_error(exc: BaseException, source: Any) -> None:
    """Raise ``exc``'s type with its leading ``"document {index}"`` replaced by ``source.describe_document(index)``;
    return when there is nothing to rename (the caller re-raises ``exc``)."""
    if not isinstance(source, Described) or not isinstance(exc, (TypeError, ValueError)):
        return
    message = str(exc)
    match = _LEADING.match(message)
    if match is None:
        return
    where = source.describe_document(int(match.group(1)))
    if where is None:
        return
    try:
        named = type(exc)(where + message[match.end() :])
    except Exception:  # an exception type that takes other arguments keeps its message
        return
    raise named from exc


def document_sources_of(node: Any) -> Any:
    """The ``document_sources`` method of the first stage with one :func:`~cpdata.nodes.epochs.upstream` of
    ``node`` (a mix), or None (no mix, or a stage says none can be named)."""
    for stage in upstream(node):
        if isinstance(stage, NamesSources):  # None: this stage knows no source can be named below it
            found = stage.document_sources
            return found if callable(found) else None
    return None


def name_mixed_overlong(exc: OverlongDocumentError, source: Any) -> None:
    """Re-raise an overlong draw of a :func:`cpdata.mix` named by its source and its index there."""
    sources = document_sources_of(source)
    overlong = exc.overlong
    if sources is None or overlong is None:
        return
    names, index = sources(np.array([overlong.index], dtype=np.int64))
    where = (f"draw {overlong.index} of the mix" if index[0] < 0
             else f"document {int(index[0])} of mix source {names[0]!r}")  # fmt: skip
    hint = (f"(draw {overlong.index} of the mixed stream.) A mix checks each document when it draws it; to name "
            "every overlong document of a source at once, check that source's lengths first (cpdata.plan_lengths("
            "lengths, capacity=..., layout=..., cp_size=...) raises naming them all)")  # fmt: skip
    raise OverlongDocumentError(overlong.message(where, hint), overlong=overlong) from None
