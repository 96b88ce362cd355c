"""The reference a CP run of a Hugging Face model is checked against: every document of the pack alone.

:func:`full_pack` rebuilds the pack in global order from every rank's batch; :func:`documents_alone` runs each
document as its own ``[1, n]`` row through a copy of the model with HF's own attention (``sdpa`` where the
class has it, else ``eager``), so no packing, layout or CP code is involved. Used by the tests (float64 on
CPU) and the GPU check.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from cpdata.worker.keys import IGNORE_INDEX, STANDARD_TOKEN_KEYS

__all__ = ["documents_alone", "full_pack", "model_grads"]


def full_pack(batches: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The whole pack in global order (flat ``[T]`` tensors of
    :data:`~cpdata.worker.keys.STANDARD_TOKEN_KEYS`) from every rank's batch and layout."""
    if len(batches) == 1:  # cp 1: the batch is the pack (bshd rows concatenated into one stream)
        return {key: batches[0][key].reshape(-1) for key in STANDARD_TOKEN_KEYS}
    full = {}
    for key in STANDARD_TOKEN_KEYS:
        parts = [b[key].reshape(-1) for b in batches]
        out = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype)
        for b, p in zip(batches, parts, strict=True):
            out[b.layout.local_token_global_indices.reshape(-1)] = p
        full[key] = out
    return full


def model_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where None), cloned; the model's gradients are then cleared."""
    out = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def documents_alone(
    model: torch.nn.Module, full: Mapping[str, torch.Tensor], *, autocast: torch.dtype | None = None
) -> tuple[float, dict[str, torch.Tensor], int]:
    """``(loss, grads, documents)``: each document of ``full`` (:func:`full_pack`'s) alone, its positions
    kept; the loss sums target cross-entropies over the pack's target count. One at a time: a padded batch
    NaNs in Gemma 2's eager softmax where a window holds only pads."""
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "sdpa" if getattr(type(model), "_supports_sdpa", False) else "eager"
    device = next(ref.parameters()).device
    ids, pos, labels, doc = (full[k].reshape(-1).to(device) for k in ("input_ids", "position_ids", "labels",
                                                                       "document_ids"))  # fmt: skip
    real = ~full["padding_mask"].reshape(-1).to(device).bool()
    n_targets = int(labels[real].ne(IGNORE_INDEX).sum())
    total, n_docs = 0.0, 0
    for d in doc.unique().tolist():
        sel = (doc == d) & real
        if not sel.any() or not labels[sel].ne(IGNORE_INDEX).any():
            continue
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = ref(input_ids=ids[sel][None], position_ids=pos[sel][None], use_cache=False).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(logits, labels[sel], ignore_index=IGNORE_INDEX, reduction="sum") / n_targets
        loss.backward()
        total, n_docs = total + loss.item(), n_docs + 1
    return total, model_grads(ref), n_docs
