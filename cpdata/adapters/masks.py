"""Document-causal attention masks for a CP shard: this rank's queries x every rank's keys (torch only).

Under context parallelism a rank holds ``L = S / cp`` tokens in its layout's
local order, while an all-gather-KV attention (the sharder's ctx,
:mod:`cpdata.gather`) sees all ``S`` keys of a row in global order. A query
attends to a key when the key lies in the query's document slot and is not
after it::

    attend[b, q, k] = slot_start(b, q) <= k <= pos(q)   [and pos(q) - k < window]

``pos`` is the layout's ``local_token_global_indices`` (the global position of
each local token), ``slot_start`` comes from the query's ``document_ids`` and
the global ``cu_seqlens_padded`` every rank holds: building a mask needs no
collective and no host sync. Pads belong to their slot and sit after its real
tokens, so real queries never see them and every row keeps its diagonal (no
all-masked row, no NaN). ``window`` (a sliding-window layer's
``config.sliding_window``) keeps the last ``window`` keys up to and including
the query, as transformers' ``sliding_window_overlay`` does
(``kv_idx > q_idx - window``); a document's slot is contiguous in global
order, so the window counts positions within the document.

Two forms of the same predicate:

- :func:`document_causal_mask`: dense bool ``[B, 1, L, S]`` (True = attend) for
  ``F.scaled_dot_product_attention(attn_mask=...)`` and HF's ``sdpa`` 4-D
  ``attention_mask``. Memory ``B*L*S`` bytes: 64 MiB for one 32K pack at cp = 4,
  1 GiB at 128K and cp = 16; SDPA with a mask runs the math or memory-efficient
  kernel at full ``L x S`` cost, however sparse the documents.
- :func:`flex_block_mask`: a ``BlockMask`` for ``flex_attention``, built from
  each query's key interval without the dense grid: O(``L*S / block^2``)
  memory, and the kernel skips the blocks the documents rule out (with 4K
  documents in a 128K pack ~97 %).

Keys: a layout with a K/V exchange plan (``layout.kv_exchange``) is attended
over its exchanged keys, ``K = L + n_recv`` of them (own then received, the
order :func:`cpdata.device.kv_exchange.exchange_tokens` returns, positions from
:func:`cpdata.device.kv_exchange.exchanged_key_positions`), unless ``keys="global"``
asks for all ``S``; the predicate is the same, evaluated at each key's global
position. Exchanged keys are not one interval per query, so their ``BlockMask``
is built by ``create_block_mask`` over the ``L x K`` predicate.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange
from cpdata.gather import layout_tensor_on
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["block_mask_from_bounds", "block_mask_over_keys", "dense_mask_from_bounds", "document_causal_mask",
           "flex_block_mask", "query_bounds"]

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


def query_bounds(
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


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: a sliding window is a positive int number of keys (or None)")


def document_causal_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    window: int | None = None,
    keys: KeyOrder = "auto",
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
    """
    _check_window(window)
    start, pos, row_len = query_bounds(layout, document_ids, cu_seqlens_padded)
    return dense_mask_from_bounds(start, pos, _key_positions(layout, keys, row_len, start.device), window=window)


def dense_mask_from_bounds(
    start: torch.Tensor, pos: torch.Tensor, key_pos: torch.Tensor, *, window: int | None = None
) -> torch.Tensor:
    """Bool ``[B, 1, L, K]``: ``start[b, q] <= key_pos[k] <= pos[q]`` (and ``pos[q] - key_pos[k] < window``).

    ``start`` int64 ``[B, L]``, ``pos`` int64 ``[L]`` (:func:`query_bounds`), ``key_pos`` int64 ``[K]``: the
    global position of each key (``arange(S)`` for keys in global order, the exchanged keys' otherwise).
    """
    k = key_pos[None, None, :]
    mask = (k >= start[:, :, None]) & (k <= pos[None, :, None])
    if window is not None:
        mask &= k > pos[None, :, None] - window
    return mask[:, None]


def flex_block_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    window: int | None = None,
    block_size: int = 128,
    keys: KeyOrder = "auto",
) -> Any:
    """The same predicate as :func:`document_causal_mask` as a flex-attention ``BlockMask``.

    ``Q_LEN = L`` (local queries), ``KV_LEN = S`` (global keys), batch ``B``,
    heads broadcast. Use with
    ``torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=...)``
    where ``k``/``v`` are gathered to global order. Built from the queries' key
    intervals (:func:`block_mask_from_bounds`), never the ``L x S`` grid.
    ``window`` and ``keys`` as in :func:`document_causal_mask`; over exchanged
    keys (``KV_LEN = L + n_recv``, ``k``/``v`` from
    :func:`cpdata.device.kv_exchange.exchange_tokens`) the mask is built by
    ``create_block_mask``, one predicate evaluation per tile.
    """
    _check_window(window)
    start, pos, row_len = query_bounds(layout, document_ids, cu_seqlens_padded)
    key_pos = _key_positions(layout, keys, row_len, start.device)
    if not (layout is not None and has_exchange(layout) and keys != "global"):  # global keys: one interval each
        return block_mask_from_bounds(start, pos, row_len, window=window, block_size=block_size)
    return block_mask_over_keys(start, pos, key_pos, window=window, block_size=block_size)


