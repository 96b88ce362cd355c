"""Sources: tokenized documents on disk and in memory, read by index (the formats cpdata reads and writes).

Role: below the nodes; each reader is a ``Sequence`` of ``{"input_ids": int64 [n],
...}`` with its lengths known up front, a checksum and a fingerprint, so the
planner can work from lengths and resume can refuse other data.

Modules, in pipeline order: ``protocol`` (what a source may offer: lengths,
identity, unchanged-check, labels convention, document names; one
``typing.Protocol`` per capability), ``tokenizer`` (text and chat rows to token
documents), ``fingerprint`` (notice data that changed), ``manifest`` (canonical
JSON and digests of a format directory), ``atomic`` (crash-safe directory
writes), ``base`` (``TokenizedDataset``, ``DatasetSlice``), ``files`` (lengths
files, JSONL, ``.npy`` folders), ``concat`` (several datasets read as one:
shards), ``chunksums`` (per-chunk content checksums of a token store's files),
``tokenstore_writer`` (appending a token store), ``tokenstore`` (cpdata's binary
token store: reader, ``write_token_store``), ``megatron`` and ``megatron_writer``
(Megatron indexed datasets, ``PREFIX.bin`` + ``PREFIX.idx``, read in place and
written as megatron-core does), ``hf`` (Hugging Face ``datasets``), ``open``
(``open_dataset``: a reader chosen from a path; ``as_source``: the one
normalization of any accepted source).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ConcatDataset": "cpdata.sources.concat",
    "HFDocuments": "cpdata.sources.hf",
    "JsonlDocuments": "cpdata.sources.files",
    "LengthsFile": "cpdata.sources.files",
    "MegatronIndexed": "cpdata.sources.megatron",
    "NpyFolder": "cpdata.sources.files",
    "TokenStore": "cpdata.sources.tokenstore",
    "TokenizedDataset": "cpdata.sources.base",
    "atomic_directory": "cpdata.sources.atomic",
    "as_source": "cpdata.sources.open",
    "open_dataset": "cpdata.sources.open",
    "write_megatron": "cpdata.sources.megatron_writer",
    "write_token_store": "cpdata.sources.tokenstore",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
