"""What every adapter reads from a batch: its tensors, its ``ShardLayout`` and its host-side ``info``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cpdata.errors import is_int
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["batch_parts", "info_int"]


def batch_parts(
    batch: Any, tensors: Mapping[str, torch.Tensor] | None = None
) -> tuple[Mapping[str, torch.Tensor], ShardLayout, Mapping[str, Any]]:
    """``(tensors, layout, info)`` of a :class:`~cpdata.worker.batch.ShardedBatch`; ``tensors``, when given,
    replaces its tensors (the device copy ``ContextParallelSharder.shard`` returns, a plain dict)."""
    layout, info = getattr(batch, "layout", None), getattr(batch, "info", None)
    if not isinstance(layout, ShardLayout) or not isinstance(info, Mapping):
        raise TypeError(
            f"expected a cpdata ShardedBatch (a mapping with .layout and .info), got {type(batch).__name__}; "
            "pass the batch the loader yielded, and its device tensors as tensors= "
            "(e.g. the dict ContextParallelSharder.shard returns)"
        )
    return (batch if tensors is None else tensors), layout, info


def info_int(info: Mapping[str, Any], key: str) -> int:
    """``info[key]`` as a Python int; ``ValueError`` naming the producer when it is missing."""
    value = info.get(key)
    if not is_int(value):
        raise ValueError(
            f"batch.info[{key!r}] is {value!r}, expected a Python int; batches from cpdata's ShardForRank "
            "(build_loader, CPDataset, PrecomputedPacks) carry it"
        )
    return int(value)

