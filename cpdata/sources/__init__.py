"""Sources: tokenized documents on disk and in memory, read by index (the formats cpdata reads and writes).

Below the nodes: each reader is a ``Sequence`` of ``{"input_ids": int64 [n], ...}`` with its lengths known up
front and a fingerprint, so planners work from lengths and resumes and plans refuse other data. Modules:
``protocol`` (what a source may offer), ``base`` (``TokenizedDataset``), ``files``, ``tokenstore`` (with
``tokenstore_writer``, ``chunksums``, ``manifest``), ``megatron`` (with ``megatron_writer``), ``hf``,
``concat``, ``open`` (``open_dataset``), ``fingerprint``, ``tokenizer`` (text to tokens), ``atomic``
(crash-safe directory writes).
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
