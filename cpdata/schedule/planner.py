"""``plan_schedule``: every document length in, one epoch of (step, DP rank, micro-batch) packs out.

A pure function of its arguments (``shuffle`` draws from ``default_rng((seed, epoch))``), so every rank and worker
computes the same schedule and reads only its own documents; guarantees and costs: docs/scheduling.md. With a cost
model, each step takes pieces (:func:`~cpdata.packing.pieces.cut_documents`) in stream order until its pool holds
``1 + POOL_MARGIN`` steps of tokens, places it (:func:`~cpdata.schedule.balance.place_step`) and carries the rest.
The delay bound holds because a step is committed only when the pieces due next step fit one empty step by
first-fit decreasing (the next step's rescue placement); otherwise the step is placed again with those pieces
first, then with fewer new pieces. Without one, the packs of :func:`~cpdata.packing.plan_lengths` in stream order,
pack ``k`` micro-batch ``k % micro_batches`` of rank ``(k // micro_batches) % dp_size``.
"""

from __future__ import annotations

import numpy as np

from cpdata.errors import check_bool, check_choice, check_int
from cpdata.packing import DEFAULT_ALGORITHM, PackingConfig, plan_lengths
from cpdata.packing.pieces import cut_documents, piece_continues
from cpdata.packing.planner import _integer_lengths
from cpdata.schedule.balance import place_step
from cpdata.schedule.cost import CostModel
from cpdata.schedule.fill import fits
from cpdata.schedule.records import COUNTS, TAIL_POLICIES, Schedule, assemble, schedule_pack
from cpdata.schedule.runs import choose_runs

__all__ = ["POOL_MARGIN", "padded_epoch_cost", "plan_schedule"]

POOL_MARGIN = 0.08
"""A step's pool holds this much more than a step of tokens, so short pieces are left to fill the last gaps."""
REFILLS = 3
"""Extra intake rounds of a step whose pool left outliers waiting (and so room)."""
REFILL_SHARE = 200
"""A refill round runs while more than ``1 / REFILL_SHARE`` of the step's tokens is free."""


def plan_schedule(
    lengths: np.ndarray,
    *,
    capacity: int,
    layout: str,
    cp_size: int,
    dp_size: int,
    micro_batches: int,
    cost: CostModel | None,
    max_delay: int = 0,
    algorithm: str = DEFAULT_ALGORITHM,
    overflow: str | None = None,
    seed: int = 0,
    shuffle: bool = False,
    tail: str = "pad",
    epoch: int = 0,
    fallback: bool = False,
) -> Schedule:
    """Plan one epoch over ``lengths`` (int ``[n_docs]``, source order); see the module docstring.

    The packs as for :func:`~cpdata.packing.plan_lengths` (``algorithm`` only with ``cost=None``). ``max_delay``:
    steps a long piece may wait for partners of its size (a piece is placed at most ``max(1, max_delay)`` steps
    after the step that took it, see docs/scheduling.md); ``shuffle``: documents in the ``default_rng((seed,
    epoch))`` order, as :class:`~cpdata.nodes.source.Documents` reads them; ``fallback``: return the token plan
    when its :func:`padded_epoch_cost` is lower (the delay bound then holds only for the balanced schedule).
    """
    lengths = _integer_lengths(lengths)
    R, M = check_int("dp_size", dp_size, min=1), check_int("micro_batches", micro_batches, min=1)
    max_delay, epoch = check_int("max_delay", max_delay, min=0), check_int("epoch", epoch, min=0)
    check_choice("tail policy", tail, TAIL_POLICIES)
    if cost is not None and not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a cpdata.schedule.CostModel or None, got {type(cost).__name__}")
    check_bool("shuffle", shuffle)
    check_bool("fallback", fallback)
    if cost is not None and algorithm == "concat":
        raise ValueError("algorithm='concat' cuts documents at pack boundaries and cannot be balanced; "
                         "use cost=None with concat, or another algorithm")  # fmt: skip
    config = PackingConfig.resolve(capacity=capacity, layout=layout, cp_size=cp_size, algorithm=algorithm,
                                   overflow=overflow, seed=seed)  # fmt: skip
    order = (np.random.default_rng((config.seed, epoch)).permutation(lengths.shape[0]) if shuffle
             else np.arange(lengths.shape[0], dtype=np.int64))  # fmt: skip
    plans = [] if cost is None else [_balanced(lengths[order], config, R, M, cost, max_delay)]
    if cost is None or fallback:
        plans.append(_in_order(lengths[order], config))
    schedules = [assemble(cells, order[doc], start, length, slot, cont, delay, counts, config, R, M, cost, tail)
                 for (cells, doc, start, length, slot, cont, delay), counts in plans]  # fmt: skip
    if cost is None or not fallback:  # one plan
        return schedules[0]
    return min(schedules, key=lambda sched: padded_epoch_cost(sched, cost))  # the balanced one on a tie


