"""Offline packing: plan a whole dataset ahead of training, serve it with O(1) resume, inspect it.

The same planner as the live ``Pack`` node, run over every length: ``precompute_plan`` (``precompute``) writes a
versioned ``store``, ``reader`` (``PrecomputedPacks``, ``PrecomputedDataset``) serves it, ``metrics``
and ``inspect_cli`` (with its drawing) describe it; ``tokenize_files`` turns JSONL into token stores (``cpdata
tokenize``, ``cpdata pack-store``), ``precompute_cli`` is ``cpdata precompute``, ``progress`` reports. Names
are imported lazily, so the command line does not pull in torch.
"""

from __future__ import annotations

from cpdata.errors import lazy_exports

_EXPORTS: dict[str, str] = {
    "PackStore": "cpdata.offline.store",
    "PrecomputedDataset": "cpdata.offline.reader",
    "PrecomputedPacks": "cpdata.offline.reader",
    "precompute": "cpdata.offline.precompute_plan",
    "read_store": "cpdata.offline.store",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
