"""The pre-sharded path of ``shard_batch``: a worker batch checked against the mesh and moved.

A worker batch (a Mapping carrying ``.layout``) holds this rank's tokens, checked on the worker; two O(1)
facts remain (the layout's CP size and rank), then a :class:`~cpdata.worker.batch.ShardedBatch` moves as one
buffer copy (``non_blocking``), a plain Mapping key by key. Also: the mesh helpers and what
every model adapter reads from a worker batch (:func:`batch_parts`, :func:`info_int`: host-side lengths from
``batch.info``, so no ``.item()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.errors import is_int
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.batch import ShardedBatch

__all__ = [
    "PreshardedMove", "batch_parts", "info_int", "is_presharded", "mesh_group", "mesh_rank_size", "to_device",
]  # fmt: skip


def mesh_rank_size(cp_mesh: Any) -> tuple[int, int]:
    """``(cp_rank, cp_size)`` of a CP (sub)mesh; ``(0, 1)`` without one."""
    if cp_mesh is None:
        return 0, 1
    return int(cp_mesh.get_local_rank()), int(cp_mesh.size())


def mesh_group(cp_mesh: Any) -> Any:
    """The CP process group of a mesh; None (the default group) for a mesh without groups (one process)."""
    get_group = getattr(cp_mesh, "get_group", None)
    return get_group() if get_group is not None else None


def is_presharded(batch: Any) -> bool:
    """A worker-sharded batch: a Mapping carrying ``.layout`` (a ShardLayout)."""
    return isinstance(batch, Mapping) and isinstance(getattr(batch, "layout", None), ShardLayout)


def to_device(value: Any, device: torch.device | None) -> Any:
    """``value`` moved to ``device`` (``non_blocking``) when it is a tensor and a device is given, else itself."""
    if device is None or not isinstance(value, torch.Tensor):
        return value
    return value.to(device, non_blocking=True)


class PreshardedMove:
    """``move(batch)`` -> ``(ctx_factory, tensors on device, layout)`` of a worker-sharded batch after the two
    mesh checks, the mesh's facts read once; ``mesh_dims``: the dim names of the device mesh the CP mesh was
    taken from (errors only)."""

    __slots__ = ("_cp_mesh", "_device", "_group", "_mesh_dims", "_rank", "_size")

    def __init__(self, cp_mesh: Any, device: torch.device | None, mesh_dims: Any = None) -> None:
        self._cp_mesh, self._device, self._mesh_dims = cp_mesh, device, mesh_dims
        self._rank, self._size = mesh_rank_size(cp_mesh)
        self._group: Any = self  # self = not read yet (the mesh's group is read on the first batch at cp > 1)

    def __call__(self, batch: Mapping[str, Any]) -> tuple[Callable[..., Any], dict[str, Any], ShardLayout]:
        layout: ShardLayout = batch.layout
        if layout.cp_size != self._size or layout.cp_rank != self._rank:
            self._refuse(layout)
        if isinstance(batch, ShardedBatch):  # checked on the worker: one buffer move, views rebuilt by plan
            out = (batch if self._device is None else batch.to(self._device, non_blocking=True)).tensors()
        else:
            out = {k: to_device(v, self._device) for k, v in batch.items()}
        if self._size <= 1:
            return contextlib.nullcontext, out, layout
        if self._group is self:
            self._group = mesh_group(self._cp_mesh)
        return AttentionContextFactory.of_batch(layout, self._group, out), out, layout

    def _refuse(self, layout: ShardLayout) -> None:
        size, rank = self._size, self._rank
        if layout.cp_size != size and self._cp_mesh is None:
            dims = f" (its dims: {tuple(self._mesh_dims)})" if self._mesh_dims else ""
            raise ValueError(
                f"pre-sharded batch was laid out for cp_size={layout.cp_size} but the sharder has no CP "
                f"mesh: the device mesh has no dimension named 'cp'{dims}, or none was given, so the sharder "
                "runs at cp_size=1; name the context-parallel dimension 'cp' (init_device_mesh(..., "
                "mesh_dim_names=(..., 'cp'))) or pass the CP submesh (the pipeline's "
                f"cp_size={layout.cp_size} is right if that dimension has {layout.cp_size} ranks)"
            )
        if layout.cp_size != size:
            raise ValueError(
                f"pre-sharded batch was laid out for cp_size={layout.cp_size} but the CP mesh has "
                f"cp_size={size}; build the data pipeline with cp_size={size}"
            )
        raise ValueError(
            f"pre-sharded batch holds the tokens of cp_rank={layout.cp_rank} but this process is "
            f"cp_rank={rank}; give each rank's pipeline its own CP rank (the CP mesh's local rank)"
        )


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

