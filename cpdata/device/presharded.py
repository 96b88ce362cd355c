"""The pre-sharded path of ``shard_batch``: a worker batch checked against the mesh and moved.

A worker-sharded batch (a Mapping carrying ``.layout``, normally a
:class:`~cpdata.worker.batch.ShardedBatch`) already holds this rank's tokens in local
order: the workers validated the documents, laid them out and checked every
row. On the device side only two facts remain to check, both O(1): the layout
was built for this mesh's CP size and for this rank. Then the batch moves as
one buffer copy (``non_blocking``) and its views are rebuilt from the span
plan it carries (:class:`cpdata.worker.buffer_spans.ViewPlan`); a plain Mapping with a
layout moves key by key. No padding, no index math, no per-key checks.

Also here: the mesh helpers every ``shard_batch`` uses (:func:`mesh_rank_size`,
:func:`mesh_group`) and the ctx factory ``shard()`` returns
(:func:`attention_ctx`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cpdata.device.cp_attention import AttentionContextFactory
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.batch import ShardedBatch
from cpdata.worker.keys import DOCUMENT_IDS

__all__ = [
    "PreshardedMove", "attention_ctx", "is_presharded", "mesh_group", "mesh_rank_size", "shard_presharded", "to_device",
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


def attention_ctx(cp_mesh: Any, layout: ShardLayout, tensors: Mapping[str, Any]) -> Callable[..., Any]:
    """The ctx factory ``shard()`` returns: ``nullcontext`` at cp <= 1, else CP attention over ``layout``.

    At cp > 1, ``ctx()`` makes SDPA on local Q/K/V attend over the whole
    sequence (:class:`cpdata.device.cp_attention.ContextParallelAttention`);
    ``ctx(document_mask=True)`` adds the document mask from the batch's
    ``document_ids``.
    """
    if layout.cp_size <= 1:
        return contextlib.nullcontext
    doc = tensors.get(DOCUMENT_IDS)
    return AttentionContextFactory(layout, mesh_group(cp_mesh), doc if isinstance(doc, torch.Tensor) else None)


def to_device(value: Any, device: torch.device | None) -> Any:
    """``value`` moved to ``device`` (``non_blocking``) when it is a tensor and a device is given, else itself."""
    if device is None or not isinstance(value, torch.Tensor):
        return value
    return value.to(device, non_blocking=True)


def _no_cp_mesh(layout: ShardLayout, mesh_dims: Any) -> ValueError:
    dims = f" (its dims: {tuple(mesh_dims)})" if mesh_dims else ""
    return ValueError(
        f"pre-sharded batch was laid out for cp_size={layout.cp_size} but the sharder has no CP mesh: the device "
        f"mesh has no dimension named 'cp'{dims}, or none was given, so the sharder runs at cp_size=1; name the "
        "context-parallel dimension 'cp' (init_device_mesh(..., mesh_dim_names=(..., 'cp'))) or pass the CP "
        f"submesh (the pipeline's cp_size={layout.cp_size} is right if that dimension has {layout.cp_size} ranks)"
    )


def shard_presharded(
    cp_mesh: Any, batch: Mapping[str, Any], device: torch.device | None, *, mesh_dims: Any = None
):
    """``(ctx_factory, tensors on device, layout)`` of a worker-sharded batch after the two mesh checks.

    ``mesh_dims``: the dim names of the device mesh the CP mesh was taken from (errors only).
    """
    layout: ShardLayout = batch.layout
    rank, size = mesh_rank_size(cp_mesh)
    if layout.cp_size != size and cp_mesh is None:
        raise _no_cp_mesh(layout, mesh_dims)
    if layout.cp_size != size:
        raise ValueError(
            f"pre-sharded batch was laid out for cp_size={layout.cp_size} but the CP mesh has cp_size={size}; "
            f"build the data pipeline with cp_size={size}"
        )
    if layout.cp_rank != rank:
        raise ValueError(
            f"pre-sharded batch holds the tokens of cp_rank={layout.cp_rank} but this process is cp_rank={rank}; "
            "give each rank's pipeline its own CP rank (the CP mesh's local rank)"
        )
    if isinstance(batch, ShardedBatch):  # the worker checked the tokens: one buffer move, views rebuilt by plan
        out = (batch if device is None else batch.to(device, non_blocking=True)).tensors()
    else:
        out = {k: to_device(v, device) for k, v in batch.items()}
    return attention_ctx(cp_mesh, layout, out), out, layout


class PreshardedMove:
    """``shard()`` of a :class:`ShardedBatch` with the mesh's facts read once (the sharder's fast path).

    Per call: two int compares against the rank and size read at construction,
    one buffer move (``ShardedBatch.to``: one copy, views rebuilt from the
    batch's cached view plan) and the ctx factory. A batch laid out for another
    rank or size takes :func:`shard_presharded`, which raises the precise error.
    """

    __slots__ = ("_cp_mesh", "_device", "_group", "_mesh_dims", "_rank", "_size")

    def __init__(self, cp_mesh: Any, device: torch.device | None, mesh_dims: Any = None) -> None:
        self._cp_mesh, self._device, self._mesh_dims = cp_mesh, device, mesh_dims
        self._rank, self._size = mesh_rank_size(cp_mesh)
        self._group: Any = self  # self = not read yet (the mesh's group is read on the first batch at cp > 1)

    def __call__(self, batch: ShardedBatch) -> tuple[Callable[..., Any], dict[str, torch.Tensor], ShardLayout]:
        layout = batch.layout
        if layout.cp_size != self._size or layout.cp_rank != self._rank:
            return shard_presharded(self._cp_mesh, batch, self._device, mesh_dims=self._mesh_dims)
        out = (batch if self._device is None else batch.to(self._device, non_blocking=True)).tensors()
        if self._size <= 1:
            return contextlib.nullcontext, out, layout
        if self._group is self:
            self._group = mesh_group(self._cp_mesh)
        return AttentionContextFactory(layout, self._group, out.get(DOCUMENT_IDS)), out, layout
