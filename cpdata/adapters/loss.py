"""Token-level loss of a CP shard whose ranks' losses add up to the single-rank loss (torch only).

:func:`token_loss` sums this rank's cross-entropy over targets (``labels != -100``) and divides by the whole
pack's target count (one 8-byte all-reduce over the CP group, no host sync)::

    loss_r = sum_{t local, labels[t] != -100} CE(logits[t], labels[t]) / N_global
    sum_r loss_r = the mean loss of the whole pack on one rank

SUM parameter gradients over the CP group (and over DP with ``dp_group``, whose count spans it too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpdata.gather import check_cp_group
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.keys import IGNORE_INDEX, LABELS

__all__ = ["global_target_count", "token_loss"]


def global_target_count(
    batch: Mapping[str, Any], group: Any = None, *, dp_group: Any = None, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 0-d tensor: targets of the whole pack (and of every DP rank with ``dp_group``), one all-reduce over
    each group, no ``.item()``; ``labels`` overrides ``batch["labels"]`` (e.g. the device copy)."""
    labels = batch[LABELS] if labels is None else labels
    count = labels.ne(IGNORE_INDEX).sum()
    layout = getattr(batch, "layout", None)
    if isinstance(layout, ShardLayout) and layout.cp_size > 1:
        check_cp_group(layout, group)
        dist.all_reduce(count, group=group)
    if dp_group is not None:
        dist.all_reduce(count, group=dp_group)
    return count


def token_loss(
    logits_local: torch.Tensor,
    batch: Mapping[str, Any],
    group: Any = None,
    *,
    dp_group: Any = None,
    num_targets: int | torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """0-d float32 (float64 for float64 logits): cross-entropy of ``logits_local`` (``[..., V]``, local order)
    over the pack's target count (``num_targets`` if known; no targets: 0), as :func:`global_target_count`."""
    labels = batch[LABELS] if labels is None else labels
    if logits_local.shape[:-1].numel() != labels.numel():
        raise ValueError(
            f"logits of shape {tuple(logits_local.shape)} hold {logits_local.shape[:-1].numel()} tokens but the "
            f"batch's labels {tuple(labels.shape)} hold {labels.numel()}; pass this rank's logits for this batch"
        )
    if num_targets is None:
        num_targets = global_target_count(batch, group, dp_group=dp_group, labels=labels)
    logits = logits_local.reshape(-1, logits_local.shape[-1])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32; float64 kept
    ce = F.cross_entropy(logits, labels.reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX,
                         reduction="sum")  # fmt: skip
    if isinstance(num_targets, torch.Tensor):
        return ce / num_targets.to(ce.device).clamp_min(1)
    return ce / max(int(num_targets), 1)
