"""Exchange only the keys each rank needs: one differentiable point-to-point exchange (torch only).

A layout with a K/V exchange plan (``layout.kv_exchange``, a :class:`~cpdata.layout.exchange.RankExchange`
built on the worker) lets document-causal attention skip the all-gather: each rank sends every other rank
exactly the keys that rank's queries attend to::

    forward:  send = local[send_index]                      [n_send, ...]
              recv = swap(send, splits)                     [n_recv, ...]   ONE batch of sends and receives
              keys = cat(local, recv)                       [L + n_recv, ...]  own keys first
    backward: grad_recv -> the reverse swap                 [n_send, ...]   ONE batch
              grad_local = grad_own.index_add(send_index, grad_sent)   (a key's grads summed into its owner)

A swap is ``batch_isend_irecv`` with the ranks it sends to or receives from only (an all-to-all's result, but
a rank with no keys to move waits for no one: a rank that shares no document with the others runs its
micro-batches at its own pace, which a world step's per-rank balance counts on, docs/layouts-and-kernels.md).

The gradient contract is the all-gather's (:mod:`cpdata.gather`). Received keys come grouped by source rank;
:func:`exchanged_key_positions` gives every key's global position on the device, so a mask needs no
collective; split sizes are host ints from the plan (no sync). The busiest rank receives
``kv_recv_fraction`` of an all-gather's ``(cp-1)/cp * S`` keys (~0.1-0.3 for short documents, 1.0 when one
document spans the pack). :func:`move_keys_values` is the one place every CP attention moves K and V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import irecv, isend  # (as P2POp checks them: not a wrapper's)

from cpdata.gather import check_cp_group, gather_token_tensor, layout_cached

if TYPE_CHECKING:
    from cpdata.layout.shard_layout import ShardLayout

__all__ = ["ExchangeKV", "exchange_index", "exchange_tokens", "exchanged_key_positions", "has_exchange",
           "move_keys_values"]


def has_exchange(layout: ShardLayout) -> bool:
    """Whether ``layout`` carries a K/V exchange plan (built with ``kv_exchange=True`` on the worker)."""
    return layout.kv_exchange is not None


def _plan(layout: ShardLayout) -> Any:
    if layout.kv_exchange is None:
        raise ValueError("layout.kv_exchange is None; build the batches with kv_exchange=True (ShardForRank / "
                         "build_loader) or use cpdata.gather.gather_token_tensor")  # fmt: skip
    return layout.kv_exchange


def _expand(runs: Any, total: int, device: torch.device) -> torch.Tensor:
    """int64 ``[total]``: ``arange(start, start + length)`` of every ``(start, length)`` row of ``runs``, built
    on ``device`` from the small run table (``total`` is a host int: no sync)."""
    table = torch.as_tensor(runs, dtype=torch.int64).reshape(-1, 2).to(device)
    starts, sizes = table[:, 0], table[:, 1]
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    shift = starts - sizes.cumsum(0) + sizes
    return torch.repeat_interleave(shift, sizes, output_size=total) + torch.arange(total, device=device)


def exchange_index(layout: ShardLayout, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send_index [n_send], key_positions [L + n_recv])`` int64 on ``device``, built once per (layout, device).

    ``send_index``: local indices of the keys sent, by destination rank; ``key_positions``: the global
    position of every key :func:`exchange_tokens` returns (own keys in local order, then received ones).
    """
    plan = _plan(layout)
    own = layout.local_token_global_indices
    if own is None:
        raise ValueError("layout.local_token_global_indices is None; pass the ShardLayout the batch came with")
    device = torch.device(device)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        recv = _expand(plan.recv_runs, plan.n_recv, device)
        positions = torch.cat((own.reshape(-1).to(device=device, dtype=torch.int64), recv))
        return _expand(plan.send_runs, plan.n_send, device), positions

    return layout_cached(layout, ("kv_exchange", str(device)), build)


def exchanged_key_positions(layout: ShardLayout, device: torch.device | str) -> torch.Tensor:
    """int64 ``[L + n_recv]``: the global position of each key :func:`exchange_tokens` returns."""
    return exchange_index(layout, device)[1]


