"""``shard_batch`` for raw THD batches of Transformer Engine models (NeMo's TE/THD path, any CP size).

:func:`cpdata.thd_batch.to_thd_stream` flattens the rows; at cp > 1 every
token tensor is then cut by TE's partition (``thd_get_partitioned_indices``,
which is cpdata's ``thd`` layout: chunks ``r`` and ``2cp-1-r`` of every
document slot) and the metadata takes NeMo's cp > 1 form:

| key | cp = 1 | cp > 1 |
|---|---|---|
| ``cu_seqlens`` | real lengths (absorbed) | the slot offsets (``cu_seqlens_padded`` when emitted) |
| ``cu_seqlens_padded`` | when it differs | dropped |
| ``max_seqlen`` | ``max(diff(cu_seqlens))`` | widest slot |
| ``padding_mask`` | ``[T]`` | this rank's ``[T/cp]`` |
| ``cp_size``, ``cp_rank`` | — | Python ints |

Example (cp = 2, real [3, 5] in slots [4, 8]): rank 0 holds stream positions
``[0, 3, 4, 5, 10, 11]``, ``cu_seqlens=[0, 4, 12]``, ``max_seqlen=8``,
``padding_mask=[F, T, F, F, T, T]``.

Pipeline parallelism (``num_chunks > 1``): the ``B`` rows split into
``num_chunks`` equal groups, each converted on its own and stacked
(:mod:`cpdata.pp_chunks`); chunked batches have no single token layout.
mRoPE positions keep their leading dim (``[P, 1, T/cp]``); NeMo indexes
them on that dim at cp > 1, cpdata on the token dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpdata.cp_attention import AttentionContextFactory
from cpdata.keys import INPUT_IDS, LABELS, PADDING_MASK, POSITION_IDS
from cpdata.layouts import inverse_indices, rank_indices
from cpdata.pp_chunks import split_thd_chunks
from cpdata.presharded import mesh_group, mesh_rank_size
from cpdata.shard_layout import ShardLayout
from cpdata.thd_batch import SEQ_LENS_SENTINEL, to_thd_stream

__all__ = ["ThdShard", "shard_thd_stream"]

_INT_KEYS = (INPUT_IDS, LABELS, POSITION_IDS)  # NeMo casts these to int64 (token ids only, never hidden states)


def _partition(cu_out: torch.Tensor, total: int, size: int, rank: int) -> np.ndarray:
    """TE's partition of a stream whose document slots start at ``cu_out`` (sentinel entries ignored)."""
    offsets = np.asarray(cu_out.detach().cpu(), dtype=np.int64)
    offsets = offsets[offsets != SEQ_LENS_SENTINEL]
    return rank_indices("thd", size, np.diff(offsets), total)


def shard_thd_stream(
    tensors: dict[str, Any], dims: Mapping[str, int], cu_out: torch.Tensor, size: int, rank: int
) -> tuple[dict[str, Any], np.ndarray]:
    """This rank's tokens of one flat stream plus NeMo's cp > 1 metadata; returns ``(batch, rows)``."""
    total = int(tensors[INPUT_IDS].shape[0])
    rows = _partition(cu_out, total, size, rank)
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
    out.update(
        cu_seqlens=cu_out.to(torch.int32).contiguous(),
        max_seqlen=(offsets[1:] - offsets[:-1]).max().to(torch.int32),
        qkv_format="thd",
        cp_size=size,
        cp_rank=rank,
    )
    return out, rows


@dataclass(frozen=True, kw_only=True, slots=True)
class ThdShard:
    """``shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id)`` for a TE THD batch.

    Returns ``(ctx, batch, layout)``. One stream: a layout over the flat
    stream (``input_row_shape=(B, S)``), and at cp > 1 the CP attention ctx
    with document ids from the slots. Chunked: ``layout`` None (each chunk is
    its own token space, as in NeMo) and ``nullcontext`` (TE attends; there is
    no single stream for SDPA).
    """

    num_chunks: int = 1
    device: torch.device | None = None
    extra_seq_buffers: Mapping[str, int] = field(default_factory=dict)

    def __call__(self, cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id: int = 0):
        del tp_mesh, padding_token_id  # pads come from the lengths, never from token values
        rank, size = mesh_rank_size(cp_mesh)
        batch = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) and self.device else v
                 for k, v in batch.items()}  # fmt: skip
        if loss_mask is not None and self.device is not None:
            loss_mask = loss_mask.to(self.device, non_blocking=True)
        if self.num_chunks > 1:
            return contextlib.nullcontext, split_thd_chunks(batch, self.num_chunks, size, rank, loss_mask), None
        stream = to_thd_stream(batch, loss_mask=loss_mask, extra_seq_buffers=self.extra_seq_buffers)
        total = int(stream.slots.sum())
        if size <= 1:
            layout = ShardLayout(
                local_token_global_indices=torch.arange(total), padded_seq_len=total,
                input_row_shape=stream.row_shape, gather_index=torch.arange(total),
            )  # fmt: skip
            return contextlib.nullcontext, stream.batch, layout
        cu_out = stream.batch.get("cu_seqlens_padded", stream.batch["cu_seqlens"])
        out, rows = shard_thd_stream(stream.batch, stream.token_dims, cu_out, size, rank)
        local = torch.from_numpy(rows[rank])
        layout = ShardLayout(
            local_token_global_indices=local,
            padded_seq_len=total,
            input_row_shape=stream.row_shape,
            gather_index=torch.from_numpy(inverse_indices(rows)),
            cp_size=size,
            cp_rank=rank,
        )
        docs = torch.from_numpy(stream.document_ids()[rows[rank]]).to(out[INPUT_IDS].device)
        return AttentionContextFactory(layout, mesh_group(cp_mesh), docs), out, layout
