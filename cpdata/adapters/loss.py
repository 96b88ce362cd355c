"""Token-level loss of a CP shard whose ranks' losses add up to the single-rank loss (torch only).

Each rank holds ``L`` of a pack's ``S`` tokens. :func:`token_loss` sums the
cross-entropy over this rank's targets and divides by the target count of the
whole pack (one 8-byte all-reduce over the CP group, no host sync)::

    loss_r = sum_{t local, labels[t] != -100} CE(logits[t], labels[t]) / N_global
    sum_r loss_r = the mean loss of the whole pack on one rank

Gradient contract. ``loss_r.backward()`` reaches this rank's logits only;
inside the model, the K/V all-gather (:mod:`cpdata.gather`) backward is a
reduce-scatter (sum), so rank ``r'`` receives ``sum_r d loss_r / d KV_r'``:
the exact gradient of the summed loss with respect to its own K/V. Every
rank's parameter gradient is therefore the part of ``d(sum_r loss_r)/d theta``
that flows through its own tokens, and the SUM of parameter gradients over the
CP group is the single-rank gradient. Sum over CP (``all_reduce(SUM)``), do not
average: averaging gives ``1/cp`` of it. Data-parallel groups are then
averaged as usual. A loss replicated on every CP rank (e.g. one computed from
gathered logits) would instead give ``cp x`` the gradient.

With ``dp_group`` the count also spans the DP group, so all ranks' losses sum
to the token mean over the whole global batch (each token weighs the same
whatever its DP rank's pack held); then sum (not average) gradients over DP
too.

Targets are ``labels != -100``: the batch's ``labels`` are next-token targets
with -100 at document ends and on pads (:mod:`cpdata.worker.keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpdata.adapters._batch import check_cp_group
from cpdata.layout.shard_layout import ShardLayout
from cpdata.worker.keys import IGNORE_INDEX, LABELS

__all__ = ["global_target_count", "token_loss"]


def global_target_count(
    batch: Mapping[str, Any], group: Any = None, *, dp_group: Any = None, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 0-d tensor on the labels' device: targets of the whole pack (and of every DP rank with ``dp_group``).

    One all-reduce over ``group`` (the CP group; None = the default group) when
    the batch's layout has ``cp_size > 1``, one more over ``dp_group`` when
    given; asynchronous on the device, no ``.item()``. ``labels`` overrides
    ``batch["labels"]`` (e.g. the device copy).
    """
    labels = batch[LABELS] if labels is None else labels
    count = labels.ne(IGNORE_INDEX).sum()
    layout = getattr(batch, "layout", None)
    if isinstance(layout, ShardLayout) and layout.cp_size > 1:
        check_cp_group(group, layout)
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
    """Cross-entropy of this rank's targets over the pack's global target count (see the module docstring).

    Args:
        logits_local: ``[..., V]`` logits of this rank's tokens, in the batch's
            local order (``[B, L, V]``, ``[1, T, V]`` or ``[L, V]``); half
            precision is computed in float32.
        batch: the :class:`~cpdata.worker.batch.ShardedBatch` (or any mapping with
            ``labels`` shaped like the logits' leading dims).
        group: the CP process group; None = the default group. No collective
            at ``cp_size == 1``.
        dp_group: also normalise over this data-parallel group.
        num_targets: the global count, if already known (skips the all-reduce).
        labels: overrides ``batch["labels"]`` (e.g. the device copy).

    Returns:
        0-d tensor (float32, or float64 for float64 logits); the ranks' values sum to the single-rank mean. A
        pack without targets gives 0, not NaN.
    """
    labels = batch[LABELS] if labels is None else labels
    if logits_local.shape[:-1].numel() != labels.numel():
        raise ValueError(
            f"logits of shape {tuple(logits_local.shape)} hold {logits_local.shape[:-1].numel()} tokens but the "
            f"batch's labels {tuple(labels.shape)} hold {labels.numel()}; pass this rank's logits for this batch"
        )
    if num_targets is None:
        num_targets = global_target_count(batch, group, dp_group=dp_group, labels=labels)
    ce = F.cross_entropy(
        logits_local.reshape(-1, logits_local.shape[-1]).to(torch.promote_types(logits_local.dtype, torch.float32)),
        labels.reshape(-1).to(logits_local.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    if isinstance(num_targets, torch.Tensor):
        return ce / num_targets.to(ce.device).clamp_min(1)
    return ce / max(int(num_targets), 1)
