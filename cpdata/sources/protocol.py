"""The source protocol: what a document source may offer, and the one entry point that normalizes a source.

A source is anything holding documents (dicts with ``input_ids``). Beyond being
read, it may offer any of these members; each group is a
:class:`typing.Protocol` of its own, and cpdata asks for one with ``isinstance``
(never by probing attribute names):

| protocol | members | what cpdata does with them |
|---|---|---|
| :class:`Indexed` | ``__len__``, ``__getitem__`` | reads document ``i`` directly; restarts at a position in O(1) |
| :class:`StatedLengths` | ``lengths`` (int64 ``[len]``) | plans packs (``schedule=``, ``precompute``, a token-weighted mix) before reading |
| :class:`Identified` | ``fingerprint() -> str`` | the one identity a resume and a plan bind to |
| :class:`Watched` | ``check_unchanged()`` | refuses data that changed, at every epoch start and restore |
| :class:`Labelled` | ``labels_alignment`` | the labels convention the source declares for the labels it carries |
| :class:`Described` | ``describe_document(i) -> str | None`` | errors about document ``i`` name it where it came from |
| :class:`Mixture` | ``counts``, ``skip_unread()`` | a mix's per-source counters; other ranks' draws passed unread |
| :class:`NamesSources` | ``document_sources(items)`` | batches name each document's source and its index there |
| :class:`Checked` | ``check_token_ids(v)``, ``verify_content()`` | ``precompute`` checks ids and stored bytes |
| :class:`Carried` | ``serves_tokens``, ``per_token_keys`` | lengths-only data refused where tokens are needed; labels found before reading |
| :class:`Listed` | ``epoch_starts`` | where each epoch of a mix's draw listing begins |
| :class:`Listable` | ``listed(epochs)`` | a mix written out as a sequence with lengths, for planners |

A :class:`~cpdata.sources.base.TokenizedDataset` offers most of them, :func:`cpdata.mix` the mixture's, a
plain list :class:`Indexed` (its fingerprint and lengths are computed here).
:func:`cpdata.sources.open.as_source` normalizes a user source, once. An ``isinstance`` on a runtime protocol
is slower than an attribute read: it is asked once per node, epoch or error, never per document.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cpdata.worker.targets import TARGET_KEYS

__all__ = ["SOURCE_MEMBERS", "Carried", "Checked", "Described", "Identified", "Indexed", "Labelled", "Listable", "Listed",
           "Mixture", "NamesSources", "StatedLengths", "Watched", "carried_targets", "declared_labels", "is_hf_dataset",
           "stated_lengths"]


@runtime_checkable
class Indexed(Protocol):
    """Documents addressed by index (a list, a map-style dataset, ``open_dataset(path)``)."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...


@runtime_checkable
class StatedLengths(Protocol):
    """An indexed source stating every document's token count up front."""

    lengths: np.ndarray


@runtime_checkable
class Identified(Protocol):
    """A source that names its data: stable across machines (no paths, no mtimes); :mod:`cpdata.sources.fingerprint`."""

    def fingerprint(self) -> str: ...


@runtime_checkable
class Watched(Protocol):
    """A source that can tell whether its data changed since it was opened (``ValueError`` naming what changed)."""

    def check_unchanged(self) -> None: ...


@runtime_checkable
class Labelled(Protocol):
    """A source declaring the labels convention of the labels and masks it carries (``"inputs"``/``"targets"``/None)."""

    labels_alignment: str | None


@runtime_checkable
class Described(Protocol):
    """A source that can say where document ``i`` came from (a mix: its source and index there), or None."""

    def describe_document(self, i: int) -> str | None: ...


@runtime_checkable
class Mixture(Protocol):
    """A mix of named sources (:class:`cpdata.nodes.mix.Mix`)."""

    counts: dict[str, dict[str, int]]

    def skip_unread(self) -> None: ...


@runtime_checkable
class NamesSources(Protocol):
    """A source (a mix, its listing) or a stage above one that says which source each document came from:
    ``document_sources(items) -> (names, index int64 [n])``; a stage whose ``document_sources`` is None says
    that no source can be named below it."""

    document_sources: Any


