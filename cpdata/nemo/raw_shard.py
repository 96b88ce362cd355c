"""On-device ``shard_batch`` for raw full ``[B, S]`` batches (NeMo Automodel's load-balanced path).

At cp > 1 (:class:`DeviceShard`): ``round_robin``, rows right-padded to a multiple of ``2*cp`` with semantic
pad values (:mod:`cpdata.worker.keys`), every token tensor ``index_select``-ed on device (O(S) host numpy for
the layout, one gather per tensor); which keys are sharded, passed through or refused: docs/nemo.md. At cp <=
1 (:func:`shard_identity`): the caller's batch, untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.device.presharded import PreshardedMove, is_presharded, mesh_group, mesh_rank_size, to_device
from cpdata.layout.maps import alignment, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.keys import (
    DOCUMENT_IDS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_MASK,
    PADDING_MASK,
    POSITION_IDS,
    STANDARD_TOKEN_KEYS,
)
from cpdata.worker.shard_block import hash63

__all__ = ["PASSTHROUGH_TOKEN_KEYS", "DeviceShard", "check_extra_buffers", "check_undeclared",
           "closed_form_indices", "primary_key", "shard_identity"]

INPUTS_EMBEDS = "inputs_embeds"
PASSTHROUGH_TOKEN_KEYS: tuple[str, ...] = ("mm_token_type_ids",)
"""Sequence-shaped keys that pass through unsharded (as NeMo passes them), besides ``_``-prefixed keys."""


def closed_form_indices(layout: str, cp_mesh: Any, padded_seq_len: int, device: Any = None) -> torch.Tensor:
    """This rank's global positions for a layout that needs no slot lengths (bind ``layout`` with
    ``functools.partial`` for a sharder's ``local_token_global_indices``)."""
    rank, size = mesh_rank_size(cp_mesh)
    return torch.from_numpy(rank_indices(layout, size, (), padded_seq_len)[rank]).to(device)


def primary_key(batch: Mapping[str, Any]) -> str:
    """``"inputs_embeds"`` or ``"input_ids"``: the tensor that defines a raw batch's rows (exactly one)."""
    has_embeds = isinstance(batch.get(INPUTS_EMBEDS), torch.Tensor)
    has_ids = isinstance(batch.get(INPUT_IDS), torch.Tensor)
    if has_embeds == has_ids:
        raise ValueError(
            f"a raw batch needs exactly one of {INPUT_IDS!r} [B, S] or {INPUTS_EMBEDS!r} [B, S, H] to define the "
            f"sequence; got keys {sorted(batch)}"
        )
    return INPUTS_EMBEDS if has_embeds else INPUT_IDS


