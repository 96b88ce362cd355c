"""The anchors: context-parallel sharding and gathering as trainers do it today (NeMo Automodel style).

In-step sharding (:func:`anchor_shard`): the step gets the full batch, copies it to the device, pads to a
multiple of ``2 * cp_size``, computes this rank's indices with torch ops and ``index_select``s every token
tensor (``round_robin``: torch ``context_parallel``'s head-tail split; ``thd``: Transformer Engine's
``thd_get_partitioned_indices`` in torch; ``contiguous``). In-step collate (:func:`anchor_collate`): ids,
shifted labels and positions built per document, padded and concatenated, plus ``cu_seqlens``. Gather
(:func:`anchor_gather`): autograd all-gather of the activations, all-gather of the index maps, ``argsort``,
one ``index_select``. On a CPU-only machine ``clone()`` models the host-to-device copy, for both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpdata.errors import check_choice
from cpdata.worker.keys import IGNORE_INDEX, LABELS, PADDING_MASK

__all__ = ["ANCHOR_LAYOUTS", "anchor_collate", "anchor_gather", "anchor_shard", "te_thd_partitioned_indices"]


def te_thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Torch transcription of TE's ``thd_partition_indices_kernel``: int64 ``[total_tokens // cp_size]``
    global positions of rank ``cp_rank``'s tokens, from int ``[n+1]`` slot offsets (each slot a multiple of
    ``2 * cp_size``, the last entry ``total_tokens``)."""
    cu_s = cu_seqlens_padded.to(torch.int64) // cp_size
    token_id = torch.arange(total_tokens // cp_size, device=cu_s.device)
    seq_id = torch.searchsorted(cu_s, token_id, right=True) - 1
    seq_id = seq_id.clamp_(max=cu_s.numel() - 2)
    start = cu_s[seq_id]
    seq_len = cu_s[seq_id + 1] - start
    index = token_id - start
    offset = torch.where(index < seq_len // 2, cp_rank, 2 * cp_size - 2 - cp_rank)
    return index + start * cp_size + seq_len // 2 * offset


def _round_robin(batch: Mapping[str, torch.Tensor], total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    device = batch["input_ids"].device
    c = total // (2 * cp_size)
    head = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    tail = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device)
    return torch.cat([head, tail])


def _thd(batch: Mapping[str, torch.Tensor], total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    cu = batch["cu_seqlens_padded"].to(torch.int64)
    cu = torch.cat([cu[:-1], cu.new_full((1,), total)])  # the last slot absorbs the step's padding
    return te_thd_partitioned_indices(cu, total, cp_size, cp_rank)


def _contiguous(batch: Mapping[str, torch.Tensor], total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    local = total // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=batch["input_ids"].device)


ANCHOR_LAYOUTS: dict[str, Callable[[Mapping[str, torch.Tensor], int, int, int], torch.Tensor]] = {
    "contiguous": _contiguous,
    "round_robin": _round_robin,
    "thd": _thd,
}
"""Layouts with an in-step anchor: name -> ``indices(batch, total, cp_size, cp_rank)``."""

_PAD_VALUES = {LABELS: IGNORE_INDEX, PADDING_MASK: True}


def anchor_collate(
    documents: Sequence[np.ndarray], *, capacity: int, doc_multiple: int = 1
) -> dict[str, torch.Tensor]:
    """The full pack built in the step from its documents: ``[1, capacity]`` ``input_ids``, ``labels`` (-100
    at each document's end and on pads), ``position_ids``, ``padding_mask``, and int32 ``cu_seqlens`` /
    ``cu_seqlens_padded`` (the tail joins the last slot)."""
    ids, labels, positions, masks, lens, padded = [], [], [], [], [], []
    for doc in documents:
        t = torch.from_numpy(np.asarray(doc, dtype=np.int64))
        n = t.numel()
        pad = (-n) % doc_multiple
        ids.append(F.pad(t, (0, pad), value=0))
        labels.append(F.pad(torch.cat([t[1:], t.new_full((1,), IGNORE_INDEX)]), (0, pad), value=IGNORE_INDEX))
        positions.append(torch.arange(n + pad))
        masks.append(torch.arange(n + pad) >= n)
        lens.append(n)
        padded.append(n + pad)
    tail = capacity - sum(padded)
    padded[-1] += tail
    out = {
        "input_ids": F.pad(torch.cat(ids), (0, tail), value=0),
        LABELS: F.pad(torch.cat(labels), (0, tail), value=IGNORE_INDEX),
        "position_ids": torch.cat([*positions[:-1], torch.arange(padded[-1])]),
        PADDING_MASK: F.pad(torch.cat(masks), (0, tail), value=True),
    }
    out = {k: v.unsqueeze(0) for k, v in out.items()}
    out["cu_seqlens"] = F.pad(torch.cumsum(torch.tensor(lens), 0), (1, 0)).to(torch.int32)
    out["cu_seqlens_padded"] = F.pad(torch.cumsum(torch.tensor(padded), 0), (1, 0)).to(torch.int32)
    return out


def anchor_shard(batch: Mapping[str, torch.Tensor], *, layout: str, cp_size: int, cp_rank: int,
                 device: torch.device, seq_dim: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(local_batch, indices)``: every tensor with ``S`` tokens on ``seq_dim`` ``index_select``ed to this
    rank's tokens in the step (others copied whole), and the int64 index map the gather needs."""
    check_choice("in-step anchor layout", layout, sorted(ANCHOR_LAYOUTS))
    # the host-to-device copy; on CPU a clone() stands in for it (the same bytes moved)
    on_device = {k: v.clone() if device.type == "cpu" else v.to(device, non_blocking=True)
                 for k, v in batch.items()}  # fmt: skip
    seq_len = on_device["input_ids"].shape[seq_dim]
    token_keys = [k for k, v in on_device.items() if v.dim() > seq_dim and v.shape[seq_dim] == seq_len]
    pad = (-seq_len) % (2 * cp_size)
    indices = ANCHOR_LAYOUTS[layout](on_device, seq_len + pad, cp_size, cp_rank)  # from slot offsets, not tokens
    for k in token_keys:  # padded to a multiple of 2 * cp, then this rank's tokens
        t = on_device[k]
        widths = [0, 0] * (t.dim() - 1 - seq_dim) + [0, pad]
        on_device[k] = F.pad(t, widths, value=_PAD_VALUES.get(k, 0)).index_select(seq_dim, indices)
    return on_device, indices


def anchor_gather(x_local: torch.Tensor, local_indices: torch.Tensor) -> torch.Tensor:
    """Differentiable gather of ``[B, L, ...]`` back to global order on dim 1, NeMo style (two collectives
    forward, see the module)."""
    from torch.distributed.nn.functional import all_gather

    full = torch.cat(all_gather(x_local), dim=1)
    maps = [torch.empty_like(local_indices) for _ in range(dist.get_world_size())]
    dist.all_gather(maps, local_indices.contiguous())
    return full.index_select(1, torch.argsort(torch.cat(maps)))
