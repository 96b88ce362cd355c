"""Offline packing: plan a whole dataset ahead of training, serve it with O(1) resume, inspect it.

The same planner as the live ``Pack`` node, run over every length: ``precompute_plan`` (``precompute``) writes a
versioned ``store``, ``reader`` (``PrecomputedPacks``) and ``precomputed_dataset`` serve it, ``metrics``,
``summary``, ``plot`` and ``inspect_cli`` describe it; ``tokenize_files`` turns JSONL into token stores
(``cpdata tokenize``, ``cpdata pack-store``), ``precompute_cli`` is ``cpdata precompute``, ``progress``
reports. Names are imported lazily, so the command line does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "PackStore": "cpdata.offline.store",
    "PrecomputedDataset": "cpdata.offline.precomputed_dataset",
    "PrecomputedPacks": "cpdata.offline.reader",
    "precompute": "cpdata.offline.precompute_plan",
    "read_store": "cpdata.offline.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpdata.offline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

