"""The worker pipeline as torchdata nodes, one stage per module, and its assembly into loaders.

Each stage implements ``next()``, ``reset(initial_state)``, ``get_state()`` with a versioned state that
refuses another configuration. In pipeline order: ``tokenize`` (optional) / ``mix`` + ``mix_readers``
(optional; ``mixed``: a mix as an indexable dataset) -> ``source`` (``Documents``, with
``source_kinds``, ``source_windows``, ``validate``, ``shuffle_buffer``, ``window``) ->
``pack`` (with ``live_pieces``, ``state_copy``), or planned packs served by ``served`` (``scheduled``,
``windowed``, :mod:`cpdata.offline.reader`) -> ``collate`` -> ``shard``. Assembly: ``options`` (the option records),
``loader`` (``build_loader``, pinning), ``dataset`` (``CPDataset``), ``dataloader`` (``CPDataLoader``).
Runtime helpers: ``epochs``, ``state_version``, ``worker_process`` (a kept heap, death with the parent).
"""

from __future__ import annotations

from cpdata.errors import lazy_exports

_EXPORTS: dict[str, str] = {
    "Collate": "cpdata.nodes.collate",
    "Documents": "cpdata.nodes.source",
    "Mix": "cpdata.nodes.mix",
    "Pack": "cpdata.nodes.pack",
    "PrecomputedPacks": "cpdata.offline.reader",
    "ShardForRank": "cpdata.nodes.shard",
    "Tokenize": "cpdata.nodes.tokenize",
    "maybe_pin": "cpdata.nodes.loader",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
