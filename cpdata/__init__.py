"""cpdata: context-parallel batch preparation on dataloader workers.

Workers pack documents, lay them out for a CP backend and hand each CP rank only its tokens and their
:class:`ShardLayout`; on the device :func:`gather_token_tensor` is the one differentiable gather. Attributes are
imported lazily, so ``import cpdata.gather`` pulls in torch alone and spawned ranks start fast.
"""

from __future__ import annotations

from cpdata.errors import lazy_exports

_HOMES: dict[str, tuple[str, ...]] = {
    "cpdata.device.consistency": ("all_ranks_have_batch", "verify_layout_consistency"),
    "cpdata.device.cp_attention": ("ContextParallelAttention",),
    "cpdata.device.kv_exchange": ("exchange_tokens", "exchanged_key_positions"),
    "cpdata.gather": ("gather_token_tensor",),
    "cpdata.layout.maps": ("LAYOUTS", "alignment", "inverse_indices", "rank_indices"),
    "cpdata.layout.shard_layout": ("ShardLayout",),
    "cpdata.nemo.sharder": ("ContextParallelSharder",),
    "cpdata.nodes.collate": ("Collate",),
    "cpdata.nodes.dataloader": ("CPDataLoader",),
    "cpdata.nodes.dataset": ("CPDataset",),
    "cpdata.nodes.loader": ("build_loader", "build_node", "close_loader", "closing_loader", "maybe_pin"),
    "cpdata.nodes.mix": ("Mix", "mix"),
    "cpdata.nodes.options": ("DataPolicy", "Delivery", "SchedulePlan", "StreamPlan"),
    "cpdata.nodes.pack": ("Pack",),
    "cpdata.nodes.shard": ("ShardForRank",),
    "cpdata.nodes.source": ("Documents",),
    "cpdata.nodes.tokenize": ("Tokenize",),
    "cpdata.nodes.worker_process": ("exit_with_parent", "keep_heap"),
    "cpdata.offline.precompute_plan": ("precompute",),
    "cpdata.offline.reader": ("PrecomputedDataset", "PrecomputedPacks"),
    "cpdata.packing": ("PackingResult", "PackingStats", "plan_lengths"),
    "cpdata.schedule": ("CostModel", "Schedule", "plan_schedule"),
    "cpdata.sources.base": ("TokenizedDataset",),
    "cpdata.sources.open": ("open_dataset",),
    "cpdata.worker.batch": ("ShardedBatch",),
    "cpdata.worker.collate": ("CollatedPack", "collate_pack", "collate_rank"),
    "cpdata.worker.plan": ("DocPiece", "Document", "PackPlan"),
}
"""Module -> the public names it is the home of."""
_EXPORTS: dict[str, str] = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_EXPORTS)
__version__ = "0.3.0"

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