@runtime_checkable
class Checked(Protocol):
    """Stored data that checks its own token ids and its bytes against recorded checksums (``precompute``)."""

    def check_token_ids(self, vocab_size: int | None = None) -> None: ...
    def verify_content(self) -> None: ...


@runtime_checkable
class Carried(Protocol):
    """What a stored source's documents carry: tokens at all (False: lengths only), and per-token keys besides
    ``input_ids`` (``labels``, masks)."""

    serves_tokens: bool
    per_token_keys: frozenset[str]


@runtime_checkable
class Listed(Protocol):
    """Epochs of a mix's draws listed one after the other: epoch ``e`` is items ``epoch_starts[e]:epoch_starts[e + 1]``."""

    epoch_starts: np.ndarray


@runtime_checkable
class Listable(Protocol):
    """A stream (a mix) that can be written out as an indexed source with lengths, epochs ``0 .. epochs - 1``."""

    def listed(self, epochs: int) -> Any: ...


_PROTOCOLS = (Indexed, StatedLengths, Identified, Watched, Labelled, Described, Mixture, NamesSources, Checked, Carried,
              Listed, Listable)
SOURCE_MEMBERS: frozenset[str] = frozenset(
    name for p in _PROTOCOLS for name in (*p.__annotations__, *vars(p)) if not name.startswith("_")
)
"""Every member a source may offer (besides ``__len__``/``__getitem__``); asked for only through the protocols."""


def _list_lengths(items: list | tuple) -> np.ndarray | None:
    """``len(item["input_ids"])`` of every item, or None when one is not a dict with sized ids (the reader then
    names it when it gets there)."""
    out = np.empty(len(items), dtype=np.int64)
    for i, item in enumerate(items):
        ids = item.get("input_ids") if isinstance(item, Mapping) else None
        if isinstance(ids, (list, tuple)):
            out[i] = len(ids)
        elif getattr(ids, "ndim", None) == 1:  # numpy array, torch tensor
            out[i] = ids.shape[0]
        else:
            return None
    return out


def stated_lengths(source: Any) -> np.ndarray | None:
    """int64 ``[len(source)]`` token counts when the source states them up front: a :class:`StatedLengths`
    sequence's ``lengths`` (1-D integers, one per document), an in-memory ``list``/``tuple`` counted with one
    ``len`` per item; else None (a stream, a sequence without lengths, a list with a malformed item)."""
    if type(source) in (list, tuple):
        return _list_lengths(source)
    if not isinstance(source, Indexed) or not isinstance(source, StatedLengths) or source.lengths is None:
        return None
    lengths = np.asarray(source.lengths)
    if lengths.ndim != 1 or lengths.shape[0] != len(source) or lengths.dtype.kind not in "iu":
        return None
    return lengths.astype(np.int64, copy=False)


def is_hf_dataset(obj: object, kind: str = "Dataset") -> bool:
    """True for a map-style ``datasets.Dataset`` (checked without importing ``datasets``), or another ``kind``
    (``"IterableDataset"``: a streaming one)."""
    return (type(obj).__module__ or "").startswith("datasets.") and type(obj).__name__ == kind


def carried_targets(source: Any) -> frozenset[str] | None:
    """The label and mask keys (:data:`cpdata.worker.targets.TARGET_KEYS`) ``source``'s documents carry, known
    before reading: a :class:`Carried` source's stated keys, an in-memory ``list``/``tuple``'s items, a streaming
    ``datasets.IterableDataset``'s known columns; None when only reading would tell."""
    if type(source) in (list, tuple):
        return frozenset(k for item in source if isinstance(item, Mapping) for k in item if k in TARGET_KEYS)
    if isinstance(source, Carried):
        return source.per_token_keys & frozenset(TARGET_KEYS)
    if is_hf_dataset(source, "IterableDataset") and source.features is not None:
        return frozenset(source.features) & frozenset(TARGET_KEYS)
    return None


def declared_labels(source: Any) -> str | None:
    """The labels convention ``source`` declares (:class:`Labelled`), or None when it declares none."""
    return source.labels_alignment if isinstance(source, Labelled) else None