def padded_epoch_cost(schedule: Schedule, cost: CostModel) -> float:
    """The epoch's time under ``cost`` with pads computed (a pack's linear work runs over every slot): the sum
    over steps of the slowest rank's ``micro_batches * a * capacity + b * sum(L**2)``."""
    per_rank = schedule.pack_sums(cost.b * schedule.doc_len.astype(np.float64) ** 2).sum(axis=2)
    linear = schedule.num_steps * schedule.micro_batches * cost.a * schedule.capacity
    return float(linear + (per_rank.max(axis=1).sum() if per_rank.size else 0.0))


def _in_order(lengths: np.ndarray, config: PackingConfig) -> tuple[tuple[np.ndarray, ...], dict[str, int]]:
    """Packs of ``plan_lengths`` in order; pack ``k`` gets schedule pack id ``k`` (rank-major inside a step)."""
    res = plan_lengths(lengths, capacity=config.capacity, layout=config.layout, cp_size=config.cp_size,
                       algorithm=config.algorithm, overflow=config.overflow, window=config.window)  # fmt: skip
    sizes = np.diff(res.pack_offsets)
    cells = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), sizes)
    cont = piece_continues(res.doc_index, res.doc_start, res.doc_len)
    counts = {k: getattr(res.stats, k) for k in COUNTS}
    delay = np.zeros(cells.shape[0], dtype=np.int64)
    return (cells, res.doc_index, res.doc_start, res.doc_len, res.slot_len, cont, delay), counts


