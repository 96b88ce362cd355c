"""Errors about a document, named where the document came from.

A validation error names a document by its index in the stream being read; in a :func:`cpdata.mix`
that is a position in the mixed stream. A source with ``describe_document(index)`` (the mix node,
:class:`~cpdata.nodes.mixed.MixedDataset`) lets the validating stages rename it: ``"document 3 of mix
source 'b' ..."`` (:func:`name_document_error`, nothing spent until an error).
"""

from __future__ import annotations

import re
from typing import Any

from cpdata.nodes.epochs import upstream
from cpdata.sources.protocol import Described, NamesSources

__all__ = ["document_sources_of", "name_document_error"]

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
