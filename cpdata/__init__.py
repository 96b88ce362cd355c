"""cpdata: context-parallel batch preparation on dataloader workers.

Workers pack documents, lay them out for a CP backend and hand each CP rank only its tokens and their
:class:`ShardLayout`; on the device :func:`gather_token_tensor` is the one differentiable gather. Attributes are
imported lazily, so ``import cpdata.gather`` pulls in torch alone and spawned ranks start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "CPDataLoader": "cpdata.nodes.dataloader",
    "CPDataset": "cpdata.nodes.dataset",
    "Collate": "cpdata.nodes.collate",
    "CollatedPack": "cpdata.worker.collated",
    "ContextParallelAttention": "cpdata.device.cp_attention",
    "ContextParallelSharder": "cpdata.nemo.sharder",
    "CostModel": "cpdata.schedule",
    "DataPolicy": "cpdata.nodes.options",
    "Delivery": "cpdata.nodes.options",
    "DocPiece": "cpdata.worker.plan",
    "Document": "cpdata.worker.plan",
    "Documents": "cpdata.nodes.source",
    "LAYOUTS": "cpdata.layout.maps",
    "Mix": "cpdata.nodes.mix",
    "Pack": "cpdata.nodes.pack",
    "PackPlan": "cpdata.worker.plan",
    "PackingResult": "cpdata.packing",
    "PackingStats": "cpdata.packing",
    "PrecomputedDataset": "cpdata.offline.precomputed_dataset",
    "PrecomputedPacks": "cpdata.offline.reader",
    "Schedule": "cpdata.schedule",
    "SchedulePlan": "cpdata.nodes.options",
    "ShardForRank": "cpdata.nodes.shard",
    "ShardLayout": "cpdata.layout.shard_layout",
    "ShardedBatch": "cpdata.worker.batch",
    "StreamPlan": "cpdata.nodes.options",
    "Tokenize": "cpdata.nodes.tokenize",
    "TokenizedDataset": "cpdata.sources.base",
    "alignment": "cpdata.layout.maps",
    "all_ranks_have_batch": "cpdata.device.consistency",
    "build_loader": "cpdata.nodes.loader",
    "build_node": "cpdata.nodes.loader",
    "close_loader": "cpdata.nodes.loader",
    "closing_loader": "cpdata.nodes.loader",
    "collate_pack": "cpdata.worker.collate",
    "collate_rank": "cpdata.worker.collate",
    "exchange_tokens": "cpdata.device.kv_exchange",
    "exchanged_key_positions": "cpdata.device.kv_exchange",
    "exit_with_parent": "cpdata.nodes.orphans",
    "gather_token_tensor": "cpdata.gather",
    "inverse_indices": "cpdata.layout.maps",
    "keep_heap": "cpdata.nodes.heap",
    "maybe_pin": "cpdata.nodes.pin",
    "mix": "cpdata.nodes.mix",
    "open_dataset": "cpdata.sources.open",
    "plan_lengths": "cpdata.packing",
    "plan_schedule": "cpdata.schedule",
    "precompute": "cpdata.offline.precompute_plan",
    "rank_indices": "cpdata.layout.maps",
    "verify_layout_consistency": "cpdata.device.consistency",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.3.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