def shard_identity(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
    """``shard_batch`` at cp <= 1: the caller's batch itself, nothing padded (with ``loss_mask``: a new dict
    of the same tensors). The layout records the row length, so ``trim=True`` works as at cp > 1."""
    del cp_mesh, tp_mesh, padding_token_id
    if loss_mask is not None:
        batch = {**batch, LOSS_MASK: loss_mask}
    primary = batch.get(INPUTS_EMBEDS, batch.get(INPUT_IDS))
    layout = None
    if isinstance(primary, torch.Tensor) and primary.dim() >= 2:
        layout = ShardLayout(original_seq_len=primary.shape[1], padded_seq_len=primary.shape[1])
    return contextlib.nullcontext, batch, layout


def _pad(t: torch.Tensor, dim: int, n: int, key: str, padding_token_id: int) -> torch.Tensor:
    """Right-pad ``t`` by ``n`` on ``dim`` with the key's semantic pad value (see cpdata.worker.keys)."""
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


def check_undeclared(out: Mapping[str, Any], dims: Mapping[str, int], primary: torch.Tensor) -> None:
    """Refuse a sequence-shaped tensor the shard does not know: it would stay at full length."""
    undeclared = sorted(
        k for k, v in out.items()
        if k not in dims and k not in PASSTHROUGH_TOKEN_KEYS and not k.startswith("_")
        and isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == primary.shape[:2]
    )  # fmt: skip
    if undeclared:
        raise ValueError(
            f"raw batch keys {undeclared} have the [B, S] shape of the primary {tuple(primary.shape[:2])} but are "
            "not token keys the sharder knows; pass extra_seq_buffers={name: seq_dim} to shard them, or drop them"
        )


def check_extra_buffers(batch: Mapping[str, Any], names: Any) -> None:
    """NeMo 0.7.0's ``KeyError`` for a declared extra sequence buffer the batch lacks (never sharded without
    it)."""
    for key in names or ():
        if key not in batch:
            raise KeyError(f"Extra CP sequence buffer {key!r} is missing from the batch")


def _digest(cp_size: int, pack_len: int, primary: torch.Tensor) -> int:
    """63-bit digest of the layout inputs; token ids are included when they are on the host."""
    head = f"round_robin|{cp_size}|{pack_len}|{tuple(primary.shape)}".encode()
    on_host = primary.device.type == "cpu" and not primary.is_floating_point()
    return hash63(head + (primary.detach().contiguous().numpy().tobytes() if on_host else b""))


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceShard:
    """``shard_batch`` -> ``(attention_ctx, dict of device tensors, ShardLayout)`` for raw batches at cp > 1
    (at cp <= 1 the identity); pre-sharded batches are only checked and copied."""

    device: torch.device | None = None
    extra_seq_buffers: Mapping[str, int] = field(default_factory=dict)

    def __call__(self, cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        if is_presharded(batch):
            if loss_mask is not None:
                raise ValueError(
                    "loss_mask= applies to raw full batches; a pre-sharded batch must carry its own "
                    "'loss_mask' key (add it on the workers) or shard it with sharder.shard_token_tensor"
                )
            return PreshardedMove(cp_mesh, self.device)(batch)
        rank, size = mesh_rank_size(cp_mesh)
        if size <= 1:
            return shard_identity(cp_mesh, tp_mesh, batch, loss_mask=loss_mask)
        out = {k: to_device(v, self.device) for k, v in batch.items()}
        mask = out.pop("attention_mask", None)  # it cannot apply to sharded keys; a [B, S] one marks the pads
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and PADDING_MASK not in out:
            out[PADDING_MASK] = ~mask.bool()
        if loss_mask is not None:
            out[LOSS_MASK] = to_device(loss_mask, self.device)
        key = primary_key(out)
        primary = out[key]
        if primary.dim() != (3 if key == INPUTS_EMBEDS else 2):
            raise ValueError(
                f"{key} of shape {tuple(primary.shape)}: a raw batch's {key} must be "
                f"{'[B, S, H]' if key == INPUTS_EMBEDS else '[B, S]'}"
            )
        b, seq_len = primary.shape[:2]  # global positions before sharding (NeMo's rule)
        pos = out.get(POSITION_IDS)
        if pos is None:
            out[POSITION_IDS] = torch.arange(seq_len, device=primary.device).expand(b, seq_len).contiguous()
        elif isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[0] == 1 and b > 1:
            out[POSITION_IDS] = pos.expand(b, -1).contiguous()
        dims = {key: 1}  # the primary's sequence dim; the other token keys' is their last
        dims.update({k: out[k].dim() - 1 for k in (*STANDARD_TOKEN_KEYS, LOSS_MASK)
                     if k != INPUT_IDS and isinstance(out.get(k), torch.Tensor)})  # fmt: skip
        check_extra_buffers(out, self.extra_seq_buffers)
        dims.update({k: d % out[k].dim() for k, d in self.extra_seq_buffers.items()})
        check_undeclared(out, dims, primary)
        pack_len = seq_len + (-seq_len) % alignment("round_robin", size)[1]
        for k, d in dims.items():  # every token tensor right-padded from seq_len to pack_len
            if out[k].shape[d] != seq_len:
                raise ValueError(
                    f"token tensor {k!r} has {out[k].shape[d]} tokens on dim {d} but the primary has "
                    f"{seq_len}; fix its length or declare its sequence dim in extra_seq_buffers"
                )
            if pack_len > seq_len:
                out[k] = _pad(out[k], d, pack_len - seq_len, k, padding_token_id)
        rows = rank_indices("round_robin", size, (), pack_len)
        digest = _digest(size, pack_len, batch[key])
        layout = ShardLayout.of_rows(rows, rank, original_seq_len=seq_len, digest=digest)
        index = layout.local_token_global_indices.to(primary.device, non_blocking=True)
        for k, d in dims.items():
            out[k] = out[k].index_select(d, index)
        return AttentionContextFactory.of_batch(layout, mesh_group(cp_mesh), out), out, layout  # cp > 1
