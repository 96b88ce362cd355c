"""The attention torchtitan runs on a cpdata batch: masks in the key order its kernel receives, and the K/V swap.

The ``BlockMask`` of ``L`` local queries is cpdata's document-causal predicate
(:mod:`cpdata.device.attention_masks`) at each key's global position: rank order under torchtitan's
all-gather, own + received keys under cpdata's exchange (:func:`install_exchange_attention`). One mask per
batch, shared by every layer (docs/torchtitan.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.common.attention import FlexAttention

from cpdata.device.attention_masks import document_slots
from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange, move_keys_values
from cpdata.gather import ensure_gather_index
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.batch import ShardedBatch
from cpdata.worker.keys import DOCUMENT_IDS

__all__ = ["ExchangeMask", "batch_attention_mask", "gathered_key_positions", "install_exchange_attention"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ExchangeMask:
    """What the swapped attention needs per batch: the ``BlockMask`` over the exchanged keys (in
    :func:`cpdata.device.kv_exchange.exchange_tokens`'s order) and the layout carrying the exchange plan."""

    block_mask: Any
    """``BlockMask`` ``[1, 1, L, L + n_recv]``."""
    layout: ShardLayout
    group: Any
    """The CP process group the plan was built for."""


def gathered_key_positions(layout: ShardLayout, group: Any, device: torch.device) -> torch.Tensor:
    """int64 ``[cp * L]``: the global position of each key torchtitan's all-gather returns (rank order):
    ``argsort(gather_index)``, after one index all-gather if the layout lacks it."""
    layout = ensure_gather_index(layout, group)
    order = layout.gather_index.reshape(-1).to(device=device, dtype=torch.int64)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=device)
    return positions


def batch_attention_mask(
    batch: ShardedBatch, *, group: Any, device: torch.device, block_size: int | tuple[int, int], exchange: bool
) -> Any:
    """The mask torchtitan's attention gets for ``batch``: a ``BlockMask``, or an :class:`ExchangeMask`.

    Queries are the local tokens as one row ``[1, L]``; keys the same at cp 1, else the rank-order all-gather or
    (``exchange=True``) own + received keys.
    """
    layout = batch.layout
    document_ids = batch[DOCUMENT_IDS].reshape(1, -1).to(device)
    slots = document_slots(layout, document_ids, batch["cu_seqlens_padded"].to(device), batch["cu_seqlens"].to(device))
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
    mask = slots.mask("flex", keys, block_size=size)
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
    """Swap every ``FlexAttention`` forward in ``model`` (torchtitan's all-gather wrapper included) for the
    exchange one, still calling ``FlexAttention.forward`` for the kernel; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, FlexAttention):
            module.forward = _exchange_forward(module)
            count += 1
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no FlexAttention module to swap; the cpdata exchange "
                         "attention needs a model whose inner attention is torchtitan's FlexAttention")  # fmt: skip
    return count