def _balanced(lengths: np.ndarray, config: PackingConfig, R: int, M: int, cost: CostModel, max_delay: int):
    """The step loop; returns per placed piece (global cell = step * K + m * R + r, ...) and counters."""
    pieces, counts = cut_documents(lengths, config, source_index=np.arange(lengths.shape[0]))
    C, K = config.capacity, R * M
    T = K * C
    slot, length = pieces.slot, pieces.length
    n = int(slot.shape[0])
    cum = np.concatenate([[0], np.cumsum(slot)])
    is_out = 2 * slot > C
    out_cum = np.concatenate([[0], np.cumsum(is_out)])
    q = cost.b * length.astype(np.float64) ** 2
    whole = cost(length)
    reach = np.where(is_out, max(1, max_delay), 1)  # only long pieces wait more than one step (set at intake)
    fifo = cum[:-1] // T  # each piece's FIFO step: where stream order at full steps would put it
    ahead = max_delay + 1 if max_delay >= 2 else 0  # reach of a long piece taken a step ahead of its FIFO step
    arrival = np.zeros(n, dtype=np.int64)
    placed_cell = np.full(n, -1, dtype=np.int64)
    target = int(T * (1 + POOL_MARGIN))
    kw = dict(capacity=C, dp_size=R, micro_batches=M, full_cost=cost.a * C + cost.b * C * C, quad=cost.b * C * C)

    def take(carry: np.ndarray, ptr: int, limit: int, step: int):
        """The carried pieces plus new ones from ``ptr`` (before ``limit``) until the pool holds ``target``
        tokens not counting outliers that will wait; at most ``K`` outliers share a deadline, none past the
        next FIFO step."""
        early = int(np.count_nonzero((reach[carry] == ahead) & (arrival[carry] == step - 1))) if ahead else 0
        out_cap = int(np.searchsorted(out_cum, out_cum[ptr] + K - early, side="right")) - 1
        cap = min(limit, out_cap, int(np.searchsorted(cum[:-1], (step + 2) * T, side="left")))
        want, pool, decided = target - int(slot[carry].sum()), carry, None
        for _ in range(REFILLS + 1):
            end = min(int(np.searchsorted(cum, cum[ptr] + want, side="left")), cap) if want > 0 else ptr
            arrival[ptr:end] = step
            if ahead:
                reach[ptr:end] = np.where(is_out[ptr:end], np.where(fifo[ptr:end] > step, ahead, max_delay), 1)
            pool = np.concatenate([pool, np.arange(ptr, end, dtype=np.int64)])
            ptr, decided = end, None
            age = step - arrival[pool]
            due = age >= reach[pool]
            keys = q if int(slot[pool].sum()) >= T else whole
            if ptr >= cap:
                break
            decided = choose_runs(slot[pool], keys[pool], due, age, np.ones(pool.shape[0], bool), capacity=C,
                                  dp_size=R, slots=M, hold=True, full_cost=kw["full_cost"], quad=kw["quad"])
            chosen = np.zeros(pool.shape[0], bool)
            chosen[np.concatenate([*decided[0], np.asarray(decided[1], dtype=np.int64)])] = True
            held = int(slot[pool[is_out[pool] & ~chosen]].sum())
            want = target - (int(slot[pool].sum()) - held)
            if want * REFILL_SHARE < T:
                break
        return pool, ptr, age, due, keys, decided

    carry = np.zeros(0, dtype=np.int64)
    ptr, step = 0, 0
    while ptr < n or carry.size:
        start, limit = ptr, n
        while True:
            pool, ptr, age, due, keys, decided = take(carry, start, limit, step)
            cells = place_step(slot[pool], keys[pool], due, age, hold=ptr < n, runs=decided, **kw)
            if (due & (cells < 0)).any():  # overdue pieces left out: place them first (rescue)
                cells = place_step(slot[pool], whole[pool], due, age, hold=False, first=(due,), **kw)
            if not (cells >= 0).any():  # everything held back: place them anyway (never an empty step)
                cells = place_step(slot[pool], whole[pool], np.ones(pool.shape[0], bool), age, hold=False, **kw)
            # Commit only if what is due next step fits one empty step (the next step's rescue places it
            # first-fit decreasing, as checked); else place those pieces first, then take less.
            next_due = age + 1 >= reach[pool]
            if fits(slot[pool[next_due & (cells < 0)]], K, C):
                break
            cells = place_step(slot[pool], whole[pool], due, age, hold=False, first=(due, next_due), **kw)
            if fits(slot[pool[next_due & (cells < 0)]], K, C):
                break
            if ptr == start:  # unreachable (module docstring); never commit a step that breaks the bound
                raise AssertionError("plan_schedule: the pieces due next step cannot fit one step")
            limit = start + (ptr - start) // 2
        ok = cells >= 0
        placed_cell[pool[ok]] = step * K + cells[ok]
        carry = pool[~ok]
        step += 1
    # Cell m * R + r of a step -> pack (rank r, micro-batch m).
    s, c = np.divmod(placed_cell, K)
    m, r = np.divmod(c, R)
    cells = schedule_pack(s * M + m, M, r, R)[2]
    delay = s - arrival
    return (cells, pieces.doc, pieces.start, length, slot, pieces.continues, delay), counts
