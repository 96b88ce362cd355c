"""Errors about a document, named where the document came from.

A validation error names a document by its index in the stream being read
(``"document 7: 'input_ids' must be >= 0 ..."``). For a :func:`cpdata.mix`
that index is a position in the mixed stream, which the user cannot look up:
the document is document 3 of source ``'b'``. A source that knows where its
documents came from has ``describe_document(index) -> str | None`` (the mix
node, :class:`~cpdata.nodes.mixed.MixedDataset`), and the stages that
validate documents rename the error with it::

    try:
        document = to_document(item, index, ...)
    except (TypeError, ValueError) as exc:
        name_document_error(exc, source)
        raise

Cost: nothing until an error (a ``try`` block); then one description.
"""

from __future__ import annotations

import re
from typing import Any

from cpdata.sources.protocol import Described, NamesSources

__all__ = ["document_sources_of", "name_document_error"]

_LEADING = re.compile(r"document (\d+)")


def name_document_error(exc: BaseException, source: Any) -> None:
    """Raise ``exc``'s type with its leading ``"document {index}"`` replaced by ``source.describe_document(index)``.

    Returns without raising when ``source`` describes no documents, the message does
    not start with ``"document {index}"``, or the description is None (the caller then
    re-raises ``exc`` unchanged).
    """
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


def document_sources_of(node: Any, depth: int = 16) -> Any:
    """The ``document_sources`` method of the first object with one down ``node``'s chain of ``.source`` /
    ``.documents`` attributes (a mix: :meth:`cpdata.nodes.mix.Mix.document_sources`,
    :meth:`cpdata.nodes.mixed.MixedDataset.document_sources`), or None (no mix: documents are named by
    their index in the one source, or a stage says none can be named: its ``document_sources`` is None)."""
    seen: set[int] = set()
    while node is not None and depth and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, NamesSources):  # None: this stage knows no source can be named below it
            found = node.document_sources
            return found if callable(found) else None
        nxt = getattr(node, "source", None)
        node = getattr(node, "documents", None) if nxt is None else nxt
        depth -= 1
    return None
