"""cpdata: context-parallel batch preparation on dataloader workers.

Workers pack documents, lay them out for a CP backend and hand each CP rank
only its own tokens plus the :class:`ShardLayout` that produced them; on the
device, :class:`ContextParallelSharder` moves them and does the one
differentiable gather.

Attributes are imported lazily, so ``import cpdata.gather`` (model code) pulls
in torch and nothing else, and spawned ranks start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "CPDataLoader": "cpdata.dataloader",
    "CPDataset": "cpdata.dataset",
    "Collate": "cpdata.nodes.collate",
    "CollatedPack": "cpdata.nodes.collate",
    "ContextParallelAttention": "cpdata.cp_attention",
    "ContextParallelSharder": "cpdata.sharder",
    "CostModel": "cpdata.schedule",
    "DocPiece": "cpdata.plan",
    "Document": "cpdata.plan",
    "Documents": "cpdata.nodes.source",
    "LAYOUTS": "cpdata.layouts",
    "Mix": "cpdata.nodes.mix",
    "Pack": "cpdata.nodes.pack",
    "PackPlan": "cpdata.plan",
    "PackingResult": "cpdata.packing",
    "PackingStats": "cpdata.packing",
    "PrecomputedDataset": "cpdata.offline.precomputed_dataset",
    "PrecomputedPacks": "cpdata.offline.reader",
    "Schedule": "cpdata.schedule",
    "ShardForRank": "cpdata.nodes.shard",
    "ShardLayout": "cpdata.shard_layout",
    "ShardedBatch": "cpdata.batch",
    "Tokenize": "cpdata.nodes.tokenize",
    "TokenizedDataset": "cpdata.offline.datasets",
    "alignment": "cpdata.layouts",
    "all_ranks_have_batch": "cpdata.consistency",
    "build_loader": "cpdata.loader",
    "build_node": "cpdata.loader",
    "close_loader": "cpdata.loader",
    "closing_loader": "cpdata.loader",
    "collate_pack": "cpdata.collate",
    "collate_rank": "cpdata.collate",
    "exit_with_parent": "cpdata.orphans",
    "gather_token_tensor": "cpdata.gather",
    "inverse_indices": "cpdata.layouts",
    "keep_heap": "cpdata.heap",
    "maybe_pin": "cpdata.nodes.pin",
    "mix": "cpdata.nodes.mix",
    "open_dataset": "cpdata.offline.datasets",
    "plan_lengths": "cpdata.packing",
    "plan_schedule": "cpdata.schedule",
    "precompute": "cpdata.offline.precompute",
    "rank_indices": "cpdata.layouts",
    "verify_layout_consistency": "cpdata.consistency",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
