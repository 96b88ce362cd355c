"""The worker pipeline as torchdata nodes, one stage per module.

``Tokenize`` (tokenize.py, text/chat rows, optional) / ``Mix`` (mix.py, weighted sources, optional) -> ``Documents`` (source.py) -> ``Pack`` (pack.py) -> ``Collate`` (collate.py)
-> ``ShardForRank`` (shard.py) -> ``maybe_pin`` (pin.py). The precomputed-plan
reader, ``PrecomputedPacks``, lives in ``cpdata.offline.reader``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "Collate": "cpdata.nodes.collate",
    "Documents": "cpdata.nodes.source",
    "Mix": "cpdata.nodes.mix",
    "Pack": "cpdata.nodes.pack",
    "PrecomputedPacks": "cpdata.offline.reader",
    "ShardForRank": "cpdata.nodes.shard",
    "Tokenize": "cpdata.nodes.tokenize",
    "maybe_pin": "cpdata.nodes.pin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpdata.nodes' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
