"""``shard_batch`` for raw THD batches of Transformer Engine models (NeMo's TE/THD path, any CP size).

:func:`cpdata.nemo.thd_batch.to_thd_stream` flattens the rows; at cp > 1 every token tensor is cut by TE's
partition (``thd_get_partitioned_indices`` = cpdata's ``thd`` layout) and the metadata takes NeMo's cp > 1
form (docs/nemo.md). ``num_chunks > 1``: :mod:`cpdata.nemo.pp_chunks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from cpdata.device.cp_attention import AttentionContextFactory
from cpdata.device.presharded import mesh_group, mesh_rank_size, to_device
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.pp_chunks import split_thd_chunks
from cpdata.nemo.thd_batch import shard_thd_stream, to_thd_stream
from cpdata.worker.keys import INPUT_IDS

__all__ = ["THD_LOCAL_INDICES", "ThdShard"]

THD_LOCAL_INDICES = "_thd_local_indices"
"""NeMo 0.7.0's key for this rank's THD partition (NeMo's packed-VLM models pop it from the forward kwargs).
"""


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
        total = int(stream.slots.sum())
        if size <= 1:  # NeMo's cp = 1 keys: the stream as is, every position local
            out, rows = dict(stream.batch), np.arange(total, dtype=np.int64)[None]
        else:
            cu_out = stream.slot_offsets
            out, rows = shard_thd_stream(stream.batch, stream.token_dims, cu_out, size, rank)
        layout = ShardLayout.of_rows(rows, rank, input_row_shape=stream.row_shape)
        local = layout.local_token_global_indices
        out[THD_LOCAL_INDICES] = local.to(out[INPUT_IDS].device, non_blocking=True)
        if size <= 1:
            return contextlib.nullcontext, out, layout
        docs = torch.from_numpy(stream.document_ids()[rows[rank]]).to(out[INPUT_IDS].device)
        factory = AttentionContextFactory(layout, mesh_group(cp_mesh), docs, cu_out, stream.batch["cu_seqlens"])
        return factory, out, layout
