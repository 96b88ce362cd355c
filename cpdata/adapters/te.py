"""Transformer Engine ``DotProductAttention`` arguments for a cpdata THD batch (torch only; TE not imported).

TE's THD partition (chunks ``r`` and ``2cp-1-r`` of every padded sequence) is cpdata's ``layout="thd"``;
``cu_seqlens_q/kv`` (real) and ``cu_seqlens_q/kv_padded`` (slots) are GLOBAL int32 ``[K+1]`` offsets and
``max_seqlen_q/kv`` GLOBAL Python ints (no ``.item()`` in TE). Worked example: docs/transformer-engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cpdata.device.presharded import batch_parts, info_int
from cpdata.gather import check_cp_group
from cpdata.worker.keys import INPUT_IDS

__all__ = ["TEAttentionArgs", "te_attention_kwargs", "te_forward_kwargs"]

CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather", "a2a")
_TE_LAYOUT = "thd"


@dataclass(frozen=True, kw_only=True, slots=True)
class TEAttentionArgs:
    """Arguments for TE's ``DotProductAttention``, split by where TE takes them."""

    forward: dict[str, Any]
    """Per step: ``dpa(q, k, v, **forward)`` (:func:`te_forward_kwargs`)."""
    context_parallel: dict[str, Any]
    """Once: ``dpa.set_context_parallel_group(**context_parallel)`` or the constructor: ``cp_group`` (None at
    cp = 1), ``cp_global_ranks``, ``cp_stream``, ``cp_comm_type``."""


def te_forward_kwargs(batch: Any, *, tensors: Any = None) -> dict[str, Any]:
    """The per-step half of :func:`te_attention_kwargs`, checked without a process group: at cp > 1 the batch
    must come from ``layout="thd"`` and hold one stream (``qkv_format="thd"``, or ``batch_size=1``)."""
    tensors, layout, info = batch_parts(batch, tensors)
    max_seqlen = info_int(info, "max_seqlen_padded")
    forward = {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": tensors["cu_seqlens"],
        "cu_seqlens_kv": tensors["cu_seqlens"],
        "cu_seqlens_q_padded": tensors["cu_seqlens_padded"],
        "cu_seqlens_kv_padded": tensors["cu_seqlens_padded"],
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
    }
    for key in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        if forward[key].dtype != torch.int32:
            raise ValueError(f"TE needs int32 {key}, the batch's is {forward[key].dtype}")
    if layout.cp_size == 1:
        return forward
    if info.get("layout") != _TE_LAYOUT:
        raise ValueError(
            f"TE's THD context parallelism expects its own partition (chunks r and 2cp-1-r of every sequence), "
            f"but this batch was laid out with layout={info.get('layout')!r} at cp_size={layout.cp_size}; "
            "build the pipeline with layout='thd'"
        )
    rows = tensors[INPUT_IDS].shape[:-1]
    if rows.numel() > 1:
        raise ValueError(
            f"TE's THD partition is over one stream, but this batch has {rows.numel()} rows of "
            f"{tuple(tensors[INPUT_IDS].shape)}; build the pipeline with qkv_format='thd' (or batch_size=1)"
        )
    return forward


def te_attention_kwargs(
    batch: Any, cp_group: Any = None, *, tensors: Any = None, cp_comm_type: str = "p2p", cp_stream: Any = None
) -> TEAttentionArgs:
    """TE THD attention arguments for this rank's batch (no device sync, no collective); ``cp_group`` is
    required at cp > 1 and checked against the layout; ``cp_comm_type`` is ``"p2p"``, ``"all_gather"`` or
    ``"a2a"`` (``"a2a+p2p"`` takes two sub-groups: build those yourself); pass the same ``cp_stream`` each step."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {list(CP_COMM_TYPES)}, got {cp_comm_type!r}")
    forward = te_forward_kwargs(batch, tensors=tensors)
    layout = batch.layout
    ranks = None
    if layout.cp_size == 1:
        cp_group = None
    else:
        if cp_group is None:
            raise ValueError(
                f"cp_size={layout.cp_size}: pass the CP process group as cp_group (cp_mesh.get_group())"
            )
        check_cp_group(layout, cp_group)
        ranks = dist.get_process_group_ranks(cp_group)
    return TEAttentionArgs(
        forward=forward,
        context_parallel={"cp_group": cp_group, "cp_global_ranks": ranks, "cp_stream": cp_stream,
                          "cp_comm_type": cp_comm_type},
    )  # fmt: skip
