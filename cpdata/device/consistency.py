"""Ranks agreeing without exchanging data: the same shard plan, and the same end of epoch.

``verify_layout_consistency`` proves that every CP rank of a group received the same shard plan.

CP ranks of one data-parallel group plan their batches independently (same
documents, same planner), so they agree without talking. If they ever do not
(different seeds, a resumed rank one step off, a loader built for another
cp_size), the gather would silently mix tokens of different batches. The check
all-reduces ``[d, -d]`` (int64, MAX) where ``d`` is the layout's 63-bit digest:
the group saw one plan iff ``max == -max(-d) == min``. Cost: one 16-byte
all-reduce per call; run it every step or every N steps.

Every rank takes the same collective path whatever its input, so a mismatch
(or a missing digest on one rank) raises on every rank instead of hanging.

On by default: :class:`LayoutCheck` runs it on the first batch and then every
:data:`DEFAULT_CHECK_EVERY` batches in ``ContextParallelSharder.shard()`` and
on entering a ``ContextParallelAttention`` built by hand, so CP ranks of one
DP group fed different packs (a ``dp_rank`` slip: the global rank passed on a
pure-CP mesh) fail on every rank at the first step. Cost per check: the 16-byte
all-reduce and one device-to-host read of it (a sync of the CP group), spread
over ``N`` steps (figures on gloo: docs/benchmarks.md; NCCL not measured).
``check_layout_every=0`` (sharder) / ``check_every=0`` (ctx) turns it off.
Worker batches and raw batches the sharder round-robins carry a digest;
layouts without one (built by hand, the raw TE/THD path) are not checked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cpdata.errors import check_int, is_int
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["DEFAULT_CHECK_EVERY", "LayoutCheck", "all_ranks_have_batch", "verify_layout_consistency"]

_INTERVAL = " (batches between checks; 0 or None: off)"
_MISSING = -1  # a rank without a valid digest; real digests are in [0, 2**63)


def _layout_of(batch_or_layout: Any) -> ShardLayout:
    layout = (
        batch_or_layout
        if isinstance(batch_or_layout, ShardLayout)
        else getattr(batch_or_layout, "layout", None)
    )
    if not isinstance(layout, ShardLayout):
        raise TypeError(
            "verify_layout_consistency takes a ShardLayout or a batch with a .layout (ShardedBatch), "
            f"got {type(batch_or_layout).__name__}"
        )
    return layout


def _group_and_device(cp_mesh_or_group: Any, device: Any) -> tuple[Any, torch.device]:
    if hasattr(cp_mesh_or_group, "get_group"):  # a DeviceMesh: its "cp" dim, or the 1-D mesh itself
        mesh = cp_mesh_or_group
        if mesh.ndim > 1:
            mesh = mesh["cp"]
        kind = mesh.device_type
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
            )
        return mesh.get_group(), torch.device(device)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return cp_mesh_or_group, torch.device(device)


def verify_layout_consistency(
    batch_or_layout: Any, cp_mesh_or_group: Any = None, *, device: Any = None
) -> None:
    """Raise ``ValueError`` on every CP rank unless all ranks hold the same plan digest.

    Args:
        batch_or_layout: a :class:`ShardLayout`, or a batch carrying one as
            ``.layout`` (:class:`~cpdata.worker.batch.ShardedBatch`).
        cp_mesh_or_group: the CP mesh (1-D, or a mesh with a ``"cp"`` dim) or
            a process group; None = the default group.
        device: where the 2-element tensor lives; default the mesh's device
            type, or CUDA when available for a bare group (gloo handles both).

    Raises:
        ValueError: this rank's ``layout.digest`` is None or out of range
            (after taking part in the collective), or the group saw different
            digests (naming this rank's digest and the min/max seen).
    """
    layout = _layout_of(batch_or_layout)
    group, device = _group_and_device(cp_mesh_or_group, device)
    digest = layout.digest
    valid = is_int(digest) and 0 <= digest < 2**63
    value = digest if valid else _MISSING
    seen = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    hi, lo = int(seen[0]), -int(seen[1])
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

    Counts only batches that can be checked (cp > 1, a digest, a process group), so every rank of a CP group, which sees the
    same batches, runs the collective at the same calls.
    """

    def __init__(self, every: int | None = DEFAULT_CHECK_EVERY) -> None:
        self.every = 0 if every is None else check_int("the layout check interval", every, min=0, fix=_INTERVAL)
        self.calls = 0

    def __call__(self, layout: ShardLayout | None, group: Any = None) -> None:
        if not self.every or layout is None or layout.digest is None or (layout.cp_size or 1) <= 1:
            return
        if not (dist.is_available() and dist.is_initialized()):  # no process group: no peer to agree with
            return
        due = self.calls % self.every == 0
        self.calls += 1
        if due:
            verify_layout_consistency(layout, group, device=_device_for(group))


def _device_for(group: Any) -> Any:
    """The check's tensor device: the mesh's own, CUDA for an NCCL group, else the CPU."""
    if group is None or hasattr(group, "get_group"):
        if group is None and dist.is_initialized() and dist.get_backend() != "nccl":
            return torch.device("cpu")
        return None  # the mesh's device type (verify_layout_consistency), or CUDA when available
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"


def all_ranks_have_batch(has_batch: bool, group: Any = None, *, device: Any = None) -> bool:
    """Whether every rank of ``group`` still has a batch: one 8-byte all-reduce (MIN).

    DP ranks pack different documents, so one rank's epoch can end a few
    batches before another's; a loop whose step runs collectives (gradient
    all-reduce, the CP gather) would then hang on the ranks that go on. Call
    this every step with ``batch is not None`` and stop when it is False: every
    rank stops at the same step (the shortest epoch; the others' remaining
    batches stay unconsumed, and their loader state still resumes exactly).

        it = iter(loader)
        while all_ranks_have_batch((batch := next(it, None)) is not None):
            ...

    Without an initialized process group it returns ``has_batch``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return bool(has_batch)
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([1 if has_batch else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
