"""Ranks agreeing without exchanging data: the same shard plan, and the same end of epoch.

CP ranks plan their batches independently; if they ever disagree (another seed, a ``dp_rank`` slip) the
gather would silently mix batches. :func:`verify_layout_consistency` all-reduces ``[d, -d]`` (int64, MAX) of
the layout's 63-bit digest: 16 bytes, every rank on the same collective path, so a mismatch raises on every
rank instead of hanging. Layouts without a digest (built by hand, the raw TE/THD path) are not checked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cpdata.errors import check_int, is_int
from cpdata.layout.shard_layout import ShardLayout

__all__ = [
    "DEFAULT_CHECK_EVERY", "LayoutCheck", "all_ranks_have_batch", "any_rank_flags", "verify_layout_consistency",
]  # fmt: skip

_MISSING = -1  # a rank without a valid digest; real digests are in [0, 2**63)


def _max_over(values: list[int], group: Any, device: Any) -> list[int]:
    """Each value's maximum over ``group`` (one int64 all-reduce; ``device`` None: CUDA for NCCL, else CPU)."""
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    seen = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    return seen.tolist()


def verify_layout_consistency(batch_or_layout: Any, cp_mesh_or_group: Any = None, *, device: Any = None) -> None:
    """Raise ``ValueError`` on every CP rank unless all ranks hold the same plan digest; ``batch_or_layout``: a
    :class:`ShardLayout` or a batch with one; ``cp_mesh_or_group``: the CP mesh (1-D, or with a ``"cp"`` dim) or
    a process group (None: the default group); ``device`` default: CUDA for an NCCL group, else the CPU."""
    given_layout = isinstance(batch_or_layout, ShardLayout)
    layout = batch_or_layout if given_layout else getattr(batch_or_layout, "layout", None)
    if not isinstance(layout, ShardLayout):
        raise TypeError(
            "verify_layout_consistency takes a ShardLayout or a batch with a .layout (ShardedBatch), "
            f"got {type(batch_or_layout).__name__}"
        )
    group = cp_mesh_or_group
    if hasattr(group, "get_group"):  # a DeviceMesh: its "cp" dim, or the 1-D mesh itself
        group = (group["cp"] if group.ndim > 1 else group).get_group()
    digest = layout.digest
    valid = is_int(digest) and 0 <= digest < 2**63
    value = digest if valid else _MISSING
    hi, neg_lo = _max_over([value, -value], group, device)
    lo = -neg_lo
    if not valid:
        raise ValueError(
            f"layout.digest is {digest!r} on cp_rank {layout.cp_rank}; the consistency check needs the plan's "
            "63-bit digest: build the ShardLayout with digest=plan_digest(plan, layout, cp_size) "
            "(cpdata.worker.plan), as the worker pipeline does"
        )
    if hi != lo:
        what = "some rank has no digest" if lo == _MISSING else "CP ranks received different shard plans"
        raise ValueError(
            f"{what}: this rank (cp_rank {layout.cp_rank}) has digest {digest}, the CP group saw min {lo} and "
            f"max {hi}. Every CP rank of a data-parallel group must run the same pipeline (same seed, dataset, "
            "dp rank, cp_size and resume state); a common slip is passing the global rank as dp_rank where the CP "
            "ranks of a group share one DP rank (pass the mesh's DP coordinate, e.g. mesh['dp'].get_local_rank())"
        )


DEFAULT_CHECK_EVERY = 100
"""Batches between two default layout checks (the first batch is always checked)."""


class LayoutCheck:
    """:func:`verify_layout_consistency` on the first checked batch and every ``every``-th after; 0 or None: never.
    Counts only checkable batches (cp > 1, a digest, a process group), the same on every rank of a CP group."""

    def __init__(self, every: int | None = DEFAULT_CHECK_EVERY) -> None:
        fix = " (batches between checks; 0 or None: off)"
        self.every = 0 if every is None else check_int("the layout check interval", every, min=0, fix=fix)
        self.calls = 0

    def __call__(self, layout: ShardLayout | None, group: Any = None) -> None:
        if not self.every or layout is None or layout.digest is None or (layout.cp_size or 1) <= 1:
            return
        if not (dist.is_available() and dist.is_initialized()):  # no process group: no peer to agree with
            return
        due = self.calls % self.every == 0
        self.calls += 1
        if due:
            verify_layout_consistency(layout, group)


def all_ranks_have_batch(has_batch: bool, group: Any = None, *, device: Any = None) -> bool:
    """Whether every rank of ``group`` still has a batch (one all-reduce; ``has_batch`` without a process group):
    ``while all_ranks_have_batch((batch := next(it, None)) is not None):`` stops DP ranks at one step."""
    return not any_rank_flags((not has_batch,), group, device=device)[0]


def any_rank_flags(flags: tuple[bool, ...], group: Any = None, *, device: Any = None) -> tuple[bool, ...]:
    """Each flag OR-ed over ``group`` (one all-reduce; ``flags`` as they are without a process group); every
    rank passes as many flags, so all take the same collective path and can raise together."""
    if not (dist.is_available() and dist.is_initialized()):
        return tuple(bool(f) for f in flags)
    return tuple(bool(v) for v in _max_over([int(bool(f)) for f in flags], group, device))
