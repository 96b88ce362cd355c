"""A raw ``[B, S]`` THD batch as one flat packed stream with TE's metadata (NeMo's ``process_input_for_thd``).

Input: NeMo's packed collater output (``seq_lens`` / ``seq_lens_padded`` ``[B, n]``, ``-1000`` marks unused
entries); a flat ``[T]`` stream is one row. Output keys, trailing-pad absorption and where cpdata refuses what
NeMo would misalign: docs/nemo.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cpdata.errors import MissingBatchKeyError
from cpdata.layout.maps import rank_indices
from cpdata.layout.runs import segments
from cpdata.nemo.raw_shard import check_extra_buffers, check_undeclared
from cpdata.worker.keys import DOCUMENT_IDS, INPUT_IDS, LABELS, LOSS_MASK, PADDING_MASK, POSITION_IDS

__all__ = ["SEQ_LENS_SENTINEL", "ThdStream", "shard_thd_stream", "to_thd_stream"]

SEQ_LENS_SENTINEL = -1000
_REQUIRED = (INPUT_IDS, LABELS, POSITION_IDS, "seq_lens", "seq_lens_padded")  # NeMo's read order
_CONSUMED = ("seq_lens", "seq_lens_padded", "attention_mask", PADDING_MASK, LOSS_MASK)  # padding_mask: from the lengths
_TOKEN_KEYS = (INPUT_IDS, LABELS, POSITION_IDS, PADDING_MASK, DOCUMENT_IDS, LOSS_MASK)


@dataclass(frozen=True, kw_only=True, slots=True)
class ThdStream:
    """One flat stream and the host-side lengths that laid it out."""

    batch: dict[str, Any]
    """NeMo's THD keys (docs/nemo.md)."""
    token_dims: dict[str, int]
    """Token-aligned keys of ``batch`` → their (flat) sequence dim."""
    slots: np.ndarray
    """int64 ``[n]`` slot lengths after row-tail absorption; ``sum == T``."""
    row_shape: tuple[int, ...]
    """The caller's token shape: ``(B, S)`` of the rows before flattening, ``(T,)`` for a flat input."""

    @property
    def slot_offsets(self) -> torch.Tensor:
        """int32 ``[n+1]`` slot offsets: ``cu_seqlens_padded``, else ``cu_seqlens`` (they agree then)."""
        return self.batch.get("cu_seqlens_padded", self.batch["cu_seqlens"])

    def document_ids(self) -> np.ndarray:
        """int64 ``[T]``: the slot index of every stream position."""
        return np.repeat(np.arange(self.slots.size, dtype=np.int64), self.slots)


def _host_lengths(value: Any, key: str, rows: int) -> np.ndarray:
    lens = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value, dtype=np.int64)
    if lens.ndim == 1 and rows == 1:
        lens = lens[None]
    if lens.ndim != 2 or lens.shape[0] != rows:
        raise ValueError(f"{key} of shape {lens.shape} must be [B, n] with B={rows} rows (one list per row)")
    return lens


