"""Section ``schedule``: compute balance of (DP rank x micro-batch) packs, cpdata's schedule against
trainers'.

Distributions (:data:`DISTRIBUTIONS`, Megatron-LM's dynamic-CP example) at DP 8 (D2 also 32):
:func:`~cpdata.schedule.plan_schedule` plans one seeded stream, each full step a global batch; the trainers'
methods (:data:`BASELINES`) get the same documents cut into equally full batches. Scored by the
FlexSP 7B cost model: ``imb_step`` / ``imb_mb`` (:func:`cpdata.schedule.imbalance`; mean and p95 over batches,
%), ``over_cap_pct``, ``extra_microbatch_pct`` (above ``ceil(tokens / (dp * capacity))``), ``padding_pct``,
``max_delay_steps`` / ``min_delay_steps`` (against a document's FIFO step), ``us_per_doc`` (process CPU time,
the fastest of :data:`PLAN_REPEATS`), ``bfd_padding_pct`` (``bfd`` alone on the same documents).

The trainers' methods place one global batch on DP ranks and micro-batches as published: each takes the
batch's lengths (stream order) and returns, per DP rank, its micro-batches as lists of lengths:
``nemo_rl_ffd`` (first-fit-decreasing packs dealt round-robin, NeMo-RL), ``verl_kk`` / ``verl_kk_cap``
(Karmarkar-Karp into equal-count rank groups on ``24576 * L + L**2``, then per rank into the largest
``ceil(tokens / capacity)`` over ranks, verl ``balance_batch``; ``_cap`` grows that count until no
micro-batch exceeds the capacity), ``megatron_dp_balanced`` (packs filled in stream order, cpdata's
``next_fit``, dealt round-robin) and ``cpdata_0.1`` (document ``i`` to rank ``i % dp_size``, each rank packs
its own with ``bfd``).
"""

from __future__ import annotations

import functools
import heapq
import time
from collections.abc import Callable

import numpy as np

from cpdata.packing import plan_lengths
from cpdata.schedule import CostModel, imbalance, plan_schedule

__all__ = ["BASELINES", "COLUMNS", "DISTRIBUTIONS", "karmarkar_karp", "run", "sample_lengths"]

COLUMNS: tuple[str, ...] = (
    "distribution", "dp_size", "micro_batches", "method", "imb_step_mean", "imb_step_p95", "imb_mb_mean",
    "imb_mb_p95", "over_cap_pct", "extra_microbatch_pct", "padding_pct", "max_delay_steps",
)  # fmt: skip
TABLE: tuple[str, ...] = (*COLUMNS, "batches", "us_per_doc")
TITLE = "imbalance of (DP rank x micro-batch) packs under the FlexSP 7B cost model, % (mean and p95 over batches)"

DISTRIBUTIONS: dict[str, dict[str, float]] = {
    "D1": {"mean": 1024, "sigma": 1.5, "low": 128, "high": 8192, "capacity": 8192, "micro_batches": 8},
    "D2": {"mean": 4096, "sigma": 2.0, "low": 64, "high": 131072, "capacity": 131072, "micro_batches": 4},
}
PLAN_REPEATS = 3
"""Planning is timed this many times (the same schedule each time); ``us_per_doc`` is the fastest."""
ROWS: tuple[tuple[str, int, tuple[int, ...]], ...] = (("D1", 8, (0,)), ("D2", 8, (0, 4)), ("D2", 32, (4,)))
"""(distribution, dp_size, max_delay values of cpdata's schedule)."""


def sample_lengths(name: str, n: int, seed: int) -> np.ndarray:
    """int64 ``[n]`` lengths of distribution ``name`` (lognormal with the given mean, clipped)."""
    d = DISTRIBUTIONS[name]
    mu = np.log(d["mean"]) - d["sigma"] ** 2 / 2
    raw = np.random.default_rng(seed).lognormal(mu, d["sigma"], n)
    return np.clip(np.round(raw), d["low"], d["high"]).astype(np.int64)


