"""What every adapter reads from a batch: its tensors, its ``ShardLayout`` and its host-side ``info``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from cpdata.layout.shard_layout import ShardLayout

__all__ = ["batch_parts", "check_cp_group", "info_int"]


def batch_parts(
    batch: Any, tensors: Mapping[str, torch.Tensor] | None = None
) -> tuple[Mapping[str, torch.Tensor], ShardLayout, Mapping[str, Any]]:
    """``(tensors, layout, info)`` of a :class:`~cpdata.worker.batch.ShardedBatch`.

    ``tensors`` replaces the batch's own tensors when given: the same batch on
    the device as :meth:`ContextParallelSharder.shard` returns it (a plain
    dict, without ``.layout``/``.info``).
    """
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
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"batch.info[{key!r}] is {value!r}, expected a Python int; batches from cpdata's ShardForRank "
            "(build_loader, CPDataset, PrecomputedPacks) carry it"
        )
    return value


def check_cp_group(group: Any, layout: ShardLayout) -> None:
    """``ValueError`` unless ``group`` (None = the default group) is the CP group ``layout`` was built for."""
    if layout.cp_size == 1:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"the batch is sharded over cp_size={layout.cp_size} ranks but no process group is initialized; "
            "call torch.distributed.init_process_group and pass the CP group"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (layout.cp_size, layout.cp_rank):
        which = "group=None (the default group of every rank)" if group is None else "the group passed"
        raise ValueError(
            f"the batch was sharded for cp_size={layout.cp_size}, cp_rank={layout.cp_rank} but {which} has "
            f"size {size} and this process is rank {rank} in it; pass the CP group the pipeline was built for: "
            "group=mesh['cp'].get_group() on a (dp, cp) DeviceMesh (cp_mesh.get_group() on a 1-D one)"
        )
