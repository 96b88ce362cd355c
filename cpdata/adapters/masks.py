"""Document-causal attention masks for a CP shard, for model code: this rank's queries x every rank's keys.

Under context parallelism a rank holds ``L = S / cp`` tokens in its layout's
local order, while an all-gather-KV attention sees all ``S`` keys of a row in
global order. A query attends to the keys of its document slot up to itself
(and within a window); the predicate and its memory trade-offs are
:mod:`cpdata.device.attention_masks`, the one every cpdata attention applies
(the sharder's ctx, the ``"cpdata"`` HF attention). Building a mask needs no
collective and no host sync. Two forms:

- :func:`document_causal_mask`: dense bool ``[B, 1, L, S]`` (True = attend) for
  ``F.scaled_dot_product_attention(attn_mask=...)`` and HF's ``sdpa`` 4-D
  ``attention_mask``: ``B*L*S`` bytes (64 MiB for one 32K pack at cp = 4), and
  SDPA runs at full ``L x S`` cost, however sparse the documents.
- :func:`flex_block_mask`: a ``BlockMask`` for ``flex_attention``, built from
  each query's key interval without the dense grid; the kernel skips the
  blocks the documents rule out (with 4K documents in a 128K pack ~97 %).

Keys: a layout with a K/V exchange plan (``layout.kv_exchange``) is attended
over its exchanged keys, ``K = L + n_recv`` of them (own then received, the
order :func:`cpdata.device.kv_exchange.exchange_tokens` returns), unless
``keys="global"`` asks for all ``S``. With ``cu_seqlens`` (the batch's real
lengths) a pad query sees its own key only: pad costs one diagonal tile per
block and no softmax row is empty.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from cpdata.device.attention_masks import block_mask, check_window, dense_mask, document_slots
from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["document_causal_mask", "flex_block_mask"]

KeyOrder = Literal["auto", "global", "exchange"]


def _exchanged(layout: ShardLayout | None, keys: KeyOrder) -> bool:
    """Whether the mask covers the exchanged keys (see the module docstring)."""
    if keys not in ("auto", "global", "exchange"):
        raise ValueError(f"keys={keys!r}: use 'auto' (exchanged keys when the layout has a plan), 'global' or "
                         "'exchange'")  # fmt: skip
    exchanged = layout is not None and has_exchange(layout)
    if keys == "exchange" and not exchanged:
        raise ValueError("keys='exchange' needs a layout with a K/V exchange plan (layout.kv_exchange); build the "
                         "batches with kv_exchange=True, or pass keys='global'")  # fmt: skip
    return exchanged and keys != "global"


def document_causal_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    window: int | None = None,
    keys: KeyOrder = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense bool mask ``[B, 1, L, S]`` (True = attend) of local queries over global keys (``[B, 1, L, K]``
    over the exchanged keys when the layout has a plan, see ``keys``).

    Args:
        layout: the batch's :class:`ShardLayout` (``batch.layout``); None for a
            whole pack on one rank (queries are positions ``0..L-1``).
        document_ids: int ``[B, L]`` (bshd) or ``[L]`` (thd stream, B = 1), the
            batch's ``document_ids`` (stream slot of each local token).
        cu_seqlens_padded: int32 ``[K+1]``, the batch's global slot offsets.
        window: keep only keys with ``pos(q) - k < window`` (sliding-window
            attention); None = the whole document prefix.

        keys: ``"auto"``: the exchanged keys when ``layout.kv_exchange`` is set, else global;
            ``"global"``: a row's ``S`` positions in global order (``S = layout.padded_seq_len``, the
            length :func:`cpdata.gather.gather_token_tensor` returns); ``"exchange"``: the exchanged keys
            (refused without a plan).
        cu_seqlens: int32 ``[K+1]``, the batch's real lengths: pad queries then see their own key only (one
            diagonal tile per pad block; what cpdata's own attention does). None: pads attend their slot
            like its last document token (same loss, more tiles).
    """
    check_window(window)
    slots = document_slots(layout, document_ids, cu_seqlens_padded, cu_seqlens)
    lo, hi = slots.intervals(window=window)
    if _exchanged(layout, keys):
        return dense_mask(lo, hi, exchanged_key_positions(layout, lo.device))
    return dense_mask(lo, hi, torch.arange(slots.row_len, device=lo.device))


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
    check_window(window)
    slots = document_slots(layout, document_ids, cu_seqlens_padded, cu_seqlens)
    lo, hi = slots.intervals(window=window)
    key_pos = exchanged_key_positions(layout, lo.device) if _exchanged(layout, keys) else None
    return block_mask(lo, hi, slots.row_len, key_pos=key_pos, block_size=block_size)