def _row(costs: list[np.ndarray], packs_tokens: list[np.ndarray], capacity: int, dp_size: int) -> dict:
    """One method's scores from each global batch's pack costs ``[dp_size, mb]`` and its packs' tokens."""
    imb_s, imb_m = zip(*(imbalance(c[None]) for c in costs), strict=True)
    s, m = 100 * np.concatenate(imb_s), 100 * np.concatenate(imb_m)
    tokens = np.concatenate(packs_tokens)
    total_mb = sum(c.shape[1] for c in costs)
    lower = [max(1, -(-int(t.sum()) // (dp_size * capacity))) for t in packs_tokens]  # the fewest that fit
    return {
        "imb_step_mean": float(s.mean()), "imb_step_p95": float(np.percentile(s, 95)),
        "imb_mb_mean": float(m.mean()), "imb_mb_p95": float(np.percentile(m, 95)),
        "over_cap_pct": 100.0 * float((tokens > capacity).sum()) / tokens.shape[0],
        "extra_microbatch_pct": 100.0 * (total_mb - sum(lower)) / sum(lower),
        "padding_pct": 100.0 * (1 - float(tokens.sum()) / (dp_size * total_mb * capacity)),
        "batches": len(costs),
    }  # fmt: skip


def run(*, quick: bool) -> list[dict]:
    cost = CostModel()
    steps = 8 if quick else 32
    rows = []
    for name, dp_size, delays in ROWS:
        d = DISTRIBUTIONS[name]
        capacity, mb = int(d["capacity"]), int(d["micro_batches"])
        step_tokens = dp_size * mb * capacity
        probe = sample_lengths(name, 100_000, 0)
        lengths = sample_lengths(name, int((steps + 1.5) * step_tokens / probe.mean()), 1 + dp_size)
        base = {"distribution": name, "dp_size": dp_size, "micro_batches": mb}
        fill = None
        for max_delay in delays:
            times = []
            for _ in range(1 if quick else PLAN_REPEATS):
                t0 = time.process_time()
                sched = plan_schedule(lengths, capacity=capacity, layout="balanced", cp_size=1, dp_size=dp_size,
                                      micro_batches=mb, cost=cost, max_delay=max_delay)  # fmt: skip
                times.append(time.process_time() - t0)
            us = 1e6 * min(times) / lengths.shape[0]
            full = sched.num_steps - 1
            pc = sched.pack_costs(cost)[:full]
            # tokens per pack (balanced at cp 1 pads no document: slots = tokens)
            real = sched.pack_costs(lambda lens: lens)[:full].reshape(full, -1)
            row = _row(list(pc), list(real), capacity, dp_size)
            last = int(sched.pack_offsets[full * dp_size * mb])
            in_stream = np.lexsort((sched.doc_start[:last], sched.doc_index[:last]))  # the same pieces, stream order
            bfd = plan_lengths(sched.doc_len[:last][in_stream], capacity=capacity, layout="balanced", cp_size=1)
            fifo_delay = sched.fifo_delay()[:last]
            row.update(base, method="cpdata_schedule" if max_delay == 0 else f"cpdata_schedule_delay{max_delay}",
                       max_delay_steps=int(fifo_delay.max()), min_delay_steps=int(fifo_delay.min()), us_per_doc=us,
                       bfd_padding_pct=float(bfd.stats.padding_pct), max_delay=max_delay)  # fmt: skip
            rows.append(row)
            fill = fill or int(real.sum()) / full
        rows.extend(_baselines(lengths, fill, base, capacity, dp_size, steps, cost))
    return rows


def _baselines(lengths, fill, base, capacity, dp_size, steps, cost) -> list[dict]:
    cum = np.cumsum(lengths)
    ends = np.searchsorted(cum, fill * np.arange(1, steps + 1), side="right")
    starts = np.concatenate([[0], ends[:-1]])
    out = []
    for method, place in BASELINES.items():
        costs, tokens = [], []
        t0 = time.process_time()
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            batch = lengths[lo:hi].tolist()
            placement = place(batch, capacity=capacity, dp_size=dp_size, first_index=lo)
            k = max(len(ranks) for ranks in placement)
            c = np.zeros((dp_size, k))
            for r, packs in enumerate(placement):
                for m, pack in enumerate(packs):
                    c[r, m] = float(cost(np.asarray(pack, dtype=np.int64)).sum()) if pack else 0.0
            costs.append(c)
            tokens.append(np.array([sum(pack) for packs in placement for pack in packs]))
        us = 1e6 * (time.process_time() - t0) / int(ends[-1])
        row = _row(costs, tokens, capacity, dp_size)
        row.update(base, method=method, max_delay_steps=0, us_per_doc=us)
        out.append(row)
    return out


Placement = list[list[list[int]]]
"""``placement[rank][micro_batch]`` = lengths of the documents in that pack."""


def karmarkar_karp(weights: list[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing into ``k`` groups of item indices (``equal_size``: counts within one, as verl)."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    chunks = [order[i : i + k] for i in range(0, len(order), k)] if equal_size else [[i] for i in order]
    for n, chunk in enumerate(chunks):
        parts = [(weights[i], [i]) for i in chunk] + [(0.0, [])] * (k - len(chunk))
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), n, parts))
    counter = len(chunks)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [p[1] for p in heap[0][2]] if heap else [[] for _ in range(k)]


def _ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        for j, r in enumerate(room):
            if r >= n:
                bins[j].append(n)
                room[j] -= n
                break
        else:
            bins.append([n])
            room.append(capacity - n)
    return bins


def _deal(packs: list[list[int]], dp_size: int) -> Placement:
    return [packs[r::dp_size] for r in range(dp_size)]


def _verl(lengths: list[int], *, capacity: int, dp_size: int, cap: bool, **_: object) -> Placement:
    work = [24576.0 * n + float(n) * n for n in lengths]
    groups = karmarkar_karp(work, dp_size, equal_size=True)

    def split(items: list[int], k: int) -> list[list[int]]:
        return [[items[j] for j in part] for part in karmarkar_karp([work[i] for i in items], k)]

    k = max(max(1, -(-sum(lengths[i] for i in g) // capacity)) for g in groups)
    while True:
        parts = [split(g, k) for g in groups]
        if not cap or all(sum(lengths[i] for i in p) <= capacity for ps in parts for p in ps):
            break
        k += 1
    out = []
    for ps in parts:
        ps = sorted(ps, key=lambda p: -sum(work[i] for i in p))
        out.append([[lengths[i] for i in p] for p in ps if p] or [[]])
    return out


def _packs(lengths, capacity: int, algorithm: str) -> list[list[int]]:
    """The packs cpdata's ``algorithm`` makes of ``lengths`` (``balanced`` at cp 1: no document padding)."""
    res = plan_lengths(np.asarray(lengths, dtype=np.int64), capacity=capacity, layout="balanced", cp_size=1,
                       algorithm=algorithm)  # fmt: skip
    return [res.pack(p)[2].tolist() for p in range(res.n_packs)]


def cpdata_01(lengths: list[int], *, capacity: int, dp_size: int, first_index: int = 0, **_: object) -> Placement:
    arr = np.asarray(lengths, dtype=np.int64)
    mine = (np.arange(arr.shape[0]) + first_index) % dp_size
    return [_packs(arr[mine == r], capacity, "bfd") or [[]] for r in range(dp_size)]


BASELINES: dict[str, Callable[..., Placement]] = {
    "nemo_rl_ffd": lambda lengths, *, capacity, dp_size, **_: _deal(_ffd(lengths, capacity), dp_size),
    "verl_kk": functools.partial(_verl, cap=False),
    "verl_kk_cap": functools.partial(_verl, cap=True),
    "megatron_dp_balanced": lambda lengths, *, capacity, dp_size, **_: _deal(
        _packs(lengths, capacity, "next_fit"), dp_size),
    "cpdata_0.1": cpdata_01,
}
"""Method name -> ``f(lengths, *, capacity, dp_size, first_index) -> placement``."""
