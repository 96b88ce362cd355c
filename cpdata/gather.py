"""Differentiable gather of a token-aligned CP shard back to global order (torch and the standard library only).

The layout carries the inverse map (``gather_index``, built on the dataloader worker), so a gather is one
collective on the tensor and an O(n) ``index_select``, never a collective on indices and an argsort.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from cpdata.layout.shard_layout import ShardLayout

__all__ = ["GatherFromShards", "check_cp_group", "ensure_gather_index", "gather_token_tensor",
           "layout_cached", "layout_tensor_on"]

_CACHE_SIZE = 64
_cache: OrderedDict[tuple, tuple[weakref.ref, Any]] = OrderedDict()


def layout_cached(layout: ShardLayout, key: tuple[str, ...], make: Callable[[], Any]) -> Any:
    """``make()`` built at most once per (``layout``, ``key``) while the layout lives (a device copy, an
    index plan); the bounded cache checks the layout by identity: a recycled ``id`` gets no stale one."""
    full = (id(layout), *key)
    hit = _cache.get(full)
    if hit is not None and hit[0]() is layout:
        _cache.move_to_end(full)
        return hit[1]
    value = make()
    _cache[full] = (weakref.ref(layout), value)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return value


def layout_tensor_on(layout: ShardLayout, name: str, device: torch.device | str) -> torch.Tensor:
    """``getattr(layout, name)`` on ``device``, copied (``non_blocking``) once per (layout, device)."""
    value = getattr(layout, name)
    if value is None:
        raise ValueError(f"ShardLayout.{name} is None; build the layout with {name} set")
    device = torch.device(device)
    if value.device == device:
        return value
    return layout_cached(layout, (name, str(device)), lambda: value.to(device, non_blocking=True))


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    # torch 2.13 renamed all_gather_into_tensor (same collective); keep older torch working. Looked up per
    # call: tests and the bench count collectives by patching torch.distributed.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


class GatherFromShards(torch.autograd.Function):
    """All-gather a local shard (``L`` tokens on ``seq_dim``) and index it by ``gather_index`` (int64 ``[cp*L]``)
    into global order; backward reduce-scatters (SUM), so a loss replicated on every CP rank gives each rank
    ``cp_size x`` the single-loss gradient (scale it by ``1 / cp_size``)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, gather_index: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
        world = dist.get_world_size(group)
        x = local.movedim(seq_dim, 0).contiguous()
        stacked = x.new_empty((world * x.shape[0], *x.shape[1:]))
        _all_gather(stacked, x, group)
        ctx.save_for_backward(gather_index)
        ctx.group, ctx.seq_dim, ctx.world = group, seq_dim, world
        return stacked.index_select(0, gather_index).movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (gather_index,) = ctx.saved_tensors
        g = grad.movedim(ctx.seq_dim, 0)
        stacked = g.new_empty(g.shape).index_copy_(0, gather_index, g)
        local = g.new_empty((g.shape[0] // ctx.world, *g.shape[1:]))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as _all_gather
        scatter(local, stacked, op=dist.ReduceOp.SUM, group=ctx.group)
        return local.movedim(0, ctx.seq_dim), None, None, None


def gather_token_tensor(
    tensor: torch.Tensor, layout: ShardLayout, group: Any = None, seq_dim: int = 1
) -> torch.Tensor:
    """Differentiably gather this rank's shard (``L`` tokens on ``seq_dim``, local order) to
    ``[..., cp_size*L, ...]`` in global padded order over the CP ``group`` (None: the default group); at
    ``cp_size == 1`` an ``index_select`` and no collective, else :class:`GatherFromShards`."""
    seq_dim = seq_dim % tensor.dim()
    if layout.gather_index is None:
        raise ValueError(
            "ShardLayout.gather_index is None; build the layout with "
            "gather_index=inverse_indices(rows) (cpdata.layout.maps) so the gather needs no index collective"
        )
    local_len = tensor.shape[seq_dim]
    if layout.gather_index.dtype != torch.int64:
        raise ValueError(
            f"ShardLayout.gather_index must be int64 (index_copy in backward needs it), got "
            f"{layout.gather_index.dtype}; build it with cpdata.layout.maps.inverse_indices"
        )
    expected = layout.gather_index.numel()
    if local_len * layout.cp_size != expected:
        raise ValueError(
            f"local tensor has {local_len} tokens on dim {seq_dim}, x cp_size {layout.cp_size} = "
            f"{local_len * layout.cp_size}, but the layout's gather_index covers {expected} tokens; "
            "pass the shard of the batch this layout came from (and the right seq_dim)"
        )
    index = layout_tensor_on(layout, "gather_index", tensor.device)
    if layout.cp_size == 1:
        return tensor.index_select(seq_dim, index)
    check_cp_group(layout, group, "layout", verb="built")
    return GatherFromShards.apply(tensor, index, group, seq_dim)


def check_cp_group(of: Any, group: Any, what: str = "the batch", *, verb: str = "sharded") -> None:
    """``ValueError`` unless ``group`` (None: the default group) has ``of.cp_size`` ranks, this one
    ``of.cp_rank``; ``of`` is a ``ShardLayout`` or an exchange plan, ``what`` names it ``verb`` for them."""
    cp_size, cp_rank = of.cp_size, of.cp_rank
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{what} is for cp_size={cp_size} but no process group is initialized; "
                         "call torch.distributed.init_process_group and pass the CP group")  # fmt: skip
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (world, rank) != (cp_size, cp_rank):
        which = " (group=None: the default group of every rank)" if group is None else ""
        raise ValueError(
            f"{what} was {verb} for cp_size={cp_size}, cp_rank={cp_rank} but the group has size {world} and this "
            f"process is rank {rank} in it{which}; pass the CP group it was {verb} for: group=mesh['cp'].get_group() "
            "on a (dp, cp) DeviceMesh (cp_mesh.get_group() on a 1-D one)"
        )


def ensure_gather_index(layout: ShardLayout, group: Any = None) -> ShardLayout:
    """``layout`` with ``gather_index``, ``cp_size`` and ``cp_rank`` from the ranks' index maps, if missing: one
    all-gather every CP rank must join and an argsort; keep the copy so later gathers stay one collective."""
    if layout.gather_index is not None:
        return layout
    if layout.local_token_global_indices is None:
        raise ValueError("ShardLayout has neither gather_index nor local_token_global_indices; nothing to invert")
    local = layout.local_token_global_indices.reshape(-1).to(torch.int64)
    world, rank = 1, 0
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = local
    if world > 1:
        rows = local.new_empty((world * local.numel(),))
        _all_gather(rows, local.contiguous(), group)
    inverse = torch.argsort(rows)
    if not torch.equal(rows[inverse], torch.arange(rows.numel(), device=rows.device)):
        raise ValueError(
            f"the CP ranks' local_token_global_indices ({world} x {local.numel()}) are not a permutation of "
            f"range({rows.numel()}): every global position must be owned by exactly one rank"
        )
    return replace(layout, local_token_global_indices=local, gather_index=inverse.cpu(), cp_size=world, cp_rank=rank)
