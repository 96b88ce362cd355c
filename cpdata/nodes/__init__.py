"""The worker pipeline as torchdata nodes, one stage per module, and its assembly into loaders.

Role: the stateful stages a dataloader worker runs (each implements ``next()``,
``reset(initial_state)``, ``get_state()``, with a versioned state that refuses
another configuration), built from the pure functions of :mod:`cpdata.worker`,
:mod:`cpdata.packing`, :mod:`cpdata.schedule` and the readers of
:mod:`cpdata.sources`.

Stages, in pipeline order: ``tokenize`` (``Tokenize``: text/chat rows, optional)
/ ``mix`` + ``mix_readers`` + ``mix_tokens`` (``Mix``: weighted sources, optional; by tokens) -> ``source``
(``Documents``, with ``source_kinds``, ``source_window``, ``validate``,
``document_names``, ``shuffle_buffer``, ``window``) -> ``pack`` (``Pack``, with
``live_pieces`` and ``state_copy``), or ``scheduled`` + ``scheduled_rows``
(``ScheduledPacks``: planned from lengths) or ``windowed`` (``WindowedPacks``),
plan rows served by ``served`` (``ServedPacks``) -> ``collate`` (``Collate``) -> ``shard`` (``ShardForRank``) -> ``pin``
(``maybe_pin``). Assembly: ``options`` (the option records: ``StreamPlan`` / ``SchedulePlan``,
``DataPolicy``, ``Delivery``), ``mixed`` (a ``Mix`` as an indexable dataset for
planning), ``loader`` (``build_node`` / ``build_loader``), ``dataset``
(``CPDataset`` for ``StatefulDataLoader``), ``dataloader`` (``CPDataLoader``).
Runtime helpers: ``state_version`` (the checks before a restore), ``epochs``
(the one epoch clock, and setting a graph's epoch), ``heap``
(workers keep their freed heap), ``orphans`` (workers exit with their parent).
The precomputed-plan reader, ``PrecomputedPacks``, lives in :mod:`cpdata.offline.reader`.
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
