"""``python -m cpdata.packing``: padding vs the lower bound and planning speed.

Per case of :mod:`cpdata.packing.distributions`: packs above the bound, padding, excess (pp), CPU time
per document (best of ``--repeat``), and for windowed algorithms the largest carry (pieces) and the
longest wait of a piece (windows; pieces left at the end leave after the last window)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from cpdata.packing.distributions import BENCHMARK_CASES, HARD_CASES, sample_lengths
from cpdata.packing.offline import plan_lengths
from cpdata.packing.planner import StreamPlanner, window_ends
from cpdata.packing.records import ALGORITHMS, PackingConfig


def _carry_and_wait(lengths: np.ndarray, config: PackingConfig) -> tuple[int, int]:
    planner = StreamPlanner(config)
    arrival: list[np.ndarray] = []
    carry = wait = lo = w = 0
    for w, hi in enumerate(window_ends(lengths, config)):
        _, keys, packs = planner.add_window(lengths[lo:hi], np.arange(lo, hi))
        lo = hi
        arrival.append(np.full(keys.shape[0], w))
        born = np.concatenate(arrival)
        carry = max(carry, len(planner.state()["carry_keys"]))
        for p in packs:
            wait = max(wait, w - int(born[min(p)]))
    # Pieces still open at the end of the stream leave after the last window.
    for p in planner.finish():
        wait = max(wait, w - int(born[min(p)]))
    return carry, wait


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpdata.packing", description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="bfd", choices=ALGORITHMS)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the document counts")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"algorithm={args.algorithm} window={args.window or 'default'} (CPU time, best of {args.repeat})")
    print(f"{'case':>20} {'docs':>7} {'packs':>6} {'+LB':>4} {'padding%':>9} {'bound%':>7} {'excess pp':>9} "
          f"{'us/doc':>6} {'carry':>6} {'wait':>5}")
    worst_excess = worst_us = 0.0
    for name, capacity, overflow, n in BENCHMARK_CASES + HARD_CASES:
        if (name, capacity, overflow, n) == HARD_CASES[0]:
            print(f"worst excess {worst_excess:.3f} pp, worst {worst_us:.2f} us/doc; hard case (bound out of reach):")
        lengths = sample_lengths(name, int(n * args.scale), seed=args.seed)
        kwargs = dict(capacity=capacity, layout="identity", cp_size=1, algorithm=args.algorithm,
                      overflow=overflow, window=args.window)
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.process_time()
            result = plan_lengths(lengths, **kwargs)
            best = min(best, time.process_time() - t0)
        s = result.stats
        extra = s.packs - -(-s.slot_tokens // capacity)
        carry, wait = _carry_and_wait(lengths, result.config)
        us = best / len(lengths) * 1e6
        worst_excess, worst_us = max(worst_excess, s.excess_pct), max(worst_us, us)
        print(f"{name + '@' + str(capacity // 1024) + 'K':>20} {len(lengths):>7} {s.packs:>6} {extra:>4} "
              f"{s.padding_pct:>9.3f} {s.lower_bound_pct:>7.3f} {s.excess_pct:>9.3f} {us:>6.2f} {carry:>6} {wait:>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
