"""Source fingerprints: refuse resuming onto other data, and notice data that changes under a run.

Two questions, two members of the source protocol (:class:`~cpdata.sources.protocol.Identified`,
:class:`~cpdata.sources.protocol.Watched`):

| hook | question | when cpdata asks |
|---|---|---|
| ``fingerprint() -> str`` | is this the dataset the state was saved on? (stable across machines: no paths, no mtimes) | saved in every ``Documents`` state, compared on restore |
| ``check_unchanged() -> None`` | did the data change since it was opened? (``ValueError`` naming what changed) | every epoch start and every restore |

What each source gives:

| source | fingerprint | changes noticed |
|---|---|---|
| :class:`~cpdata.sources.JsonlDocuments` | sha256 of the file (computed while scanning it) | size (rows appended or cut: refused at the next epoch), sampled rows re-hashed when the mtime moved; every row read is checked against its CRC-32 from the scan (an edited document raises naming file, document and byte offset) |
| :class:`~cpdata.sources.NpyFolder` | file count, names, sizes, sampled files' bytes | files added or removed; every file read is checked against the size and mtime seen at open |
| :class:`~cpdata.sources.LengthsFile` | sha256 of the lengths | size/mtime moved and lengths differ |
| :class:`~cpdata.sources.tokenstore.TokenStore` | the manifest digest (covers every file's sha256 and 1 MiB chunk checksums) | the manifest rewritten, a file resized; every chunk is checked against its checksum the first time a process reads it (an edited token raises naming file, byte range and document) |
| :class:`~cpdata.sources.megatron.MegatronIndexed` (``PREFIX.bin`` + ``PREFIX.idx``) | sha256 of the ``.idx`` + the ``.bin``'s size and 64 sampled 4 KiB blocks | a file resized; sampled blocks of both files re-read when an mtime moved |
| :class:`~cpdata.sources.concat.ConcatDataset` (``open_dataset([...])``) | every part's fingerprint, in order | every part asked, the error naming it |
| :class:`~cpdata.sources.hf.HFDocuments` (a ``datasets.Dataset``) | its ``_fingerprint``, rows, columns, features + the ``input_ids`` values of 16 evenly spaced rows | an Arrow cache file resized, a sampled row's values changed |
| :func:`cpdata.mix` (``Mix``) | the configuration + every source's fingerprint (a source without one: its kind and length) | every source asked, the error naming it |
| a plain ``list``/``tuple`` of dicts | count + ``input_ids`` of up to 16 evenly spaced items | the same sample, re-hashed each epoch |
| anything else | none (only the length is compared, as before) | nothing |

A precomputed plan is named by its manifest sha256 (``PrecomputedPacks``
state), re-read from disk at each epoch. Other sources plug in by
implementing the two methods.

Cost: ``fingerprint`` is computed once per node; ``check_unchanged`` is one
``stat`` per epoch for files (plus 64 sampled rows when the mtime moved), 16
array hashes for lists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from cpdata.sources.protocol import Identified, Watched

__all__ = ["LIST_SAMPLES", "check_source_unchanged", "lengths_sha256", "sample_positions", "source_fingerprint",
           "source_identity"]

LIST_SAMPLES = 16
"""Items of an in-memory list whose ``input_ids`` the fingerprint hashes."""


def sample_positions(n: int, k: int) -> list[int]:
    """Up to ``k`` evenly spaced indices of ``range(n)``, first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({(s * (n - 1)) // (k - 1) for s in range(k)})


def lengths_sha256(lengths: np.ndarray) -> str:
    """Hex sha256 of int64 ``[n]`` document lengths as little-endian int64 (hashed 1M at a time): what a plan
    made from lengths is bound to (a precomputed manifest's ``lengths_sha256``, a schedule's state)."""
    h = hashlib.sha256()
    for s in range(0, lengths.shape[0], 1 << 20):
        h.update(np.ascontiguousarray(lengths[s : s + (1 << 20)], dtype="<i8").tobytes())
    return h.hexdigest()


def source_identity(source: Any, lengths: np.ndarray | None = None) -> str:
    """The one identity a resume or a plan is bound to: the source's fingerprint (:func:`source_fingerprint`;
    its kind when it offers none), with the sha256 of the ``lengths`` a schedule was planned from."""
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
        return f"{arr.dtype.str}{arr.shape}".encode() + arr.tobytes()
    except Exception:
        return type(ids).__name__.encode()


def _list_fingerprint(items: list | tuple) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"list:{len(items)}".encode())
    for i in sample_positions(len(items), LIST_SAMPLES):
        h.update(f"|{i}|".encode())
        h.update(_item_bytes(items[i]))
    return f"list:{len(items)}:{h.hexdigest()}"


def source_fingerprint(source: Any) -> str | None:
    """The source's identity (see the module table), or None when it offers none."""
    if isinstance(source, Identified):
        return str(source.fingerprint())
    if type(source) in (list, tuple):  # exactly: a subclass may read lazily or count reads
        return _list_fingerprint(source)
    return None


def check_source_unchanged(source: Any, opened: str | None) -> None:
    """Raise ``ValueError`` if ``source`` changed since its fingerprint was ``opened``.

    Calls the source's ``check_unchanged()`` hook when it has one; an
    in-memory list is re-fingerprinted and compared with ``opened``.
    """
    if isinstance(source, Watched):
        source.check_unchanged()
        return
    if opened is not None and type(source) in (list, tuple):
        now = _list_fingerprint(source)
        if now != opened:
            raise ValueError(
                f"the source list changed since it was first read (fingerprint {opened} -> {now}: items "
                "replaced, added or removed, or their input_ids edited in place); a running pipeline must see "
                "the same documents every epoch: build a new loader for new data"
            )
