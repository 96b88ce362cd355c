"""Section ``gather``: the differentiable gather, forward + backward, on real gloo ranks.

Per CP size, ``cp_size`` forked gloo ranks each hold ``x [1, tokens/cp, hidden]`` (float32, ``round_robin``)
and run forward + backward: the anchor :func:`cpdata.bench.anchors.anchor_gather` against
:func:`cpdata.gather.gather_token_tensor` with the layout's precomputed inverse. Outputs and gradients are
checked equal first. ``collectives_*``: calls counted by :class:`CollectiveCounter` inside the ranks,
forward + backward (``_fwd`` / ``_bwd`` split it). Times: the slowest rank's median, a barrier before each
run; with more ranks than cores they measure oversubscription too.

Collectives are counted by instrumenting them, not by assumption: :class:`CollectiveCounter` wraps every
collective of ``torch.distributed`` (and of extra modules that bound them by name) and counts *outermost*
calls, so one built on another counts once; only calls between ``start()`` and ``stop()`` count.
"""

from __future__ import annotations

import collections
import functools
import os
import statistics
import time
import types
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from cpdata.bench.anchors import anchor_gather
from cpdata.bench.ranks import run_on_ranks
from cpdata.layout.maps import rank_indices
from cpdata.layout.shard_layout import ShardLayout

__all__ = ["COLLECTIVES", "COLUMNS", "CollectiveCounter", "run"]

COLLECTIVES: tuple[str, ...] = (
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier",
    "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "send_object_list",
)  # fmt: skip


class CollectiveCounter:
    """Context manager: ``with CollectiveCounter() as c: c.start(); ...; c.stop(); c.counts``."""

    def __init__(self, extra_modules: Iterable[types.ModuleType] = ()) -> None:
        self._modules = [dist, c10d, *extra_modules]
        self._saved: list[tuple[types.ModuleType, str, object]] = []
        self._depth = 0
        self._active = False
        self.counts: collections.Counter[str] = collections.Counter()

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._active and self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> CollectiveCounter:
        originals = {name: getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)}
        for module in self._modules:
            for name, fn in originals.items():
                if getattr(module, name, None) is fn:
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def start(self) -> None:
        """Zero the counts and start counting."""
        self.counts.clear()
        self._active = True

    def stop(self) -> dict[str, int]:
        """Stop counting; return the counts by collective name."""
        self._active = False
        return dict(self.counts)


COLUMNS: tuple[str, ...] = (
    "cp_size", "tokens", "hidden", "collectives_anchor", "collectives_cpdata", "anchor_ms", "cpdata_ms", "speedup",
)
TABLE: tuple[str, ...] = (*COLUMNS, "anchor_calls", "cpdata_calls")
TITLE = "differentiable gather fwd+bwd on gloo ranks: NeMo-style anchor vs gather_token_tensor"
LAYOUT = "round_robin"


def _step(fn, x, grad, counter: CollectiveCounter) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """One forward + backward; returns output, input gradient and the collectives of each direction."""
    counter.start()
    y = fn(x)
    fwd = counter.stop()
    counter.start()
    y.backward(grad)
    bwd = counter.stop()
    g = x.grad
    x.grad = None
    return y.detach(), g, fwd, bwd


def _collectives(side: str, fwd: dict, bwd: dict) -> dict:
    """``side``'s columns from its counts by collective: calls forward, backward, both, and by name."""
    f, b = sum(fwd.values()), sum(bwd.values())
    parts = (" + ".join(f"{n}x{name}" for name, n in sorted(counts.items())) or "none" for counts in (fwd, bwd))
    return {f"collectives_{side}": f + b, f"collectives_{side}_fwd": f, f"collectives_{side}_bwd": b,
            f"{side}_calls": "fwd {}; bwd {}".format(*parts)}


def _timed_ms(fn, x, grad, repeats: int) -> float:
    samples = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter_ns()
        fn(x).backward(grad)
        samples.append(time.perf_counter_ns() - t0)
        x.grad = None
    return statistics.median(samples[1:]) / 1e6


def _rank(rank: int, world: int, sizes: list[tuple[int, int]], repeats: int) -> list[dict]:
    import cpdata.gather as cp_gather

    warnings.simplefilter("ignore", FutureWarning)  # torch.distributed.nn.functional.all_gather is deprecated
    out = []
    with CollectiveCounter([cp_gather]) as counter:
        for tokens, hidden in sizes:
            layout = ShardLayout.of_rows(rank_indices(LAYOUT, world, [], tokens), rank)
            local = layout.local_token_global_indices
            gen = torch.Generator().manual_seed(1234)
            full, grad = (torch.randn(1, tokens, hidden, generator=gen) for _ in range(2))
            x = full[:, local].clone().requires_grad_(True)

            anchor = functools.partial(anchor_gather, local_indices=local)
            ours = functools.partial(cp_gather.gather_token_tensor, layout=layout)
            ya, ga, af, ab = _step(anchor, x, grad, counter)
            yc, gc, cf, cb = _step(ours, x, grad, counter)
            assert torch.equal(ya, full) and torch.equal(yc, full), "gather did not restore global order"
            assert torch.allclose(ga, gc), "anchor and cpdata gradients differ"
            out.append({
                "cp_size": world, "tokens": tokens, "hidden": hidden,
                **_collectives("anchor", af, ab), **_collectives("cpdata", cf, cb),
                "anchor_ms": _timed_ms(anchor, x, grad, repeats), "cpdata_ms": _timed_ms(ours, x, grad, repeats),
            })
    return out


def run(*, quick: bool) -> list[dict]:
    plan = {2: [(8192, 256)]} if quick else {2: [(8192, 256), (32768, 256)], 4: [(8192, 256), (32768, 256)]}
    repeats = 3 if quick else 10
    rows = []
    for cp_size, sizes in plan.items():
        per_rank = run_on_ranks(_rank, cp_size, sizes, repeats)
        for i, row in enumerate(per_rank[0]):
            merged = {**row, **{key: max(r[i][key] for r in per_rank) for key in ("anchor_ms", "cpdata_ms")}}
            for key in ("collectives_anchor", "collectives_cpdata"):
                counts = {r[i][key] for r in per_rank}
                assert len(counts) == 1, f"ranks counted different {key}: {sorted(counts)}"
            merged["speedup"] = merged["anchor_ms"] / merged["cpdata_ms"]
            merged["ranks_per_core"] = round(cp_size / (os.cpu_count() or 1), 2)
            rows.append(merged)
    return rows
