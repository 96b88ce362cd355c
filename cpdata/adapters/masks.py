"""Document-causal attention masks for a CP shard: this rank's queries x every rank's keys (torch only).

Under context parallelism a rank holds ``L = S / cp`` tokens in its layout's
local order, while an all-gather-KV attention (the sharder's ctx,
:mod:`cpdata.gather`) sees all ``S`` keys of a row in global order. A query
attends to a key when the key lies in the query's document slot and is not
after it::

    attend[b, q, k] = slot_start(b, q) <= k <= pos(q)

``pos`` is the layout's ``local_token_global_indices`` (the global position of
each local token), ``slot_start`` comes from the query's ``document_ids`` and
the global ``cu_seqlens_padded`` every rank holds: building a mask needs no
collective and no host sync. Pads belong to their slot and sit after its real
tokens, so real queries never see them and every row keeps its diagonal (no
all-masked row, no NaN).

Two forms of the same predicate:

- :func:`document_causal_mask`: dense bool ``[B, 1, L, S]`` (True = attend) for
  ``F.scaled_dot_product_attention(attn_mask=...)`` and HF's ``sdpa`` 4-D
  ``attention_mask``. Memory ``B*L*S`` bytes: 64 MiB for one 32K pack at cp = 4,
  1 GiB at 128K and cp = 16; SDPA with a mask runs the math or memory-efficient
  kernel at full ``L x S`` cost, however sparse the documents.
- :func:`flex_block_mask`: a ``BlockMask`` (``create_block_mask``) for
  ``flex_attention``: O(``L*S / block^2``) memory, and the kernel skips the
  blocks the documents rule out (with 4K documents in a 128K pack ~97 %).

Keys: a layout with a K/V exchange plan (``layout.kv_exchange``) is attended
over its exchanged keys, ``K = L + n_recv`` of them (own then received, the
order :func:`cpdata.device.kv_exchange.exchange_tokens` returns, positions from
:func:`cpdata.device.kv_exchange.exchanged_key_positions`), unless ``keys="global"``
asks for all ``S``; the predicate is the same, evaluated at each key's global
position.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange
from cpdata.gather import layout_tensor_on
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["document_causal_mask", "flex_block_mask"]

KeyOrder = Literal["auto", "global", "exchange"]


def _key_positions(layout: ShardLayout | None, keys: KeyOrder, row_len: int, device: torch.device) -> torch.Tensor:
    """int64 ``[K]``: the global position of each key the mask covers (see the module docstring)."""
    if keys not in ("auto", "global", "exchange"):
        raise ValueError(f"keys={keys!r}: use 'auto' (exchanged keys when the layout has a plan), 'global' or "
                         "'exchange'")  # fmt: skip
    exchanged = layout is not None and has_exchange(layout)
    if keys == "exchange" and not exchanged:
        raise ValueError("keys='exchange' needs a layout with a K/V exchange plan (layout.kv_exchange); build the "
                         "batches with kv_exchange=True, or pass keys='global'")  # fmt: skip
    if exchanged and keys != "global":
        return exchanged_key_positions(layout, device)
    return torch.arange(row_len, device=device)


def _query_bounds(
    layout: ShardLayout | None, document_ids: torch.Tensor, cu_seqlens_padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(slot_start [B, L], pos [L], S)``: the key range ``[slot_start, pos]`` of every local query."""
    if document_ids.dim() not in (1, 2):
        raise ValueError(
            f"document_ids must be [L] (thd stream) or [B, L] (bshd rows), got shape {tuple(document_ids.shape)}"
        )
    doc_q = document_ids.reshape(-1, document_ids.shape[-1]).to(torch.int64)
    rows, local = doc_q.shape
    device = doc_q.device
    if layout is None:  # the whole pack on one rank: every position is local
        pos, row_len = torch.arange(local, device=device), local
    else:
        if layout.local_token_global_indices is None:
            raise ValueError("layout.local_token_global_indices is None; pass the ShardLayout the batch came with")
        pos = layout_tensor_on(layout, "local_token_global_indices", device)
        if pos.numel() != local:
            raise ValueError(
                f"document_ids has {local} tokens per row but the layout holds {pos.numel()} local positions; "
                "pass this batch's document_ids and layout"
            )
        row_len = layout.padded_seq_len if layout.padded_seq_len is not None else local * layout.cp_size
    cu = cu_seqlens_padded.to(device=device, dtype=torch.int64).reshape(-1)
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens_padded needs at least 2 entries, got {cu.numel()}")
    row_offset = torch.arange(rows, device=device, dtype=torch.int64)[:, None] * row_len
    return cu[doc_q] - row_offset, pos, row_len


def document_causal_mask(
    layout: ShardLayout | None, document_ids: torch.Tensor, cu_seqlens_padded: torch.Tensor,
    *, keys: KeyOrder = "auto",
) -> torch.Tensor:
    """Dense bool mask ``[B, 1, L, S]`` (True = attend) of local queries over global keys (``[B, 1, L, K]``
    over the exchanged keys when the layout has a plan, see ``keys``).

    Args:
        layout: the batch's :class:`ShardLayout` (``batch.layout``); None for a
            whole pack on one rank (queries are positions ``0..L-1``).
        document_ids: int ``[B, L]`` (bshd) or ``[L]`` (thd stream, B = 1), the
            batch's ``document_ids`` (stream slot of each local token).
        cu_seqlens_padded: int32 ``[K+1]``, the batch's global slot offsets.

        keys: ``"auto"``: the exchanged keys when ``layout.kv_exchange`` is set, else global;
            ``"global"``: a row's ``S`` positions in global order (``S = layout.padded_seq_len``, the
            length :func:`cpdata.gather.gather_token_tensor` returns); ``"exchange"``: the exchanged keys
            (refused without a plan).
    """
    start, pos, row_len = _query_bounds(layout, document_ids, cu_seqlens_padded)
    k = _key_positions(layout, keys, row_len, start.device)
    mask = (k[None, None, :] >= start[:, :, None]) & (k[None, None, :] <= pos[None, :, None])
    return mask[:, None]


def flex_block_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    block_size: int = 128,
    keys: KeyOrder = "auto",
) -> Any:
    """The same predicate as :func:`document_causal_mask` as a flex-attention ``BlockMask``.

    ``Q_LEN = L`` (local queries), ``KV_LEN = S`` (global keys) or ``K = L + n_recv``
    (exchanged keys, ``keys`` as in :func:`document_causal_mask`), batch ``B``,
    heads broadcast. Use with
    ``torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=...)``
    where ``k``/``v`` are gathered to global order (or exchanged with
    :func:`cpdata.device.kv_exchange.exchange_tokens`). Building it evaluates the
    predicate once per ``block_size`` tile (vmap, not compiled).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    start, pos, row_len = _query_bounds(layout, document_ids, cu_seqlens_padded)
    rows, local = start.shape
    key_pos = _key_positions(layout, keys, row_len, start.device)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        k = key_pos[kv_idx]
        return (k >= start[b, q_idx]) & (k <= pos[q_idx])

    return create_block_mask(
        mask_mod, rows, None, local, key_pos.numel(), device=start.device, BLOCK_SIZE=block_size
    )
