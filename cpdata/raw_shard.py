"""On-device ``shard_batch`` functions: pre-sharded batches and raw full batches.

Two entry points share one callable, :class:`DeviceShard`:

- **pre-sharded** (the normal path): the workers already handed this rank its
  tokens plus a :class:`ShardLayout`. The sharder only copies the tensors to the
  device (``non_blocking``) after checking the layout was built for this CP size
  and rank. No padding, no index math.
- **raw full batch** (drop-in for trainers that shard in the step): the same
  layout functions the workers use (:func:`cpdata.layouts.rank_indices`,
  :func:`~cpdata.layouts.inverse_indices`) run on CPU numpy from the batch's
  lengths, then every token-aligned tensor is ``index_select``-ed on device.
  For the collated pack of the workers, the result is bit-identical to the
  worker's ``full[..., rows[rank]]``.

Which layout a raw batch gets is decided once, by :func:`resolve_plan` (one
table: ``qkv_format == "thd"`` → flat stream, ``thd`` layout; otherwise rows,
``round_robin``; ``identity`` when CP is off). Layout cost: O(pack_len) numpy
on the host (a few ms at 128K tokens) plus one gather per token tensor on device.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpdata.cp_attention import AttentionContextFactory
from cpdata.keys import (
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    PADDING_MASK,
    POSITION_IDS,
    STANDARD_TOKEN_KEYS,
)
from cpdata.layouts import alignment, inverse_indices, rank_indices
from cpdata.shard_layout import ShardLayout

__all__ = [
    "DeviceShard",
    "attention_ctx",
    "ShardPlan",
    "closed_form_indices",
    "is_presharded",
    "mesh_rank_size",
    "resolve_plan",
]

SLOT_KEYS: tuple[str, ...] = ("seq_lens_padded", "cu_seqlens_padded")


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPlan:
    """How a raw full batch is laid out on device."""

    layout: str
    """A name from :data:`cpdata.layouts.LAYOUTS`."""
    flat: bool
    """Tokens form one flat stream: ``input_ids``-shaped row dims are flattened
    to ``[T]`` (no padding; the slots must already meet the layout's alignment)
    and ``input_row_shape`` is recorded. Otherwise rows ``[..., S]`` are
    right-padded to the layout's pack multiple and ``original_seq_len`` is recorded."""
    uses_slots: bool
    """The partition depends on the document slots (``seq_lens_padded``), so
    no closed-form index map exists before the first shard."""


# batch property -> plan, the one place a layout is chosen: (cp_size > 1, qkv_format == "thd").
_PLANS: dict[tuple[bool, bool], ShardPlan] = {
    (False, False): ShardPlan(layout="identity", flat=False, uses_slots=False),
    (False, True): ShardPlan(layout="identity", flat=True, uses_slots=False),
    (True, False): ShardPlan(layout="round_robin", flat=False, uses_slots=False),
    (True, True): ShardPlan(layout="thd", flat=True, uses_slots=True),
}


def resolve_plan(batch: Mapping[str, Any], cp_size: int) -> ShardPlan:
    """The plan for a raw batch at ``cp_size`` (see the module docstring)."""
    return _PLANS[(cp_size > 1, batch.get("qkv_format") == "thd")]


def mesh_rank_size(cp_mesh: Any) -> tuple[int, int]:
    """``(cp_rank, cp_size)`` of a CP (sub)mesh; ``(0, 1)`` without one."""
    if cp_mesh is None:
        return 0, 1
    return int(cp_mesh.get_local_rank()), int(cp_mesh.size())


def is_presharded(batch: Any) -> bool:
    """A worker-sharded batch: a Mapping carrying ``.layout`` (a ShardLayout)."""
    return isinstance(batch, Mapping) and isinstance(getattr(batch, "layout", None), ShardLayout)


def closed_form_indices(layout: str, cp_mesh: Any, padded_seq_len: int, device: Any = None) -> torch.Tensor:
    """This rank's global positions for a layout that needs no slot lengths.

    Bind ``layout`` with ``functools.partial`` to get the sharder's
    ``local_token_global_indices(cp_mesh, padded_seq_len, device)``.
    """
    rank, size = mesh_rank_size(cp_mesh)
    return torch.from_numpy(rank_indices(layout, size, (), padded_seq_len)[rank]).to(device)


def _to(value: Any, device: torch.device | None) -> Any:
    if device is None or not isinstance(value, torch.Tensor):
        return value
    return value.to(device, non_blocking=True)


def _shard_presharded(cp_mesh: Any, batch: Mapping[str, Any], device: torch.device | None):
    layout: ShardLayout = batch.layout
    rank, size = mesh_rank_size(cp_mesh)
    if layout.cp_size != size:
        raise ValueError(
            f"pre-sharded batch was laid out for cp_size={layout.cp_size} but the CP mesh has cp_size={size}; "
            f"build the data pipeline with cp_size={size}"
        )
    if layout.cp_rank != rank:
        raise ValueError(
            f"pre-sharded batch holds the tokens of cp_rank={layout.cp_rank} but this process is cp_rank={rank}; "
            "give each rank's pipeline its own CP rank (the CP mesh's local rank)"
        )
    on_device = device is None or all(v.device == device for v in batch.values() if isinstance(v, torch.Tensor))
    if not on_device and callable(getattr(batch, "to", None)):  # ShardedBatch: one copy of its buffer
        out = dict(batch.to(device, non_blocking=True))
    else:
        out = {k: _to(v, device) for k, v in batch.items()}
    return attention_ctx(cp_mesh, layout, out), out, layout


def attention_ctx(cp_mesh: Any, layout: ShardLayout, tensors: Mapping[str, Any]) -> Callable[..., Any]:
    """The ctx factory ``shard()`` returns: ``nullcontext`` at cp <= 1, else CP attention over ``layout``.

    At cp > 1, ``ctx()`` makes SDPA on local Q/K/V attend over the whole
    sequence (:class:`cpdata.cp_attention.ContextParallelAttention`);
    ``ctx(document_mask=True)`` adds the document mask from the batch's
    ``document_ids``.
    """
    if layout.cp_size <= 1:
        return contextlib.nullcontext
    doc = tensors.get(DOCUMENT_IDS)
    get_group = getattr(cp_mesh, "get_group", None)  # a mesh without groups (one process) uses the default group
    group = get_group() if get_group is not None else None
    return AttentionContextFactory(layout, group, doc if isinstance(doc, torch.Tensor) else None)


def _pad(t: torch.Tensor, dim: int, n: int, key: str, padding_token_id: int) -> torch.Tensor:
    """Right-pad ``t`` by ``n`` on ``dim`` with the key's semantic pad value (see cpdata.keys)."""
    last = t.narrow(dim, t.shape[dim] - 1, 1)
    shape = list(t.shape)
    shape[dim] = n
    if key == POSITION_IDS:  # continue the document
        step = [1] * t.dim()
        step[dim] = n
        pad = last + torch.arange(1, n + 1, dtype=t.dtype, device=t.device).view(step)
    elif key == DOCUMENT_IDS:  # pads belong to the last slot
        pad = last.expand(shape)
    else:
        fill = {INPUT_IDS: padding_token_id, LABELS: IGNORE_INDEX, PADDING_MASK: True}.get(key, 0)
        pad = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    return torch.cat((t, pad), dim=dim)


def _flatten(out: dict[str, Any], dims: dict[str, int]) -> int:
    """Flatten every token tensor's row dims (``input_ids``' shape) in place; return the stream length."""
    row_shape = tuple(out[INPUT_IDS].shape)
    for key, d in dims.items():
        first = d - len(row_shape) + 1
        if first < 0 or tuple(out[key].shape[first : d + 1]) != row_shape:
            raise ValueError(
                f"token tensor {key!r} of shape {tuple(out[key].shape)} (sequence dim {d}) does not end its "
                f"row dims with input_ids' shape {row_shape}; a flat (thd) stream flattens those dims"
            )
        out[key], dims[key] = out[key].flatten(first, d), first
    return math.prod(row_shape)


def _pad_rows(out: dict[str, Any], dims: dict[str, int], pack_len: int, padding_token_id: int) -> None:
    """Right-pad every token tensor in place from ``input_ids``' length to ``pack_len``."""
    seq_len = out[INPUT_IDS].shape[-1]
    for key, d in dims.items():
        if out[key].shape[d] != seq_len:
            raise ValueError(
                f"token tensor {key!r} has {out[key].shape[d]} tokens on dim {d} but input_ids has "
                f"{seq_len}; fix its length or declare its sequence dim in extra_seq_buffers"
            )
        if pack_len > seq_len:
            out[key] = _pad(out[key], d, pack_len - seq_len, key, padding_token_id)


def _slot_lens(batch: Mapping[str, Any], row_len: int) -> np.ndarray:
    """Document slot lengths of a flat stream, read on the host.

    ``seq_lens_padded`` ``[n]`` (or ``[B, n]`` per row, negative entries =
    unused sentinels; each row's tail joins its last slot), else
    ``cu_seqlens_padded`` ``[n+1]``.
    """
    if "seq_lens_padded" in batch:
        lens = np.asarray(batch["seq_lens_padded"].detach().cpu(), dtype=np.int64)
        if lens.ndim < 2:
            return lens.reshape(-1)
        rows = []
        for row in lens.reshape(lens.shape[0], -1):
            row = row[row >= 0].copy()
            if row.size:
                row[-1] += row_len - int(row.sum())
            else:  # a row of sentinels only: one padding slot, so later rows keep their offsets
                row = np.array([row_len], dtype=np.int64)
            rows.append(row)
        return np.concatenate(rows)
    if "cu_seqlens_padded" in batch:
        return np.diff(np.asarray(batch["cu_seqlens_padded"].detach().cpu(), dtype=np.int64).reshape(-1))
    raise ValueError(
        f"a qkv_format='thd' batch needs its document slots for the layout: add one of {list(SLOT_KEYS)} "
        f"(got keys {sorted(batch)})"
    )


def _attention_to_padding_mask(out: dict[str, Any]) -> None:
    """A ``[B, S]`` ``attention_mask`` (1 = token) becomes ``padding_mask`` (True = pad), as trainers expect."""
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and PADDING_MASK not in out:
        out[PADDING_MASK] = ~mask.bool()
        del out["attention_mask"]


def _check_undeclared(out: Mapping[str, Any], dims: Mapping[str, int], input_ids: torch.Tensor) -> None:
    """Refuse a token-shaped tensor the shard does not know: it would pass through at full length."""
    undeclared = sorted(
        k for k, v in out.items()
        if k not in dims and isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == input_ids.shape[:2]
    )  # fmt: skip
    if undeclared:
        raise ValueError(
            f"raw batch keys {undeclared} have the shape of {INPUT_IDS!r} {tuple(input_ids.shape)} but are not "
            "token keys the sharder knows; pass extra_seq_buffers={name: seq_dim} to shard them, or drop them"
        )


def _digest(plan: ShardPlan, cp_size: int, pack_len: int, slots: np.ndarray, input_ids: torch.Tensor) -> int:
    """63-bit digest of the layout inputs; token ids are included when they are on the host."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{plan.layout}|{plan.flat}|{cp_size}|{pack_len}|{tuple(input_ids.shape)}".encode())
    h.update(np.ascontiguousarray(slots, dtype=np.int64).tobytes())
    if input_ids.device.type == "cpu":
        h.update(input_ids.detach().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceShard:
    """A ``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id)`` callable.

    Returns ``(ctx_factory, dict_of_device_tensors, ShardLayout)``; the ctx is
    :func:`attention_ctx` (CP attention at cp > 1, ``nullcontext`` otherwise).
    Token-aligned keys: :data:`~cpdata.keys.STANDARD_TOKEN_KEYS` and
    ``loss_mask`` (sequence on their last dim) plus ``extra_seq_buffers``
    (name → sequence dim). A ``[B, S]`` ``attention_mask`` is replaced by
    ``padding_mask`` (True = pad). Any other tensor shaped like ``input_ids``
    is refused (it would pass through unsharded); everything else (stream
    metadata, ``qkv_format``) passes through unsharded; tensors move to ``device``.
    """

    plan: ShardPlan
    device: torch.device | None = None
    extra_seq_buffers: Mapping[str, int] = field(default_factory=dict)

    def __call__(self, cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        del tp_mesh  # CP shards the sequence only; TP ranks of one CP rank hold the same tokens
        if is_presharded(batch):
            if loss_mask is not None:
                raise ValueError(
                    "loss_mask= applies to raw full batches; a pre-sharded batch must carry its own "
                    "'loss_mask' key (add it on the workers) or shard it with sharder.shard_token_tensor"
                )
            return _shard_presharded(cp_mesh, batch, self.device)
        rank, size = mesh_rank_size(cp_mesh)
        out = {k: _to(v, self.device) for k, v in batch.items()}
        _attention_to_padding_mask(out)
        if loss_mask is not None:
            out[LOSS_MASK] = _to(loss_mask, self.device)
        if not isinstance(out.get(INPUT_IDS), torch.Tensor):
            raise ValueError(
                f"a raw batch needs an {INPUT_IDS!r} tensor to define the sequence; got keys {sorted(out)}"
            )
        dims = {
            k: out[k].dim() - 1
            for k in (*STANDARD_TOKEN_KEYS, LOSS_MASK)
            if isinstance(out.get(k), torch.Tensor)
        }
        dims.update({k: d % out[k].dim() for k, d in self.extra_seq_buffers.items() if k in out})
        input_ids = out[INPUT_IDS]
        _check_undeclared(out, dims, input_ids)
        if self.plan.flat:
            pack_len, original, rows_shape = _flatten(out, dims), None, tuple(input_ids.shape)
            slots = _slot_lens(batch, rows_shape[-1]) if self.plan.uses_slots else np.zeros(0, np.int64)
        else:
            original, rows_shape, slots = input_ids.shape[-1], None, np.zeros(0, np.int64)
            pack_len = original + (-original) % alignment(self.plan.layout, size)[1]
            _pad_rows(out, dims, pack_len, padding_token_id)
        rows = rank_indices(self.plan.layout, size, slots, pack_len)
        local = torch.from_numpy(rows[rank])
        if not np.array_equal(rows[rank], np.arange(pack_len)):  # identity: nothing moves
            index = local.to(input_ids.device, non_blocking=True)
            for key, d in dims.items():
                out[key] = out[key].index_select(d, index)
        layout = ShardLayout(
            local_token_global_indices=local,
            original_seq_len=original,
            padded_seq_len=pack_len,
            input_row_shape=rows_shape,
            gather_index=torch.from_numpy(inverse_indices(rows)),
            cp_size=size,
            cp_rank=rank,
            digest=_digest(self.plan, size, pack_len, slots, batch[INPUT_IDS]),
        )
        return attention_ctx(cp_mesh, layout, out), out, layout
