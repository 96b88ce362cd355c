"""``shard_batch`` for raw THD batches of Transformer Engine models (NeMo's TE/THD path, any CP size).

:func:`cpdata.nemo.thd_batch.to_thd_stream` flattens the rows; at cp > 1 every token tensor is cut by TE's
partition (``thd_get_partitioned_indices`` = cpdata's ``thd`` layout) and the metadata takes NeMo's cp > 1
form (docs/nemo.md).

``num_chunks > 1`` splits the batch into pipeline micro-batch chunks (NeMo's ``split_batch_into_thd_chunks``
contract, :func:`split_thd_chunks`): the ``B`` rows split into ``num_chunks`` equal groups (cpdata refuses a
remainder NeMo would drop), each one flat THD stream, stacked: token keys ``[C, T_c]``, ``cu_seqlens`` (and
``cu_seqlens_padded`` when any chunk emits it) int32 ``[C, n_max+1]`` right-padded with ``-1000``,
``max_seqlen`` ``[C]``; at cp > 1 each chunk cut by TE's partition, NeMo's key set plus a passed
``loss_mask``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.device.presharded import mesh_group, mesh_rank_size, to_device
from cpdata.errors import NotAvailableYetError
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.thd_batch import SEQ_LENS_SENTINEL, shard_thd_stream, to_thd_stream
from cpdata.worker.keys import INPUT_IDS, LABELS, LOSS_MASK, PADDING_MASK, POSITION_IDS

__all__ = ["THD_LOCAL_INDICES", "ThdShard", "split_thd_chunks"]

THD_LOCAL_INDICES = "_thd_local_indices"
"""NeMo 0.7.0's key for this rank's THD partition (NeMo's packed-VLM models pop it from the forward kwargs).
"""


_STACKED = (INPUT_IDS, LABELS, POSITION_IDS, PADDING_MASK)


def _ragged(rows: list[torch.Tensor]) -> torch.Tensor:
    """1-D offsets rows stacked ``[C, max n+1]``, right-padded with the sentinel (NeMo's ragged rows)."""
    return pad_sequence(rows, batch_first=True, padding_value=SEQ_LENS_SENTINEL)


def split_thd_chunks(
    batch: Mapping[str, Any], num_chunks: int, cp_size: int, cp_rank: int, loss_mask: torch.Tensor | None = None
) -> dict[str, Any]:
    """The stacked pipeline chunks of ``batch`` (see the module); this CP rank's tokens at ``cp_size > 1``."""
    rows = batch[INPUT_IDS].shape[0] if isinstance(batch.get(INPUT_IDS), torch.Tensor) else None
    if rows is None or rows % num_chunks:
        raise ValueError(
            f"num_chunks={num_chunks} must divide the batch's {rows} rows (each pipeline chunk takes B/num_chunks "
            "rows); change the micro-batch size or num_chunks"
        )
    position_ids = batch.get(POSITION_IDS)
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        raise NotAvailableYetError(
            "mRoPE position_ids [P, B, S] with num_chunks > 1 are not supported on the THD path (NeMo leaves "
            "them unvalidated too); use num_chunks=1 or 2-D position_ids"
        )
    per = rows // num_chunks
    streams = []
    for c in range(num_chunks):
        part = slice(c * per, (c + 1) * per)
        sub = {k: v[part] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
        streams.append(to_thd_stream(sub, loss_mask=loss_mask[part] if loss_mask is not None else None))
    keys = (*_STACKED, LOSS_MASK) if loss_mask is not None else _STACKED
    if cp_size > 1:
        cu_out = _ragged([s.slot_offsets for s in streams])
        parts = [shard_thd_stream(s.batch, s.token_dims, cu, cp_size, cp_rank)[0]
                 for s, cu in zip(streams, cu_out, strict=True)]  # fmt: skip
        out = {k: torch.stack([p[k] for p in parts]) for k in (*keys, "cu_seqlens", "max_seqlen")}
        out.update(qkv_format="thd", cp_size=cp_size, cp_rank=cp_rank)
        return out
    out: dict[str, Any] = {k: torch.stack([s.batch[k] for s in streams]) for k in keys}
    out["cu_seqlens"] = _ragged([s.batch["cu_seqlens"] for s in streams])
    if any("cu_seqlens_padded" in s.batch for s in streams):
        out["cu_seqlens_padded"] = _ragged([s.slot_offsets for s in streams])
    out["max_seqlen"] = torch.stack([s.batch["max_seqlen"] for s in streams])
    out.update({k: v for k, v in streams[0].batch.items() if not isinstance(v, torch.Tensor)})
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ThdShard:
    """``shard_batch`` for a TE THD batch -> ``(ctx, batch, layout)``: a layout over the flat stream
    (``input_row_shape=(B, S)``) and at cp > 1 the CP attention ctx; chunked: ``(nullcontext, batch, None)``.
    """

    num_chunks: int = 1
    device: torch.device | None = None
    extra_seq_buffers: Mapping[str, int] = field(default_factory=dict)

    def __call__(self, cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        del tp_mesh, padding_token_id  # pads come from the lengths, never from token values
        rank, size = mesh_rank_size(cp_mesh)
        batch = {k: to_device(v, self.device) for k, v in batch.items()}
        loss_mask = to_device(loss_mask, self.device)
        if self.num_chunks > 1:
            return contextlib.nullcontext, split_thd_chunks(batch, self.num_chunks, size, rank, loss_mask), None
        stream = to_thd_stream(batch, loss_mask=loss_mask, extra_seq_buffers=self.extra_seq_buffers)
        if size <= 1:  # NeMo's cp = 1 keys: the stream as is, every position local
            out, rows = dict(stream.batch), np.arange(int(stream.slots.sum()), dtype=np.int64)[None]
        else:
            out, rows = shard_thd_stream(stream.batch, stream.token_dims, stream.slot_offsets, size, rank)
        layout = ShardLayout.of_rows(rows, rank, input_row_shape=stream.row_shape)
        local = layout.local_token_global_indices
        out[THD_LOCAL_INDICES] = local.to(out[INPUT_IDS].device, non_blocking=True)
        if size <= 1:
            return contextlib.nullcontext, out, layout
        docs = torch.from_numpy(stream.document_ids()[rows[rank]]).to(out[INPUT_IDS].device)
        factory = AttentionContextFactory(layout, mesh_group(cp_mesh), docs, stream.slot_offsets,
                                          stream.batch["cu_seqlens"])  # fmt: skip
        return factory, out, layout
