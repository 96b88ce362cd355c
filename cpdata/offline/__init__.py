"""Offline packing: plan a whole dataset ahead of training, serve it with O(1) resume.

::

    cpdata precompute data.jsonl --capacity 8192 --cp-size 4 --layout thd --out plan/
    cpdata inspect plan/ --plot pack0.png

    docs = open_dataset("data.jsonl")
    plans = PrecomputedPacks("plan/", docs, cp_size=4, layout="thd")
    batches = ShardForRank(Collate(plans), cp_size=4, cp_rank=r, layout="thd")

Role: the offline half of the worker side. It runs the same planner as the
live ``Pack`` node over a whole dataset (read through :mod:`cpdata.sources`),
writes the plan as a versioned directory, and serves it back as a node.

Modules, in pipeline order: ``tokenize_files`` / ``tokenstore_cli`` (``cpdata
tokenize`` / ``pack-store``: text to a token store), ``progress`` (progress
lines), ``precompute_plan`` (``precompute``: planning + writing) and ``precompute_cli`` (``cpdata
precompute``), ``store`` (the plan directory format), ``reader``
(``PrecomputedPacks``, the node serving a plan), ``precomputed_dataset`` (a plan
for ``StatefulDataLoader`` workers), ``metrics`` / ``summary`` / ``plot`` /
``inspect_cli`` (``cpdata inspect``).

Names are imported lazily, so the command line (``precompute``, ``inspect``)
does not pull in torch.
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

