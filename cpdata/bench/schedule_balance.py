"""Section ``schedule``: compute balance of (DP rank x micro-batch) packs, cpdata's schedule against
trainers'.

Distributions (:data:`DISTRIBUTIONS`, Megatron-LM's dynamic-CP example) at DP 8 (D2 also 32):
:func:`~cpdata.schedule.plan_schedule` plans one seeded stream, each full step a global batch; the
:mod:`~cpdata.bench.schedule_methods` get the same documents cut into equally full batches. Scored by the
FlexSP 7B cost model: ``imb_step`` / ``imb_mb`` (:func:`cpdata.schedule.imbalance`; mean and p95 over batches,
%), ``over_cap_pct``, ``extra_microbatch_pct`` (above ``ceil(tokens / (dp * capacity))``), ``padding_pct``,
``max_delay_steps`` / ``min_delay_steps`` (against a document's FIFO step), ``us_per_doc`` (process CPU time,
the fastest of :data:`PLAN_REPEATS`), ``bfd_padding_pct`` (``bfd`` alone on the same documents).
"""

from __future__ import annotations

import time

import numpy as np

from cpdata.bench.schedule_methods import BASELINES
from cpdata.schedule import CostModel, imbalance, plan_schedule

__all__ = ["COLUMNS", "DISTRIBUTIONS", "run", "sample_lengths"]

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


def _row(costs: list[np.ndarray], used: list[int], lower: list[int], packs_tokens: list[np.ndarray],
         capacity: int, dp_size: int) -> dict:  # fmt: skip
    imb_s, imb_m = zip(*(imbalance(c[None]) for c in costs), strict=True)
    s, m = 100 * np.concatenate(imb_s), 100 * np.concatenate(imb_m)
    tokens = np.concatenate(packs_tokens)
    total_mb = sum(used)
    return {
        "imb_step_mean": float(s.mean()), "imb_step_p95": float(np.percentile(s, 95)),
        "imb_mb_mean": float(m.mean()), "imb_mb_p95": float(np.percentile(m, 95)),
        "over_cap_pct": 100.0 * float((tokens > capacity).sum()) / tokens.shape[0],
        "extra_microbatch_pct": 100.0 * (total_mb - sum(lower)) / sum(lower),
        "padding_pct": 100.0 * (1 - float(tokens.sum()) / (dp_size * total_mb * capacity)),
        "batches": len(costs),
    }  # fmt: skip


def run(*, quick: bool) -> list[dict]:
    from cpdata.packing import plan_lengths

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
            lower = [max(1, -(-int(t.sum()) // (dp_size * capacity))) for t in real]
            row = _row(list(pc), [mb] * full, lower, list(real), capacity, dp_size)
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
        costs, used, lower, tokens = [], [], [], []
        t0 = time.process_time()
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            batch = lengths[lo:hi].tolist()
            placement = place(batch, capacity=capacity, dp_size=dp_size, first_index=lo)
            k = max(len(ranks) for ranks in placement)
            c = np.zeros((dp_size, k))
            for r, packs in enumerate(placement):
                for m, pack in enumerate(packs):
                    c[r, m] = float(cost(np.asarray(pack, dtype=np.int64)).sum()) if pack else 0.0
                    tokens.append(np.array([sum(pack)]))
            costs.append(c)
            used.append(k)
            lower.append(max(1, -(-sum(batch) // (dp_size * capacity))))
        us = 1e6 * (time.process_time() - t0) / int(ends[-1])
        row = _row(costs, used, lower, tokens, capacity, dp_size)
        row.update(base, method=method, max_delay_steps=0, us_per_doc=us)
        out.append(row)
    return out