def _swap(out: torch.Tensor, inp: torch.Tensor, out_counts: list[int], in_counts: list[int], group: Any) -> None:
    """``all_to_all_single(out, inp, out_counts, in_counts)`` as one ``batch_isend_irecv`` with only the group's
    ranks that have rows to send or receive (``group_peer``: ranks of ``group``); nothing when none."""
    ops = [dist.P2POp(isend, part, group=group, group_peer=r)
           for r, part in enumerate(inp.split(in_counts)) if in_counts[r]]
    ops += [dist.P2POp(irecv, part, group=group, group_peer=r)
            for r, part in enumerate(out.split(out_counts)) if out_counts[r]]  # fmt: skip
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class ExchangeKV(torch.autograd.Function):
    """``apply(local, send_index, send_counts, recv_counts, group, seq_dim)``: the module's forward/backward;
    ``local`` holds ``L`` tokens on ``seq_dim``, ``send_index`` int64 ``[n_send]`` grouped by destination."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, send_index: torch.Tensor, send_counts: list[int],
                recv_counts: list[int], group: Any, seq_dim: int) -> torch.Tensor:  # fmt: skip
        x = local.movedim(seq_dim, 0)
        send = x.index_select(0, send_index)
        recv = x.new_empty((sum(recv_counts), *x.shape[1:]))
        _swap(recv, send, recv_counts, send_counts, group)
        ctx.save_for_backward(send_index)
        ctx.counts, ctx.group, ctx.seq_dim, ctx.local_len = (send_counts, recv_counts), group, seq_dim, x.shape[0]
        return torch.cat((x, recv)).movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (send_index,) = ctx.saved_tensors
        send_counts, recv_counts = ctx.counts
        g = grad.movedim(ctx.seq_dim, 0)
        n = ctx.local_len
        back = g.new_empty((sum(send_counts), *g.shape[1:]))
        _swap(back, g[n:].contiguous(), send_counts, recv_counts, ctx.group)
        local = g[:n].index_add(0, send_index, back)
        return local.movedim(0, ctx.seq_dim), None, None, None, None, None


def exchange_tokens(tensor: torch.Tensor, layout: ShardLayout, group: Any = None, seq_dim: int = 1) -> torch.Tensor:
    """This rank's tokens plus the ones its plan receives: ``[..., L + n_recv, ...]`` (differentiable; order:
    :func:`exchanged_key_positions`). ``tensor``: the local shard, ``L`` tokens on ``seq_dim`` in local order
    (K and V concatenated ``[B, H, L, Ek + Ev]``, or ``document_ids`` ``[B, L]``); ``group``: the CP group."""
    plan = _plan(layout)
    seq_dim = seq_dim % tensor.dim()
    local = tensor.shape[seq_dim]
    own = layout.local_token_global_indices
    if own is None or own.numel() != local:
        raise ValueError(
            f"tensor has {local} tokens on dim {seq_dim} but the layout holds "
            f"{None if own is None else own.numel()} local positions; pass this batch's shard and seq_dim"
        )
    send_index, _ = exchange_index(layout, tensor.device)
    if plan.cp_size == 1:
        return tensor
    check_cp_group(plan, group, "the exchange plan", verb="built")
    return ExchangeKV.apply(tensor, send_index, list(plan.send_counts), list(plan.recv_counts), group, seq_dim)


def move_keys_values(
    key: torch.Tensor, value: torch.Tensor, layout: ShardLayout, group: Any, *, exchange: bool, seq_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``key``/``value`` (``L`` tokens on ``seq_dim``) -> the keys its queries attend over.

    One collective for ``cat(key, value)`` on the last dim: with ``exchange`` the plan's all-to-all
    (:func:`exchange_tokens`), else the all-gather to global order (:mod:`cpdata.gather`); either way each
    rank's K/V gradient sums every rank's loss. Under autocast (HF's RoPE returns a float32 key beside a
    bfloat16 value) K and V are cast to the autocast dtype first (each floating tensor but float64, autocast's
    rule), as SDPA and flex compute in it: no traffic wider than the kernel. Outside autocast, different
    dtypes are refused, as the kernels refuse them.
    """
    device_type = key.device.type
    if torch.is_autocast_enabled(device_type):
        low = torch.get_autocast_dtype(device_type)
        key, value = (t.to(low) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (key, value))
    if key.shape[:-1] != value.shape[:-1] or key.dtype != value.dtype:
        raise ValueError(
            f"key {tuple(key.shape)} {key.dtype} and value {tuple(value.shape)} {value.dtype} must agree on "
            "every dim but the last and on dtype (they travel as one tensor)"
        )
    move = exchange_tokens if exchange else gather_token_tensor
    kv = move(torch.cat((key, value), dim=-1), layout, group, seq_dim)
    return kv.split((key.shape[-1], value.shape[-1]), dim=-1)
