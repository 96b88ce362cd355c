"""Choosing a sharding strategy for a model, mesh and batch: decided once, in one place.

Order: the model's own sharder (its ``prepare_model_inputs_for_cp(batch,
device_mesh)`` hook returns one, or a dict holding it under ``"cp_sharder"``),
else cpdata's :class:`~cpdata.raw_shard.DeviceShard` with the plan
:func:`~cpdata.raw_shard.resolve_plan` picks from the batch and the CP size.
Call sites never branch on backends; they hold the resulting
``ContextParallelSharder``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from cpdata.raw_shard import DeviceShard, closed_form_indices, is_presharded, mesh_rank_size, resolve_plan
from cpdata.shard_layout import ShardLayout

__all__ = ["Strategy", "mesh_device", "resolve_strategy", "submesh"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """The three parts of a sharder that a resolution decides."""

    shard_batch: Callable[..., Any]
    """``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id) -> (ctx, batch, ShardLayout | None)``."""
    local_token_global_indices: Callable[..., torch.Tensor] | None
    """Closed-form ``(cp_mesh, padded_seq_len, device)`` index map, or None (data-dependent)."""
    shard_layout: ShardLayout | None
    """A layout known before the first shard (usually None)."""


def submesh(device_mesh: Any, name: str) -> Any:
    """``device_mesh[name]`` when the mesh has that dim, else None."""
    return device_mesh[name] if name in (getattr(device_mesh, "mesh_dim_names", None) or ()) else None


def mesh_device(device_mesh: Any) -> torch.device | None:
    """Where a sharder puts tensors: the mesh's ``device_type`` (cpu for gloo); None without a mesh."""
    kind = getattr(device_mesh, "device_type", None)
    if kind is None:
        return None
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _model_strategy(prepared: Any, batch: Mapping[str, Any]) -> Strategy | None:
    """The strategy of a model hook's result; its other dict keys are merged into ``batch``."""
    if isinstance(prepared, Mapping):
        extra = {k: v for k, v in prepared.items() if k != "cp_sharder"}
        if extra:
            if not isinstance(batch, MutableMapping):
                raise TypeError(
                    f"prepare_model_inputs_for_cp returned batch keys {sorted(extra)} but the batch "
                    f"({type(batch).__name__}) is read-only; pass a dict"
                )
            batch.update(extra)
        prepared = prepared.get("cp_sharder")
    if prepared is None:
        return None
    if not hasattr(prepared, "shard_batch"):
        raise TypeError(
            "prepare_model_inputs_for_cp must return a ContextParallelSharder, a dict with key 'cp_sharder', "
            f"or None; got {type(prepared).__name__}"
        )
    return Strategy(
        shard_batch=prepared.shard_batch,
        local_token_global_indices=prepared.local_token_global_indices,
        shard_layout=prepared.shard_layout,
    )


def resolve_strategy(
    model: Any,
    device_mesh: Any,
    batch: Mapping[str, Any],
    *,
    num_chunks: int = 1,
    invoke_pre_embed: bool = True,
    extra_seq_buffers: Mapping[str, int] | None = None,
) -> Strategy:
    """The model's strategy if its hook supplies one, else cpdata's for ``batch``.

    cpdata's strategy accepts worker-sharded batches (copied to the device)
    and raw full batches (laid out on device); at cp_size <= 1 its layout is
    the identity, so token verbs work at every CP size. Layouts that are a
    function of the length alone also get a closed-form index map.
    """
    hook = getattr(model, "prepare_model_inputs_for_cp", None) if invoke_pre_embed else None
    owned = _model_strategy(hook(batch, device_mesh), batch) if hook is not None else None
    if owned is not None:
        return owned
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks != 1:
        raise ValueError(
            f"num_chunks={num_chunks!r}: cpdata lays out each batch as one stream; use num_chunks=1 "
            "(or a model hook that owns chunked sharding)"
        )
    _, cp_size = mesh_rank_size(submesh(device_mesh, "cp"))
    plan = resolve_plan(batch, cp_size)
    closed = not plan.uses_slots and not is_presharded(batch)
    return Strategy(
        shard_batch=DeviceShard(
            plan=plan, device=mesh_device(device_mesh), extra_seq_buffers=dict(extra_seq_buffers or {})
        ),
        local_token_global_indices=functools.partial(closed_form_indices, plan.layout) if closed else None,
        shard_layout=None,
    )
