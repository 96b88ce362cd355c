"""Source identity: refuse resuming or serving a plan onto other data, and notice data that changes under a run.

``fingerprint()`` and ``check_unchanged()`` of any source: the :class:`~cpdata.sources.protocol.Identified`
and :class:`~cpdata.sources.protocol.Watched` members of the source protocol (its table says when cpdata asks
them). Each reader's docstring says what its fingerprint covers (docs/bring-your-data.md lists them); a plain
list is fingerprinted here from its count and :data:`LIST_SAMPLES` sampled items' ``input_ids``, anything else
by its type only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from cpdata.sources.protocol import Identified, Watched

__all__ = ["LIST_SAMPLES", "check_source_unchanged", "lengths_sha256", "sample_digest", "sample_positions",
           "source_fingerprint", "source_identity"]

LIST_SAMPLES = 16
"""Items of an in-memory list whose ``input_ids`` the fingerprint hashes."""


def sample_positions(n: int, k: int) -> list[int]:
    """Up to ``k`` evenly spaced indices of ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({(s * (n - 1)) // max(k - 1, 1) for s in range(k)})


def lengths_sha256(lengths: np.ndarray) -> str:
    """Hex sha256 of int64 ``[n]`` document lengths as little-endian int64: what a plan made from lengths binds to."""
    h = hashlib.sha256()
    for s in range(0, lengths.shape[0], 1 << 20):
        h.update(np.ascontiguousarray(lengths[s : s + (1 << 20)], dtype="<i8").tobytes())
    return h.hexdigest()


def source_identity(source: Any, lengths: np.ndarray | None = None) -> str:
    """The one identity a resume or a plan binds to: the source's fingerprint (its type when it offers none),
    with the sha256 of the ``lengths`` a schedule was planned from."""
    fingerprint = source_fingerprint(source) or type(source).__name__
    return fingerprint if lengths is None else f"{fingerprint}|lengths:{lengths_sha256(lengths)}"


def _item_bytes(item: Any) -> bytes:
    """What an in-memory item contributes: its ``input_ids`` bytes, or its type for anything else (never raises)."""
    ids = item.get("input_ids") if isinstance(item, Mapping) else None
    if ids is None:
        return type(item).__name__.encode()
    try:
        if hasattr(ids, "detach"):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids)
        data = repr(arr.tolist()).encode() if arr.dtype.hasobject else arr.tobytes()  # not pointers
        return f"{arr.dtype.str}{arr.shape}".encode() + data
    except Exception:
        return type(ids).__name__.encode()


def sample_digest(items: Any, n: int, prefix: str = "") -> str:
    """blake2b of ``prefix`` and the ``input_ids`` of :data:`LIST_SAMPLES` evenly spaced items of ``items[:n]``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prefix.encode())
    for i in sample_positions(n, LIST_SAMPLES):
        h.update(f"|{i}|".encode())
        h.update(_item_bytes(items[i]))
    return h.hexdigest()


def _list_fingerprint(items: list | tuple) -> str:
    return f"list:{len(items)}:{sample_digest(items, len(items), f'list:{len(items)}')}"


def source_fingerprint(source: Any) -> str | None:
    """The source's fingerprint, or None when it offers none."""
    if isinstance(source, Identified):
        return str(source.fingerprint())
    if type(source) in (list, tuple):  # exactly: a subclass may read lazily or count reads
        return _list_fingerprint(source)
    return None


def check_source_unchanged(source: Any, opened: str | None) -> None:
    """Raise ``ValueError`` if ``source`` changed since its fingerprint was ``opened`` (its own
    ``check_unchanged()``; a list re-fingerprinted)."""
    if type(source) in (list, tuple):  # re-fingerprinted here (never Watched: no protocol walk)
        now = None if opened is None else _list_fingerprint(source)
        if now != opened:
            raise ValueError(
                f"the source list changed since it was first read (fingerprint {opened} -> {now}: items "
                "replaced, added or removed, or their input_ids edited in place); a running pipeline must see "
                "the same documents every epoch: build a new loader for new data"
            )
    elif isinstance(source, Watched):
        source.check_unchanged()