def block_mask_over_keys(
    start: torch.Tensor, pos: torch.Tensor, key_pos: torch.Tensor, *, window: int | None = None,
    block_size: int = 128,
) -> Any:
    """``BlockMask`` of ``start[b, q] <= key_pos[k] <= pos[q]`` (and ``pos[q] - key_pos[k] < window``).

    For keys in any order (``key_pos`` int64 ``[K]``, e.g. the exchanged keys of
    :func:`cpdata.device.kv_exchange.exchanged_key_positions`), so not one interval
    per query: ``create_block_mask`` evaluates the predicate over the ``L x K``
    grid (bool, in chunks on CUDA; ``K = L + n_recv``, smaller than the all-gather's ``S``).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    rows, local = start.shape

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        k = key_pos[kv_idx]
        keep = (k >= start[b, q_idx]) & (k <= pos[q_idx])
        if window is not None:
            keep = keep & (k > pos[q_idx] - window)
        return keep

    return create_block_mask(mask_mod, rows, None, local, key_pos.numel(), device=start.device, BLOCK_SIZE=block_size)


def block_mask_from_bounds(
    start: torch.Tensor, pos: torch.Tensor, row_len: int, *, window: int | None = None, block_size: int = 128
) -> Any:
    """``BlockMask`` of ``start[b, q] <= k <= pos[q]`` (and ``pos[q] - k < window``), without a dense mask.

    Args:
        start: int64 ``[B, L]``, each query's first key (its slot start).
        pos: int64 ``[L]``, each query's global position (its last key).
        row_len: ``S``, keys per row.

    Every query's keys are one interval ``[lo, pos]``, so a tile (query block x
    key block) is live iff some query's interval meets it and full iff every
    query of the tile covers it: two difference arrays over
    ``[B, L/128, S/128 + 1]`` (int32, 0.5 MiB at 128K and cp 8) instead of the
    ``L x S`` bool grid ``create_block_mask`` evaluates (2 GiB there). The
    result equals ``create_block_mask`` of the same predicate (tests compare
    them), padded tail tiles included (never full).
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows, local = start.shape
    device = start.device
    lo = start if window is None else torch.maximum(start, pos[None, :] - (window - 1))
    hi = pos[None, :].expand(rows, local)
    q_blocks, k_blocks = -(-local // block_size), -(-row_len // block_size)
    pad = q_blocks * block_size - local
    if pad:  # padded queries own no keys: their tiles are never full
        lo = torch.nn.functional.pad(lo, (0, pad), value=row_len)
        hi = torch.nn.functional.pad(hi, (0, pad), value=-1)
    q_block = torch.arange(q_blocks * block_size, device=device) // block_size
    flat = (torch.arange(rows, device=device)[:, None] * q_blocks + q_block[None, :]) * (k_blocks + 1)

    def cover(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Per tile, how many of its queries have ``first <= key block <= last``: ``[B, Qb, Kb]``."""
        ok = first <= last
        diff = torch.zeros(rows * q_blocks * (k_blocks + 1), dtype=torch.int32, device=device)
        one = ok.to(torch.int32).reshape(-1)
        diff.scatter_add_(0, (flat + first.clamp(0, k_blocks)).reshape(-1), one)
        diff.scatter_add_(0, (flat + (last + 1).clamp(0, k_blocks)).reshape(-1), -one)
        return diff.view(rows, q_blocks, k_blocks + 1).cumsum(-1)[..., :k_blocks]

    live = cover(lo // block_size, hi // block_size) > 0
    full = cover(-(-lo // block_size), (hi + 1) // block_size - 1) == block_size
    partial = live & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # torch's _dense_to_ordered
        dense = dense[:, None].to(torch.int32)
        return dense.sum(-1).to(torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(
            torch.int32
        )

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = (kv_idx >= start[b, q_idx]) & (kv_idx <= pos[q_idx])
        if window is not None:
            keep = keep & (kv_idx > pos[q_idx] - window)
        return keep

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=(block_size, block_size),
                                    mask_mod=mask_mod, seq_lengths=(local, row_len))  # fmt: skip
