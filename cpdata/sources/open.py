"""``open_dataset``: a tokenized dataset on disk, readable by index without loading it whole; ``as_source``.

| path | reader |
|---|---|
| ``*.npy`` / ``*.npz`` of lengths | :class:`~cpdata.sources.files.LengthsFile` (no tokens) |
| ``*.jsonl`` | :class:`~cpdata.sources.files.JsonlDocuments` |
| a folder of ``*.npy`` | :class:`~cpdata.sources.files.NpyFolder` |
| a token store folder (``tokens.bin``) | :class:`~cpdata.sources.tokenstore.TokenStore` |
| a ``save_to_disk`` folder | :class:`~cpdata.sources.hf.HFDocuments` |
| a Megatron prefix (``PREFIX.bin`` + ``PREFIX.idx``) | :class:`~cpdata.sources.megatron.MegatronIndexed` |
| a list of any of these | :class:`~cpdata.sources.concat.ConcatDataset` |
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpdata.sources.base import TokenizedDataset
from cpdata.sources.concat import ConcatDataset
from cpdata.sources.files import JsonlDocuments, LengthsFile, NpyFolder
from cpdata.sources.hf import HFDocuments, is_hf_dataset
from cpdata.sources.megatron import MegatronIndexed, is_megatron_prefix
from cpdata.sources.protocol import Listable
from cpdata.sources.tokenstore import TokenStore, is_token_store

__all__ = ["as_source", "open_dataset"]


def as_source(source: Any, *, indexed: bool = False, epochs: int = 1) -> Any:
    """The one normalization of a user source, done once where a node or planner takes it.

    A ``datasets.Dataset`` becomes :class:`~cpdata.sources.hf.HFDocuments`. With ``indexed=True`` (callers that
    address documents by index: schedules, ``precompute``, ``PrecomputedPacks``) a streaming
    ``IterableDataset`` is refused with the fix and a :class:`~cpdata.sources.protocol.Listable` mix becomes its
    draw listing of epochs ``0 .. epochs - 1``. Anything else is returned as is."""
    if is_hf_dataset(source) or (indexed and is_hf_dataset(source, "IterableDataset")):
        return HFDocuments(source)
    if indexed and isinstance(source, Listable):
        return source.listed(epochs)
    return source


def open_dataset(
    path: str | os.PathLike[str] | list[str | os.PathLike[str]] | tuple[str | os.PathLike[str], ...],
    *,
    on_progress: Callable[[int], None] | None = None,
) -> TokenizedDataset:
    """Open a tokenized dataset, choosing the reader from the path (module table); a list of paths reads them
    as one, in order. ``on_progress(n)`` is called while scanning (bytes of JSONL, files of a folder)."""
    if isinstance(path, (list, tuple)):
        return ConcatDataset([open_dataset(part, on_progress=on_progress) for part in path])
    p = Path(path)
    if p.is_dir():
        if is_token_store(p):
            return TokenStore(p)
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            import datasets

            return HFDocuments(datasets.load_from_disk(str(p)))
        return NpyFolder(p, on_progress=on_progress)
    if is_megatron_prefix(p):
        return MegatronIndexed(p)
    if not p.exists():
        raise ValueError(f"dataset {str(p)!r} does not exist; pass a .npy/.npz of lengths, a .jsonl file, a folder "
                         "or the prefix of a Megatron PREFIX.bin/PREFIX.idx pair")
    if p.suffix in (".npy", ".npz"):
        return LengthsFile(p)
    if p.suffix == ".jsonl":
        return JsonlDocuments(p, on_progress=on_progress)
    raise ValueError(
        f"unknown dataset format for {str(p)!r} (suffix {p.suffix!r}); pass a .npy/.npz of document lengths, "
        "a .jsonl file of {'input_ids': [...]} rows, or a folder of .npy token arrays"
    )
