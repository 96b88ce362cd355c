"""How a document source is read and restarted: its kind, a restart at a position, read errors.

Shared by :class:`~cpdata.nodes.source.Documents` and the other readers of user
sources (tokenizing, mixing, scheduled packs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torchdata.nodes import BaseNode

__all__ = ["reading_error", "restart_iterable", "source_kind", "with_index"]


def source_kind(source: Any, items: str = "document dicts") -> str:
    """How a source is read and resumed (the module table): ``"node"``, ``"sequence"`` or ``"iterable"``.

    Raises:
        TypeError: a string, a mapping, a one-shot iterator (it cannot be
            restarted for resume or a new epoch) or something not iterable.
    """
    if isinstance(source, BaseNode):
        return "node"
    if isinstance(source, (str, bytes, Mapping)):
        raise TypeError(f"source must be a sequence or iterable of {items}, got {type(source).__name__}")
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return "sequence"
    if isinstance(source, Iterator):
        raise TypeError(
            f"source is a one-shot iterator ({type(source).__name__}) that cannot be restarted for resume "
            "or a new epoch; pass a list, a re-iterable (an object whose __iter__ returns a fresh "
            "iterator) or a torchdata BaseNode"
        )
    if isinstance(source, Iterable):
        return "iterable"
    raise TypeError(f"source must be a sequence or iterable of {items}, got {type(source).__name__}")


def restart_iterable(source: Iterable[Any], position: int, items: str = "documents") -> Iterator[Any]:
    """A fresh iterator over ``source`` with its first ``position`` items read and dropped (resume)."""
    it = iter(source)
    for skipped in range(position):
        try:
            next(it)
        except StopIteration:
            raise ValueError(
                f"the saved state has read {position} {items} but the source ends after {skipped}; "
                "restore onto the same source"
            ) from None
    return it


def with_index(exc: Exception, index: int) -> Exception:
    """``exc``'s type with the document index in the message (RuntimeError if not constructible)."""
    return reading_error(exc, f"reading document {index} from the source failed")


def reading_error(exc: Exception, what: str) -> Exception:
    """``exc``'s type with ``what`` before its message (RuntimeError if the type is not constructible so)."""
    message = f"{what}: {type(exc).__name__}: {exc}"
    try:
        return type(exc)(message)
    except Exception:
        return RuntimeError(message)
