"""Full-sequence SDPA from this rank's shard: an override active inside a context, on one core (torch only).

Inside ``with ContextParallelAttention(layout, group):`` every call of
``torch.nn.functional.scaled_dot_product_attention`` whose query and key hold this rank's ``L`` tokens::

    k_g, v_g = move_keys_values(key, value)            [B, Hkv, cp*L, E]  one collective, global order
    mask     = lo(q) <= k_pos <= hi(q)                  cpdata.device.attention_masks' intervals
    out      = SDPA(query, k_g, v_g, mask, ...)         [B, H, L, Ev]      local order

equals full attention over the padded sequence, for every layout (``attn_mask`` rules: docs/usage.md).
Trade-off: full K/V and an ``L x cp*L`` bool mask, SDPA without flash: the correctness path, any device.
The patch is process-global: contexts nest, exit in LIFO order, one thread at a time. :class:`AttentionCore`
(its K/V movement and masks) is shared with the ``"cpdata"`` HF attention.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from cpdata.device.attention_masks import QuerySlots, check_window, document_slots, row_slots
from cpdata.device.consistency import DEFAULT_CHECK_EVERY, LayoutCheck
from cpdata.device.kv_exchange import exchanged_key_positions, has_exchange, move_keys_values
from cpdata.device.varlen import SDPA, KeyCopiesError, varlen_plan
from cpdata.gather import ensure_gather_index, layout_tensor_on
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["AttentionCore", "ContextParallelAttention", "LocalMaskPolicy", "active_contexts", "record_served_call"]

_PATCH_LOCK = threading.Lock()
_CHECKS: dict[int | None, LayoutCheck] = {}  # per interval: the contexts this process entered
_ACTIVE: list[ContextParallelAttention] = []  # entered contexts, innermost last (guarded by _PATCH_LOCK)
LocalMaskPolicy = Literal["refuse", "causal"]


def active_contexts() -> tuple[ContextParallelAttention, ...]:
    """The contexts entered and not yet left in this process, innermost last."""
    with _PATCH_LOCK:
        return tuple(_ACTIVE)


def record_served_call() -> None:
    """Count a call served by the ``"cpdata"`` HF attention in the innermost context (not a bypass of SDPA)."""
    with _PATCH_LOCK:
        if _ACTIVE:
            _ACTIVE[-1].served += 1


@dataclass(eq=False, kw_only=True)
class AttentionCore:
    """One batch's CP attention on this rank, for the SDPA override and the ``"cpdata"`` HF attention: the
    keys its queries attend over (the exchange plan's ``L + n_recv`` under a document mask, else all ``S`` in
    global order) and each query's key interval of them, built once. ``document_ids`` (``[L]`` or
    ``[B, L]``) and the offsets: as :func:`~cpdata.device.attention_masks.document_slots` (None: a query's
    slot is its row); ``whole_pack``: the queries are the whole pack at their local index (cp 1)."""

    layout: ShardLayout
    group: Any = None
    document_ids: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    whole_pack: bool = False
    _built: dict[tuple, Any] = field(default_factory=dict, repr=False)

    @property
    def exchange(self) -> bool:
        return self.document_ids is not None and not self.whole_pack and has_exchange(self.layout)

    def slots(self, device: torch.device) -> QuerySlots:
        """The local queries' slots on ``device`` (built once per device)."""
        key = ("slots", str(device))
        if key not in self._built:
            if self.document_ids is None:
                pos = layout_tensor_on(self.layout, "local_token_global_indices", device)
                self._built[key] = row_slots(pos, pos.numel() * self.layout.cp_size)
            else:
                self._built[key] = document_slots(None if self.whole_pack else self.layout,
                                                  self.document_ids.to(device), self.cu_seqlens_padded,
                                                  self.cu_seqlens)  # fmt: skip
        return self._built[key]

    def keys_values(self, key: torch.Tensor, value: torch.Tensor, seq_dim: int, *,
                    gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Local ``key``/``value`` -> the keys the queries attend, in one collective (``gathered``: all)."""
        exchange = self.exchange and not gathered
        if not exchange:  # the inverse map once (one index all-gather) where the worker did not build it
            self.layout = ensure_gather_index(self.layout, self.group)
        return move_keys_values(key, value, self.layout, self.group, exchange=exchange, seq_dim=seq_dim)

    def mask(self, kind: str, window: int | None, device: torch.device, *, causal: bool = True,
             gathered: bool = False) -> Any:  # fmt: skip
        """The mask ``kind``'s kernel takes over the keys of :meth:`keys_values`: ``"dense"`` bool
        ``[B, 1, L, K]``, ``"flex"`` a ``BlockMask``, ``"varlen"`` a :class:`~cpdata.device.varlen.VarlenPlan`
        (a refused one is kept and raised again: every layer falls back without re-planning)."""
        exchange = self.exchange and not gathered
        key = (kind, window, causal, exchange, str(device))
        if key not in self._built:
            slots = self.slots(device)
            keys = exchanged_key_positions(self.layout, device) if exchange else None
            if kind != "varlen":  # flex without exchanged keys: the interval path without the L x S grid
                self._built[key] = slots.mask(kind, keys, causal=causal, window=window)
            else:
                keys = torch.arange(slots.row_len, device=device) if keys is None else keys
                try:
                    self._built[key] = varlen_plan(slots.start, slots.pos, keys, window=window, device=device,
                                                   end=slots.end)  # fmt: skip
                except KeyCopiesError as refused:
                    self._built[key] = refused
        if isinstance(self._built[key], KeyCopiesError):
            raise self._built[key]
        return self._built[key]


class ContextParallelAttention:
    """Context manager: SDPA on local Q/K/V equals full-sequence attention at global positions."""

    def __init__(
        self,
        layout: ShardLayout,
        group: Any = None,
        *,
        document_ids: torch.Tensor | None = None,
        cu_seqlens_padded: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        local_attn_mask: LocalMaskPolicy = "refuse",
        check_every: int | None = DEFAULT_CHECK_EVERY,
        window: int | None = None,
        require_calls: bool = True,
    ) -> None:
        """Bind the override to one sharded batch (``layout`` with ``local_token_global_indices``).

        ``document_ids`` (``[L]`` or ``[B, L]``), ``cu_seqlens_padded``, ``cu_seqlens``: the document mask, as
        :func:`~cpdata.device.attention_masks.document_slots` (None: none). ``local_attn_mask``: an
        ``attn_mask`` over local keys is refused or replaced by the causal mask. ``check_every``: the
        :class:`~cpdata.device.consistency.LayoutCheck` interval. ``require_calls``: at cp > 1, raise on exit
        if no SDPA call was served.
        """
        if layout.local_token_global_indices is None:
            raise ValueError(
                "ContextParallelAttention needs layout.local_token_global_indices (this rank's global positions); "
                "pass the ShardLayout of a sharded batch (sharder.shard_layout)"
            )
        if local_attn_mask not in ("refuse", "causal"):
            raise ValueError(f"local_attn_mask={local_attn_mask!r}: use 'refuse' or 'causal'")
        check_window(window)
        if document_ids is not None and cu_seqlens_padded is None:
            raise ValueError("document_ids needs cu_seqlens_padded (the batch's slot offsets) to place each "
                             "document in global order; pass the batch's 'cu_seqlens_padded'")  # fmt: skip
        self.core = AttentionCore(layout=layout, group=group, document_ids=document_ids,
                                  cu_seqlens_padded=cu_seqlens_padded, cu_seqlens=cu_seqlens)  # fmt: skip
        self.window, self.local_attn_mask, self.require_calls = window, local_attn_mask, require_calls
        self.served = self.passed = 0
        self.local_len = int(layout.local_token_global_indices.numel())
        self._previous: Callable[..., torch.Tensor] | None = None
        self._patched: Callable[..., torch.Tensor] | None = None
        self._check = _CHECKS.setdefault(check_every, LayoutCheck(check_every))  # counts this process's contexts

    @property
    def layout(self) -> ShardLayout:
        """The batch's layout (with its inverse map once the first call built it)."""
        return self.core.layout

    def __enter__(self) -> ContextParallelAttention:
        self._check(self.layout, self.core.group)  # before patching: a mismatch raises with SDPA untouched
        with _PATCH_LOCK:
            if self._patched is not None:
                raise RuntimeError("this ContextParallelAttention is already active; create one per `with`")

            def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):  # fmt: skip
                return self.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

            patched.__doc__ = F.scaled_dot_product_attention.__doc__
            self._previous, self._patched = F.scaled_dot_product_attention, patched
            F.scaled_dot_product_attention = patched
            self.served = self.passed = 0
            _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type: object = None, *exc: object) -> None:
        with _PATCH_LOCK:
            if F.scaled_dot_product_attention is not self._patched:
                raise RuntimeError(
                    "scaled_dot_product_attention was replaced inside this ContextParallelAttention and not "
                    "restored; exit nested contexts in LIFO order"
                )
            F.scaled_dot_product_attention = self._previous
            self._previous = self._patched = None
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        if exc_type is None and self.require_calls and self.layout.cp_size > 1 and self.served + self.passed == 0:
            raise ValueError(
                f"no attention call reached scaled_dot_product_attention inside this ContextParallelAttention "
                f"(cp_size={self.layout.cp_size}): the model's attention does not call "
                "torch.nn.functional.scaled_dot_product_attention (HF 'eager', its own registered attention, "
                "or a kernel bound before the ctx), so each rank attended to its own tokens only. For a Hugging "
                "Face model use the 'cpdata' attention: cpdata.adapters.register_hf_attention(), "
                "model.set_attn_implementation('cpdata'), model(**hf_model_kwargs(batch, 'cpdata', ...)) "
                "(no ctx needed); other models: call F.scaled_dot_product_attention on the local Q/K/V "
                "(require_calls=False if this code makes no attention call on purpose)"
            )

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA of local ``query`` ``[..., H, L, E]`` against the gathered whole sequence (see the module)."""
        kernel_kwargs = {"dropout_p": dropout_p, "scale": scale, "enable_gqa": enable_gqa}
        n = self.local_len
        if query.shape[-2] != n or key.shape[-2] != n:
            self.passed += 1
            return SDPA(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kernel_kwargs)
        if attn_mask is not None and is_causal:
            raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
        core = self.core
        core.layout = ensure_gather_index(core.layout, core.group)  # its inverse (and CP size), built once
        global_len = n * core.layout.cp_size
        if attn_mask is not None and attn_mask.shape[-1] == n and n != global_len:
            if self.local_attn_mask == "refuse":
                raise ValueError(
                    f"attn_mask of shape {tuple(attn_mask.shape)} is over this rank's {n} local keys; under CP "
                    f"attention runs over all {global_len} keys. Call the model with attention_mask=None (causal "
                    "masking comes from the layout's global positions), pass a mask over the global keys, or "
                    "create the context with local_attn_mask='causal' to replace such masks by the causal mask"
                )
            attn_mask, is_causal = None, True
        if attn_mask is not None and attn_mask.shape[-1] != global_len:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)}: its last dim must be the {global_len} global keys "
                f"(or {n} local keys with local_attn_mask='causal')"
            )
        gathered = attn_mask is not None or not is_causal  # the plan's keys serve a causal document mask only
        key_g, value_g = core.keys_values(key, value, key.dim() - 2, gathered=gathered)
        doc, keep = core.document_ids, None
        if doc is not None or is_causal or self.window is not None:  # else attend all
            keep = core.mask("dense", self.window, query.device, causal=is_causal, gathered=gathered)
            keep = keep if doc is not None and doc.dim() == 2 else keep[0, 0]  # [B, 1, L, K] or [L, K]
        mask = attn_mask if keep is None else keep
        if attn_mask is not None and keep is not None:  # the caller's mask (bool or additive) within ours
            bool_mask = attn_mask.dtype == torch.bool
            mask = attn_mask & keep if bool_mask else attn_mask.masked_fill(~keep, -torch.inf)
        self.served += 1
        return SDPA(query, key_g, value_g, attn_mask=mask, is_causal=False, **kernel_kwargs)
