"""The one mask of every CP attention: each local query keeps one interval of global key positions (torch only).

For local query ``q`` of row ``b`` and a key at global position ``key_pos[k]``::

    keep[b, q, k] = lo[b, q] <= key_pos[k] <= hi[b, q]

    real query (pos < end of its document):  lo = slot start,  hi = pos (causal) or end - 1 (bidirectional)
    pad query  (pos >= end):                 lo = hi = pos      its own key only
    window W:                                lo >= pos - W + 1  (and hi <= pos + W - 1 when bidirectional)

A slot is a document's span in global order (real tokens, then pads), ``end`` one past its last real token,
``pos`` the layout's ``local_token_global_indices``: a pad costs one diagonal tile, no softmax row is empty.
Forms: :func:`dense_mask` (bool, ``L*K`` bytes, full ``L x S`` work) and :func:`block_mask` (flex: the
kernel skips ruled-out blocks); for model code :func:`document_causal_mask` and :func:`flex_block_mask`.
No collective, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange
from cpdata.errors import check_int
from cpdata.gather import layout_tensor_on

if TYPE_CHECKING:
    from cpdata.layout.shard_layout import ShardLayout

__all__ = ["QuerySlots", "block_mask", "check_window", "dense_mask", "document_causal_mask", "document_slots",
           "flex_block_mask", "row_slots"]

KeyOrder = Literal["auto", "global", "exchange"]


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class QuerySlots:
    """Where each local query's document lies in its row's global order."""

    pos: torch.Tensor
    """int64 ``[L]``: each local query's global position."""
    start: torch.Tensor
    """int64 ``[B, L]``: the first key of the query's slot."""
    end: torch.Tensor
    """int64 ``[B, L]``: one past the slot's last real token (``pos >= end``: a pad query)."""
    row_len: int
    """``S``: keys per row in global order."""

    def intervals(self, *, causal: bool = True, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` int64 ``[B, L]``: the global key positions each query keeps (see the module)."""
        pos = self.pos[None, :]
        lo = self.start
        hi = pos.expand_as(lo) if causal else self.end - 1
        if window is not None:
            lo = torch.maximum(lo, pos - (window - 1))
            if not causal:
                hi = torch.minimum(hi, pos + (window - 1))
        real = pos < self.end
        return torch.where(real, lo, pos), torch.where(real, hi, pos)

    def mask(self, form: str, key_pos: torch.Tensor | None = None, *, causal: bool = True,
             window: int | None = None, block_size: int = 128) -> Any:  # fmt: skip
        """The keep-mask of :meth:`intervals` over keys at ``key_pos`` (int64 ``[K]``; None: the row's ``S``
        positions in order): ``"dense"`` bool ``[B, 1, L, K]`` or ``"flex"`` a ``BlockMask``."""
        lo, hi = self.intervals(causal=causal, window=window)
        if key_pos is not None:
            lo, hi = lo.to(key_pos.device), hi.to(key_pos.device)
        if form == "flex":
            return block_mask(lo, hi, self.row_len, key_pos=key_pos, block_size=block_size)
        keys = torch.arange(self.row_len, device=lo.device) if key_pos is None else key_pos
        return dense_mask(lo, hi, keys)


def row_slots(pos: torch.Tensor, row_len: int) -> QuerySlots:
    """Every query's slot is its whole row, without pads (no document mask)."""
    pos = pos.reshape(-1).to(torch.int64)
    return QuerySlots(pos=pos, start=torch.zeros_like(pos)[None], end=torch.full_like(pos, row_len)[None],
                      row_len=row_len)  # fmt: skip


def document_slots(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> QuerySlots:
    """Each local query's slot from ``document_ids`` (int ``[B, L]`` or ``[L]``) and the stream's slot offsets
    ``cu_seqlens_padded`` (int ``[K+1]``, rows of ``S`` concatenated). ``layout`` None: a whole pack on one rank.
    ``cu_seqlens`` (real lengths) given: pads see only themselves; None: pads attend like the last real token."""
    if document_ids.dim() not in (1, 2):
        raise ValueError(
            f"document_ids must be [L] (thd stream) or [B, L] (bshd rows), got shape {tuple(document_ids.shape)}"
        )
    doc = document_ids.reshape(-1, document_ids.shape[-1]).to(torch.int64)
    rows, local = doc.shape
    device = doc.device
    if layout is None:  # the whole pack on one rank: every position is local
        pos, row_len = torch.arange(local, device=device), local
    else:
        if layout.local_token_global_indices is None:
            raise ValueError("layout.local_token_global_indices is None; pass the ShardLayout the batch came with")
        pos = layout_tensor_on(layout, "local_token_global_indices", device).reshape(-1).to(torch.int64)
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
    start = cu[doc] - row_offset
    if cu_seqlens is None:
        end = cu[doc + 1] - row_offset
    else:
        real = cu_seqlens.to(device=device, dtype=torch.int64).reshape(-1)
        if real.numel() != cu.numel():
            raise ValueError(f"cu_seqlens has {real.numel()} entries and cu_seqlens_padded {cu.numel()}: pass the "
                             "same batch's offsets")  # fmt: skip
        end = start + (real[doc + 1] - real[doc])
    return QuerySlots(pos=pos, start=start, end=end, row_len=row_len)


def check_window(window: int | None) -> None:
    """``ValueError`` unless ``window`` is None or a positive int."""
    check_int("window", window, min=1, optional=True, fix=" (a sliding window's keys; None: no window)")


def dense_mask(lo: torch.Tensor, hi: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, 1, L, K]``: ``lo[b, q] <= key_pos[k] <= hi[b, q]`` (``key_pos`` int64 ``[K]``)."""
    k = key_pos[None, None, :]
    return ((k >= lo[:, :, None]) & (k <= hi[:, :, None]))[:, None]


def block_mask(
    lo: torch.Tensor, hi: torch.Tensor, row_len: int, *, key_pos: torch.Tensor | None = None, block_size: int = 128
) -> Any:
    """``BlockMask`` of ``lo[b, q] <= key_pos[k] <= hi[b, q]``. ``key_pos`` None (``arange(row_len)``): two
    difference arrays over ``[B, L/128, S/128 + 1]`` tiles, equal to ``create_block_mask`` without its ``L x S``
    grid; keys in any order (int64 ``[K]``): ``create_block_mask`` over ``L x K``."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    rows, local = lo.shape
    device = lo.device
    if key_pos is not None:

        def over_keys(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            k = key_pos[kv_idx]
            return (k >= lo[b, q_idx]) & (k <= hi[b, q_idx])

        return create_block_mask(over_keys, rows, None, local, key_pos.numel(), device=device, BLOCK_SIZE=block_size)

    q_blocks, k_blocks = -(-local // block_size), -(-row_len // block_size)
    pad = (0, q_blocks * block_size - local)  # padded queries own no keys: their tiles are never full
    first, last = (torch.nn.functional.pad(t, pad, value=v) for t, v in ((lo, row_len), (hi, -1)))
    q_block = torch.arange(q_blocks * block_size, device=device) // block_size
    flat = (torch.arange(rows, device=device)[:, None] * q_blocks + q_block[None, :]) * (k_blocks + 1)

    def cover(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per tile, how many of its queries have ``a <= key block <= b``: ``[B, Qb, Kb]``."""
        one = (a <= b).to(torch.int32).reshape(-1)
        diff = torch.zeros(rows * q_blocks * (k_blocks + 1), dtype=torch.int32, device=device)
        diff.scatter_add_(0, (flat + a.clamp(0, k_blocks)).reshape(-1), one)
        diff.scatter_add_(0, (flat + (b + 1).clamp(0, k_blocks)).reshape(-1), -one)
        return diff.view(rows, q_blocks, k_blocks + 1).cumsum(-1)[..., :k_blocks]

    live = cover(first // block_size, last // block_size) > 0
    full = cover(-(-first // block_size), (last + 1) // block_size - 1) == block_size
    partial = live & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # torch's _dense_to_ordered
        dense = dense[:, None].to(torch.int32)
        order = torch.argsort(dense, dim=-1, descending=True, stable=True)
        return dense.sum(-1).to(torch.int32), order.to(torch.int32)

    def in_order(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx >= lo[b, q_idx]) & (kv_idx <= hi[b, q_idx])

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=(block_size, block_size),
                                    mask_mod=in_order, seq_lengths=(local, row_len))  # fmt: skip


def _model_slots(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    window: int | None,
    keys: KeyOrder,
) -> tuple[QuerySlots, torch.Tensor | None]:
    """The queries' slots and the exchanged keys' positions (None: keys in global order)."""
    check_window(window)
    if keys not in ("auto", "global", "exchange"):
        raise ValueError(f"keys={keys!r}: use 'auto' (exchanged keys when the layout has a plan), 'global' "
                         "or 'exchange'")  # fmt: skip
    exchanged = layout is not None and has_exchange(layout)
    if keys == "exchange" and not exchanged:
        raise ValueError("keys='exchange' needs a layout with a K/V exchange plan (layout.kv_exchange); "
                         "build the batches with kv_exchange=True, or pass keys='global'")  # fmt: skip
    slots = document_slots(layout, document_ids, cu_seqlens_padded, cu_seqlens)
    exchange = exchanged and keys != "global"
    return slots, exchanged_key_positions(layout, slots.pos.device) if exchange else None


def document_causal_mask(
    layout: ShardLayout | None,
    document_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    window: int | None = None,
    keys: KeyOrder = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense bool mask ``[B, 1, L, S]`` (True = attend) of local queries over global keys, ``[B, 1, L, K]``
    over exchanged ones. ``layout`` (None: a whole pack on one rank), ``document_ids`` (``[B, L]`` or
    ``[L]``), ``cu_seqlens_padded``, ``cu_seqlens``: as :func:`document_slots`. ``window``: keep keys with
    ``pos(q) - k < window``. ``keys``: ``"auto"`` (exchanged when ``layout.kv_exchange`` is set), ``"global"``
    (a row's ``S`` positions in order) or ``"exchange"`` (refused without a plan)."""
    slots, key_pos = _model_slots(layout, document_ids, cu_seqlens_padded, cu_seqlens, window, keys)
    return slots.mask("dense", key_pos, window=window)


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
    slots, key_pos = _model_slots(layout, document_ids, cu_seqlens_padded, cu_seqlens, window, keys)
    return slots.mask("flex", key_pos, window=window, block_size=block_size)
