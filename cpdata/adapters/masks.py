"""Document-causal attention masks for model code: this rank's queries x every rank's keys (torch only).

The predicate is :mod:`cpdata.device.attention_masks`, the one every cpdata attention applies; dense for
SDPA (``B*L*S`` bytes, full ``L x S`` work) or a flex ``BlockMask`` whose kernel skips ruled-out blocks.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from cpdata.device.attention_masks import block_mask, check_window, dense_mask, document_slots
from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["document_causal_mask", "flex_block_mask"]

KeyOrder = Literal["auto", "global", "exchange"]


def _intervals(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    window: int | None,
    keys: KeyOrder,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """``(lo, hi, row_len, key_pos)``: each query's key interval, and the exchanged keys' positions (None:
    keys in global order)."""
    check_window(window)
    if keys not in ("auto", "global", "exchange"):
        raise ValueError(f"keys={keys!r}: use 'auto' (exchanged keys when the layout has a plan), 'global' or "
                         "'exchange'")  # fmt: skip
    exchanged = layout is not None and has_exchange(layout)
    if keys == "exchange" and not exchanged:
        raise ValueError("keys='exchange' needs a layout with a K/V exchange plan (layout.kv_exchange); build the "
                         "batches with kv_exchange=True, or pass keys='global'")  # fmt: skip
    slots = document_slots(layout, document_ids, cu_seqlens_padded, cu_seqlens)
    lo, hi = slots.intervals(window=window)
    key_pos = exchanged_key_positions(layout, lo.device) if exchanged and keys != "global" else None
    return lo, hi, slots.row_len, key_pos


def document_causal_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    window: int | None = None,
    keys: KeyOrder = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense bool mask ``[B, 1, L, S]`` (True = attend) of local queries over global keys, ``[B, 1, L, K]`` over
    exchanged ones. ``layout`` (None: a whole pack on one rank), ``document_ids`` (``[B, L]`` or ``[L]``),
    ``cu_seqlens_padded``, ``cu_seqlens``: as :func:`cpdata.device.attention_masks.document_slots`. ``window``:
    keep keys with ``pos(q) - k < window``. ``keys``: ``"auto"`` (exchanged when ``layout.kv_exchange`` is
    set), ``"global"`` (a row's ``S`` positions in order) or ``"exchange"`` (refused without a plan)."""
    lo, hi, row_len, key_pos = _intervals(layout, document_ids, cu_seqlens_padded, cu_seqlens, window, keys)
    return dense_mask(lo, hi, torch.arange(row_len, device=lo.device) if key_pos is None else key_pos)


def flex_block_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    window: int | None = None,
    block_size: int = 128,
    keys: KeyOrder = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> Any:
    """:func:`document_causal_mask` as a flex ``BlockMask`` (``Q_LEN = L``, ``KV_LEN = S`` or ``L + n_recv``,
    batch ``B``, heads broadcast) for ``flex_attention(q, k, v, block_mask=...)``; arguments as there."""
    lo, hi, row_len, key_pos = _intervals(layout, document_ids, cu_seqlens_padded, cu_seqlens, window, keys)
    return block_mask(lo, hi, row_len, key_pos=key_pos, block_size=block_size)