def _row_slots(real_all: np.ndarray, padded_all: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated (real, slot) lengths of every row; each row's tail joins its last slot."""
    if real_all.shape != padded_all.shape:
        raise ValueError(
            f"seq_lens {real_all.shape} and seq_lens_padded {padded_all.shape} must have the same [B, n] shape"
        )
    reals, slots = [], []
    for r, (real, padded) in enumerate(zip(real_all, padded_all, strict=True)):
        used = padded != SEQ_LENS_SENTINEL
        if not np.array_equal(used, real != SEQ_LENS_SENTINEL):
            raise ValueError(
                f"row {r}: seq_lens {real.tolist()} and seq_lens_padded {padded.tolist()} mark different entries "
                f"with the sentinel {SEQ_LENS_SENTINEL}; both must list the same documents"
            )
        real, padded = real[used], padded[used].copy()
        if (real < 0).any() or (real > padded).any():
            raise ValueError(
                f"row {r}: seq_lens {real.tolist()} must be >= 0 and <= seq_lens_padded {padded.tolist()} "
                "(a document's real length fits in its slot)"
            )
        tail = row_len - int(padded.sum())
        if tail < 0:
            raise ValueError(
                f"row {r}: seq_lens_padded {padded.tolist()} sum to {int(padded.sum())} > the row's {row_len} "
                "tokens; the slots must fit the row"
            )
        if padded.size:
            padded[-1] += tail  # the row's tail padding belongs to its last document (TE's rule)
        else:
            real, padded = np.zeros(1, np.int64), np.array([row_len], np.int64)
        reals.append(real)
        slots.append(padded)
    return np.concatenate(reals), np.concatenate(slots)


def to_thd_stream(batch: Mapping[str, Any], *, loss_mask: torch.Tensor | None = None,
                  extra_seq_buffers: Mapping[str, int] | None = None) -> ThdStream:
    """Flatten a raw THD batch and compute NeMo's metadata; ``loss_mask`` ``[B, S]`` and ``extra_seq_buffers``
    (name -> sequence dim of a tensor whose dims up to it end with ``[B, S]``) are flattened with the tokens.
    """
    for key in _REQUIRED:
        if key not in batch:
            raise MissingBatchKeyError(
                key,
                f"a qkv_format='thd' batch needs {list(_REQUIRED)} (NeMo's packed collater output); "
                f"got keys {sorted(batch)}",
            )
    check_extra_buffers(batch, extra_seq_buffers)
    if loss_mask is None and isinstance(batch.get(LOSS_MASK), torch.Tensor):
        loss_mask = batch[LOSS_MASK]
    caller_rows = tuple(batch[INPUT_IDS].shape[:2]) if isinstance(batch[INPUT_IDS], torch.Tensor) else ()
    if isinstance(batch[INPUT_IDS], torch.Tensor) and batch[INPUT_IDS].dim() == 1:  # one flat stream = one row
        extras = dict(extra_seq_buffers or {})
        batch = {k: v.unsqueeze(extras[k] % v.dim()) if k in extras
                 else v[None] if k in _TOKEN_KEYS and isinstance(v, torch.Tensor) and v.dim() == 1 else v
                 for k, v in batch.items()}  # fmt: skip
        extra_seq_buffers = {k: d % (batch[k].dim() - 1) + 1 for k, d in extras.items()}  # after the new row dim
        loss_mask = loss_mask[None] if loss_mask is not None and loss_mask.dim() == 1 else loss_mask
        caller_rows = caller_rows[:1]
    input_ids = batch[INPUT_IDS]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (2, 3):
        raise ValueError(
            f"THD input_ids must be a [B, S] token tensor or [B, S, H] hidden states, got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    b, s = input_ids.shape[:2]
    t = b * s
    real, slots = _row_slots(_host_lengths(batch["seq_lens"], "seq_lens", b),
                             _host_lengths(batch["seq_lens_padded"], "seq_lens_padded", b), s)  # fmt: skip
    cu, cu_padded = (np.concatenate([[0], np.cumsum(lens)]).astype(np.int64) for lens in (real, slots))
    if cu.size > 1 and np.array_equal(cu[:-1], cu_padded[:-1]) and cu[-1] < t:
        cu[-1] = t  # trailing-pad absorption: the last document takes the pack's tail
        cu_padded = cu.copy()
    device = input_ids.device

    def meta(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int32)).to(device)

    # a pad is a slot position past its document's real length (absorption does not make pads real)
    padding = segments(np.zeros_like(slots), slots) >= np.repeat(real, slots)
    out: dict[str, Any] = {
        INPUT_IDS: input_ids.reshape(t, *input_ids.shape[2:]),
        POSITION_IDS: _flat_positions(batch[POSITION_IDS], b, s),
        "cu_seqlens": meta(cu),
        LABELS: _flat_rows(batch[LABELS], LABELS, b, s),
        PADDING_MASK: torch.from_numpy(padding).to(device),
    }
    if not np.array_equal(cu, cu_padded):
        out["cu_seqlens_padded"] = meta(cu_padded)
    out["max_seqlen"] = torch.tensor(int(np.diff(cu).max()) if cu.size > 1 else 0, dtype=torch.int32, device=device)
    dims = {INPUT_IDS: 0, LABELS: 0, POSITION_IDS: out[POSITION_IDS].dim() - 1, PADDING_MASK: 0}
    if loss_mask is not None:
        out[LOSS_MASK], dims[LOSS_MASK] = _flat_rows(loss_mask, LOSS_MASK, b, s), 0
    if isinstance(batch.get(DOCUMENT_IDS), torch.Tensor):
        out[DOCUMENT_IDS], dims[DOCUMENT_IDS] = _flat_rows(batch[DOCUMENT_IDS], DOCUMENT_IDS, b, s), 0
    for key, dim in (extra_seq_buffers or {}).items():
        value = batch[key]
        dim %= value.dim()
        if tuple(value.shape[dim - 1 : dim + 1]) != (b, s):
            raise ValueError(
                f"extra sequence buffer {key!r} of shape {tuple(value.shape)} must have [B, S] = {(b, s)} ending "
                f"at its sequence dim {dim}"
            )
        out[key], dims[key] = value.flatten(dim - 1, dim), dim - 1
    rest = {k: v for k, v in batch.items() if k not in out and k not in _CONSUMED}
    check_undeclared(rest, {}, input_ids)  # a [B, S] tensor left unflattened beside the stream: refused
    out.update(rest)
    return ThdStream(batch=out, token_dims=dims, slots=slots, row_shape=caller_rows)


def _flat_rows(value: Any, key: str, b: int, s: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != (b, s):
        raise ValueError(f"{key} must be a [B, S] = {[b, s]} tensor like input_ids, got {getattr(value, 'shape', value)}")
    return value.reshape(b * s, *value.shape[2:])


def _flat_positions(position_ids: Any, b: int, s: int) -> torch.Tensor:
    """``[B, S]`` (or a shared ``[1, S]``) → ``[T]``; mRoPE ``[P, B, S]`` → ``[P, 1, T]``."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3 and tuple(position_ids.shape[1:]) == (b, s):
        return position_ids.reshape(position_ids.shape[0], 1, b * s)
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and tuple(position_ids.shape) == (1, s):
        position_ids = position_ids.expand(b, s)
    return _flat_rows(position_ids, POSITION_IDS, b, s)


_INT_KEYS = (INPUT_IDS, LABELS, POSITION_IDS)  # NeMo casts these to int64 (token ids only, never hidden states)


def shard_thd_stream(
    tensors: dict[str, Any], dims: Mapping[str, int], cu_out: torch.Tensor, size: int, rank: int
) -> tuple[dict[str, Any], np.ndarray]:
    """This rank's tokens of one flat stream plus NeMo's cp > 1 metadata; returns ``(batch, rows)``."""
    total = int(tensors[INPUT_IDS].shape[0])
    slot_starts = np.asarray(cu_out.detach().cpu(), dtype=np.int64)  # TE's partition over these slots
    rows = rank_indices("thd", size, np.diff(slot_starts[slot_starts != SEQ_LENS_SENTINEL]), total)
    index = torch.from_numpy(rows[rank]).to(tensors[INPUT_IDS].device)
    out = dict(tensors)
    for key, dim in dims.items():
        out[key] = out[key].index_select(dim, index).contiguous()
    for key in _INT_KEYS:
        if not out[key].is_floating_point():
            out[key] = out[key].to(torch.int64)
    out[PADDING_MASK] = out[PADDING_MASK].bool()
    out.pop("cu_seqlens_padded", None)
    offsets = cu_out[cu_out != SEQ_LENS_SENTINEL]
    out.update(cu_seqlens=cu_out.to(torch.int32).contiguous(),
               max_seqlen=(offsets[1:] - offsets[:-1]).max().to(torch.int32), qkv_format="thd", cp_size=size,
               cp_rank=rank)
    return out, rows
