"""The attention torchtitan runs on a cpdata batch: masks in the key order its kernel receives, and the K/V swap.

torchtitan's flex attention (``FlexAttention``, ``q/k/v [B, L, N, H]``) takes
a ``BlockMask`` of ``Q_LEN = L`` local queries over ``KV_LEN`` keys. Under CP
torchtitan wraps it with an all-gather of K/V along the sequence
(``flex_cp_allgather``), so the keys arrive in *rank order*: every rank's
local tokens, rank 0 first. A cpdata layout puts global position ``g`` of the
pack at rank-order index ``gather_index[g]``, so key ``j`` sits at global
position ``argsort(gather_index)[j]``. The mask is cpdata's document-causal
predicate at each key's global position::

    attend[q, j] = lo(q) <= key_pos[j] <= hi(q)

(:mod:`cpdata.device.attention_masks`, the one mask of every cpdata attention:
``lo`` the query's slot start and ``hi`` its position for a real query, both its
own position for a pad; from the layout and the batch's ``document_ids`` /
``cu_seqlens_padded`` / ``cu_seqlens``). No collective when the layout carries its inverse map
(the worker builds it), one index all-gather otherwise.

With ``kv_exchange=True`` the keys come instead from cpdata's exchange
(:mod:`cpdata.device.kv_exchange`): :func:`install_exchange_attention` swaps
the forward of every ``FlexAttention`` module for one that sends each rank
only the keys its documents reach (one all-to-all of ``cat(k, v)`` through
:func:`cpdata.device.kv_exchange.move_keys_values`, the
reverse in backward) and runs the same flex call over ``own + received``
keys, with the mask at those keys' global positions. The batch's layout rides
to the layers inside the mask object (:class:`ExchangeMask`), which torchtitan
passes through its ``Decoder`` untouched.

Trade-off: the mask is built by ``create_block_mask`` over the ``L x K`` key
grid (``K = cp * L`` gathered, ``L + n_recv`` exchanged), once per batch and
shared by every layer; the exchange moves fewer keys (the busiest rank
receives ``kv_recv_fraction`` of the all-gather's) and its mask is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.common.attention import FlexAttention

from cpdata.device.attention_masks import block_mask, document_slots
from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange, move_keys_values
from cpdata.gather import ensure_gather_index
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.batch import ShardedBatch
from cpdata.worker.keys import DOCUMENT_IDS

__all__ = ["ExchangeMask", "batch_attention_mask", "gathered_key_positions", "install_exchange_attention"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExchangeMask:
    """What the swapped attention needs per batch: the ``BlockMask`` over exchanged keys and the exchange plan.

    The ``BlockMask`` is evaluated at the exchanged keys' global positions (own keys in local order, then the
    received ones by source rank: what :func:`cpdata.device.kv_exchange.exchange_tokens` returns).
    """

    block_mask: Any
    """``BlockMask`` ``[1, 1, L, L + n_recv]``."""
    layout: ShardLayout
    """The batch's layout, carrying ``kv_exchange``."""
    group: Any
    """The CP process group the plan was built for."""


def gathered_key_positions(layout: ShardLayout, group: Any, device: torch.device) -> torch.Tensor:
    """int64 ``[cp * L]``: the global position of each key torchtitan's all-gather returns (rank order).

    ``argsort`` of the layout's inverse map ``gather_index`` (``global = concat(shards)[gather_index]``);
    a layout without it gets it from one index all-gather (:func:`cpdata.gather.ensure_gather_index`).
    """
    layout = ensure_gather_index(layout, group)
    order = layout.gather_index.reshape(-1).to(device=device, dtype=torch.int64)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=device)
    return positions


def batch_attention_mask(
    batch: ShardedBatch, *, group: Any, device: torch.device, block_size: int | tuple[int, int], exchange: bool
) -> Any:
    """The mask torchtitan's attention gets for ``batch``: a ``BlockMask``, or an :class:`ExchangeMask`.

    Queries are the batch's local tokens as one row (``[1, L]``, the stream of its packs); keys are, at
    cp 1, the same tokens; at cp > 1 the rank-order all-gather (``exchange=False``) or own + received
    keys (``exchange=True``, the layout must carry a plan).
    """
    layout = batch.layout
    document_ids = batch[DOCUMENT_IDS].reshape(1, -1).to(device)
    slots = document_slots(layout, document_ids, batch["cu_seqlens_padded"].to(device), batch["cu_seqlens"].to(device))
    lo, hi = slots.intervals()
    if exchange:
        if not has_exchange(layout):
            raise ValueError("the attention swap needs batches built with kv_exchange=True; set "
                             "--dataloader.kv_exchange on every rank (the swap is installed from it)")  # fmt: skip
        keys = exchanged_key_positions(layout, device)
    elif layout.cp_size > 1:
        keys = gathered_key_positions(layout, group, device)
    else:
        keys = None  # one rank: keys in global order
    size = block_size if isinstance(block_size, int) else block_size[0]
    if not isinstance(block_size, int) and block_size[0] != block_size[1]:
        raise ValueError(f"block_size={block_size}: cpdata's masks use square tiles; set the same q and kv block size")
    mask = block_mask(lo, hi, slots.row_len, key_pos=keys, block_size=size)
    return ExchangeMask(block_mask=mask, layout=layout, group=group) if exchange else mask


def _exchange_forward(module: FlexAttention) -> Any:
    """``module.forward`` with its keys from cpdata's exchange instead of torchtitan's all-gather."""

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks: Any, **kwargs: Any):
        if not isinstance(attention_masks, ExchangeMask):
            raise ValueError(
                f"the cpdata exchange attention got attention_masks={type(attention_masks).__name__}; it runs "
                "only inside CPTitanTrainer, whose post_dataloading_process builds an ExchangeMask per batch"
            )
        k_x, v_x = move_keys_values(k, v, attention_masks.layout, attention_masks.group, exchange=True, seq_dim=1)
        return FlexAttention.forward(module, q, k_x, v_x, attention_masks=attention_masks.block_mask, **kwargs)

    return forward


def install_exchange_attention(model: torch.nn.Module) -> int:
    """Swap every ``FlexAttention`` module's forward in ``model`` for the exchange one; returns how many.

    Replaces torchtitan's CP wrapper (the all-gather) where it was applied; the kernel call itself is
    torchtitan's ``FlexAttention.forward`` (compiled flex where torchtitan compiles it).
    """
    count = 0
    for module in model.modules():
        if isinstance(module, FlexAttention):
            module.forward = _exchange_forward(module)
            count += 1
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no FlexAttention module to swap; the cpdata exchange "
                         "attention needs a model whose inner attention is torchtitan's FlexAttention")  # fmt: skip
    return count
