"""Keyword arguments for a Hugging Face ``transformers`` causal LM on a cpdata batch (torch only).

``model(**hf_model_kwargs(batch, model.config._attn_implementation))`` runs a
packed batch as one padding-free row ``[1, T]`` with every document boundary
explicit:

- ``input_ids``, ``position_ids``: ``[1, T]`` (rows of a bshd batch are
  concatenated; positions restart per document and continue through pads).
- ``labels`` and ``shift_labels``: both the batch's labels, which are already
  next-token targets. ``ForCausalLMLoss`` (transformers >= 4.50) uses
  ``shift_labels`` as given and does not shift again; ``labels`` only has to be
  non-None for the model to compute a loss. (A model whose own loss ignores
  ``shift_labels`` would shift the targets again: check its ``loss_function``.)
- ``use_cache=False``; ``num_items_in_batch`` when given (see below).
- boundaries for the attention implementation named:

  ============================  ==========================================================
  ``flash_attention_*``         ``cu_seq_lens_q/k`` (int32, slot offsets of the stream),
                                ``max_length_q/k`` (Python ints, from ``batch.info``)
  ``sdpa``                      ``attention_mask``: bool ``[1, 1, T, S]`` document-causal
  ``eager``                     ``attention_mask``: float32 ``[1, 1, T, S]``, 0 or the
                                dtype's minimum (eager adds it to the scores)
  ``flex_attention``            ``attention_mask``: a flex ``BlockMask``
  ============================  ==========================================================

Why explicit: without them transformers derives segments from
``position_ids`` (a new segment where positions restart at 0, or where they
do not increase by one). A document split across packs continues at a position
> 0, so that rule merges it into the previous document (flash varlen) or
depends on where the previous slot's pads end (sdpa). With these arguments no
rule is guessed. Flash slots include their pads (real tokens first, so real
queries never see them; pads have no targets).

Nothing cpdata-specific (``padding_mask``, ``document_ids``, ``cu_seqlens``
& co.) is passed to the model.

Context parallelism (``cp_size > 1``): HF attention is not CP-aware; run the
model inside the sharder's ctx, whose SDPA override gathers K/V from every CP
rank, with ``attn_implementation="sdpa"``: ``attention_mask`` is then the
document-causal mask of this rank's queries over the gathered global keys
(``S = cp * T``). flash/eager/flex would attend within this rank's tokens
only and are refused. Pass ``num_items_in_batch=global_target_count(batch,
cp_group)`` so each rank's loss is its target sum over the pack's target
count and the ranks' losses add up to the single-rank loss
(:mod:`cpdata.adapters.loss` states the gradient contract).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from cpdata.adapters._batch import batch_parts, info_int
from cpdata.adapters.masks import document_causal_mask, flex_block_mask
from cpdata.worker.keys import DOCUMENT_IDS, INPUT_IDS, LABELS, POSITION_IDS

__all__ = ["hf_model_kwargs"]

_MIN_TRANSFORMERS = (4, 50)  # ForCausalLMLoss(shift_labels=...) (huggingface/transformers#36607)
_MASKED = ("sdpa", "eager", "flex_attention")


def _check_transformers() -> None:
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if not version:
        return
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < _MIN_TRANSFORMERS:
        raise ValueError(
            f"transformers {version} ignores shift_labels and would shift cpdata's next-token labels again; "
            f"install transformers>={'.'.join(map(str, _MIN_TRANSFORMERS))} (pip install 'cpdata[hf]')"
        )


def hf_model_kwargs(
    batch: Any,
    attn_implementation: str = "flash_attention_2",
    *,
    tensors: Mapping[str, torch.Tensor] | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> dict[str, Any]:
    """``model(**kwargs)`` arguments for this rank's batch (see the module docstring).

    Args:
        batch: the :class:`~cpdata.worker.batch.ShardedBatch` (``.layout``, ``.info``).
        attn_implementation: the model's (``model.config._attn_implementation``):
            ``"flash_attention_2"``/``"flash_attention_3"`` (any name with
            ``flash``), ``"sdpa"``, ``"eager"`` or ``"flex_attention"``.
        tensors: the batch's tensors on the device (e.g. the dict
            ``ContextParallelSharder.shard`` returns); default: ``batch``.
        num_items_in_batch: target count the HF loss divides its sum by
            (``global_target_count(...)``); None: HF's mean over local targets.

    No device sync: lengths come from ``batch.info``, masks are built on the
    tensors' device.
    """
    _check_transformers()
    tensors, layout, info = batch_parts(batch, tensors)
    flash = "flash" in attn_implementation
    if not flash and attn_implementation not in _MASKED:
        raise ValueError(
            f"unknown attn_implementation {attn_implementation!r}; cpdata passes explicit document boundaries "
            f"for flash_attention_* (cu_seq_lens) and {list(_MASKED)} (attention_mask)"
        )
    input_ids = tensors[INPUT_IDS]
    if layout.cp_size > 1:
        if attn_implementation != "sdpa":
            raise ValueError(
                f"attn_implementation={attn_implementation!r} would attend within this rank's tokens only "
                f"(cp_size={layout.cp_size}); use attn_implementation='sdpa' inside the ctx "
                "ContextParallelSharder.shard returns (its SDPA gathers K/V), or Transformer Engine"
            )
        if input_ids.shape[:-1].numel() != 1:
            raise ValueError(
                f"at cp_size={layout.cp_size} a batch of {tuple(input_ids.shape)} holds one local slice per row; "
                "build the pipeline with qkv_format='thd' or batch_size=1 for a single stream"
            )
    kwargs: dict[str, Any] = {
        "input_ids": input_ids.reshape(1, -1),
        "position_ids": tensors[POSITION_IDS].reshape(1, -1),
        "labels": tensors[LABELS].reshape(1, -1),
        "use_cache": False,
    }
    kwargs["shift_labels"] = kwargs["labels"]
    if num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    if flash:
        cu = tensors["cu_seqlens_padded"]
        max_len = info_int(info, "max_seqlen_padded")
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        return kwargs
    # one row: at cp = 1 the whole stream (layout None: positions 0..T-1), at cp > 1 this rank's slice
    doc_ids = tensors[DOCUMENT_IDS].reshape(1, -1)
    mask_layout = layout if layout.cp_size > 1 else None
    if attn_implementation == "flex_attention":
        kwargs["attention_mask"] = flex_block_mask(mask_layout, doc_ids, tensors["cu_seqlens_padded"])
        return kwargs
    # global keys: the ctx's SDPA takes a mask over all S keys (and all-gathers K/V for it), plan or not
    mask = document_causal_mask(mask_layout, doc_ids, tensors["cu_seqlens_padded"], keys="global")
    if attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
            ~mask, torch.finfo(torch.float32).min
        )
    kwargs["attention_mask"] = mask
    return kwargs
