"""Section ``world``: the whole world as one CP group, cpdata's ``world`` deals beside Megatron-core's
``BalancedCPScheduler`` (hybrid / dynamic CP), on the same documents.

Three cpdata systems at ``16 x 8K`` and ``32 x 4K``, 8 ranks per node:

- ``cpdata world``: the first ``PACKS`` packs the world packer makes of each distribution, each dealt by itself
  from its slot lengths (``layout_spec("world", node_size=8)``), solve timed in the shard stage's deal;
- ``cpdata world step``: the first step of ``PACKS`` packs the world step packer makes
  (``StreamPlan(world_step=PACKS)``, :mod:`cpdata.packing.world_steps`), laid out from their owners, solve timed
  in the packer (its CPU time until the step closed, per micro-batch);
- ``cpdata world stream``: the first ``STEPS`` steps of one stream (:func:`stream_packs`): a step may take dearer
  waiting documents in place of cheaper ones (:mod:`cpdata.packing.world_densify`), leaving the next less work,
  which one step alone does not show.

Megatron's scheduler (``max_seq_len_per_rank = L``, a stand-in group whose ``size()`` is ``W``, the one call its
constructor makes; :mod:`cpdata.bench.world_megatron`) schedules each system's documents at once, each group one
micro-batch, a sub-sample on ``c`` ranks laid out as TE THD's ``2c`` chunks. One tile counter, each system's kernel
(``tile = 128``): a Megatron sub-sample is its own kernel call (:func:`cpdata.layout.tiles.live_tiles`); a cpdata
rank runs varlen, each document piece a segment over its document's keys held or exchanged, the pad that ends its
row not run, other pad one diagonal tile per 128 tokens (:func:`cpdata.layout.tiles.varlen_live_tiles` with
``pad_free``). Two readings of "the busiest rank over a step": ``tiles``, ``recv_keys``, ``inter_keys`` sum each
micro-batch's busiest rank (every micro-batch ends with its slowest rank: a world all-to-all per layer, or
parameters gathered per layer); the ``step_`` columns take the rank whose sum over the micro-batches is largest
(ranks wait only for the peers they exchange with, and all meet once a step), summed over the stream's steps,
Megatron's scheduler fed each step's documents. docs/benchmarks.md defines each column. Where megatron-core cannot
be imported, the section says why and gives cpdata's rows alone. ``cpdata bench --lengths PATH`` measures a user's
corpus (:mod:`cpdata.bench.corpus`) instead of the six distributions.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Sequence

import numpy as np

from cpdata.bench.corpus import Corpus
from cpdata.bench.distributions import first_packs, sample
from cpdata.bench.world_megatron import TILE, first_step, megatron_steps
from cpdata.layout.exchange import node_recv, world_exchange
from cpdata.layout.maps import layout_runs, layout_spec
from cpdata.layout.spans import SpanTable
from cpdata.layout.tiles import varlen_live_tiles
from cpdata.layout.world_cost import H100_DEFAULTS, WorldCost
from cpdata.layout.world_deal import world_block
from cpdata.packing.planner import StreamPlanner, window_ends
from cpdata.packing.records import PackingConfig

__all__ = ["COLUMNS", "MEGATRON", "OPTIONS", "PER_PACK", "RATIOS", "STEP", "STEPS", "STREAM", "TABLE", "run",
           "step_packs", "stream_packs"]  # fmt: skip

COLUMNS: tuple[str, ...] = ("distribution", "world", "system", "micro_batches", "tiles", "over_mean", "recv_keys",
                            "inter_keys", "step_tiles", "step_over_mean", "step_recv_keys", "step_inter_keys",
                            "fill", "predicted_ms", "step_predicted_ms", "step_calls", "solve_ms")  # fmt: skip
RATIOS: tuple[str, ...] = ("tiles", "recv_keys", "inter_keys", "step_tiles", "step_recv_keys", "step_inter_keys",
                          "predicted_ms", "step_predicted_ms")
"""The columns each cpdata row also gives over Megatron's (``<column>_vs_megatron``)."""
TABLE: tuple[str, ...] = (*COLUMNS, *(f"{c}_vs_megatron" for c in RATIOS))
TITLE = "the world as one CP group: cpdata's world deal beside Megatron-core's BalancedCPScheduler"
NAMES: tuple[str, ...] = ("alpaca", "sft", "ultrachat", "web", "long_context", "stdlib")
WORLDS: tuple[tuple[int, int], ...] = ((16, 8192), (32, 4096))
NODE_SIZE = 8
PER_PACK, STEP, STREAM = "cpdata world", "cpdata world step", "cpdata world stream"
MEGATRON = "megatron BalancedCPScheduler"
"""System names: each pack dealt by itself; ``PACKS`` packs dealt as one step (``StreamPlan(world_step=PACKS)``);
the first ``STEPS`` such steps of one stream; Megatron's scheduler on each one's documents (on each step's, for the
stream)."""
PACKS, QUICK_PACKS = 8, 2
STEPS, QUICK_STEPS = 4, 2
OPTIONS: tuple[str, ...] = ("cost", "seed", "corpus")
"""``cpdata bench --calibration PATH`` passes ``cost`` (:meth:`WorldCost.from_json`) to :func:`run`, ``--seed N``
the seed the documents' lengths are drawn with, ``--lengths PATH`` the corpus measured instead of the
distributions (:func:`~cpdata.bench.corpus.read_corpus`)."""


def _cpdata(packs: list[np.ndarray], world: int, per_rank: int, cost: WorldCost
            ) -> tuple[list[tuple[np.ndarray, ...]], float]:  # fmt: skip
    """Each pack dealt by itself from its slot lengths (the shard stage's deal, timed)."""
    spec = layout_spec("world", node_size=NODE_SIZE, cost=cost)
    capacity = world * per_rank
    tables, seconds = [], 0.0
    gc.collect()  # a full collection owed to earlier allocations (packing, imports) is not the deal's
    for lens in packs:
        t0 = time.thread_time()
        tables.append(layout_runs(spec, world, lens, capacity, checked=True))
        seconds += time.thread_time() - t0
    return [_costs(table, lens) for table, lens in zip(tables, packs, strict=True)], seconds


def step_packs(name: str | Corpus, world: int, per_rank: int, n: int, seed: int = 1
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], float]:  # fmt: skip
    """The first world step of ``n`` packs the world step packer (``StreamPlan(world_step=n)``) makes of ``name``
    (a distribution, or a user's corpus):
    per pack its slot lengths and owners (int64 ``[D]``, ``[D, 2]``), and the packer's CPU seconds for ``n``
    packs (a window that closes more packs than that counted in proportion)."""
    steps, seconds = stream_packs(name, world, per_rank, n, 1, seed)
    return steps[0], seconds[0]


def stream_packs(name: str | Corpus, world: int, per_rank: int, n: int, steps: int, seed: int = 1
                 ) -> tuple[list[list[tuple[np.ndarray, np.ndarray]]], list[float]]:  # fmt: skip
    """The first ``steps`` world steps of ``n`` packs each that the world step packer makes of one stream of
    ``name``'s documents: per step, per pack its slot lengths and owners (as :func:`step_packs`), and per step the
    packer's CPU seconds (a window that closes packs shares its time among them, the windows before it that closed
    none go to its first). The documents a step leaves waiting open the next. The stream is blocks of about three
    steps' worth of tokens, each cut in windows alone: the first drawn at ``seed``, the ``j``-th at
    ``seed + j * 2**20`` (so the first step, and its seconds, are the same whatever ``steps``)."""
    config = PackingConfig.resolve(capacity=world * per_rank, layout=layout_spec("world", node_size=NODE_SIZE),
                                   cp_size=world, overflow="split", world_step=n)  # fmt: skip
    want, probe = n * steps, sample(name, 1000, 0)
    count = int(3 * n * world * per_rank / max(probe.mean(), 1)) + 16
    planner, slot, packs, lo, since, cost = StreamPlanner(config), {}, [], 0, 0.0, []  # cost: CPU seconds a pack
    gc.collect()
    for block in range(steps + 2):
        lengths = sample(name, count, seed + block * 2**20)
        for a, b in itertools.pairwise([0, *window_ends(lengths, config)]):
            t0 = time.thread_time()
            pieces, keys, done = planner.add_window(lengths[a:b], np.arange(lo + a, lo + b))
            dt = time.thread_time() - t0
            if len(done):
                share = dt / len(done)
                cost += [since + share] + [share] * (len(done) - 1)
                since = 0.0
            else:
                since += dt
            slot.update(zip(keys.tolist(), pieces.slot.tolist(), strict=True))
            bounds = np.concatenate([[0], np.cumsum(done.sizes)]).tolist()
            for i, j in itertools.pairwise(bounds):
                packs.append((np.array([slot[k] for k in done.keys[i:j].tolist()], dtype=np.int64), done.owners[i:j]))
            if len(packs) >= want:
                return [packs[i * n:(i + 1) * n] for i in range(steps)], [sum(cost[i * n:(i + 1) * n])
                                                                           for i in range(steps)]  # fmt: skip
        lo += lengths.shape[0]
    raise AssertionError(f"{_label(name)}: fewer than {want} packs from {steps + 2} blocks of {count} documents")


def _label(name: str | Corpus) -> str:
    """A row's ``distribution``: the distribution's name, or the corpus's (its file's stem)."""
    return name if isinstance(name, str) else name.name


def _step(packs: list[tuple[np.ndarray, np.ndarray]], world: int, per_rank: int, node_size: int = NODE_SIZE
          ) -> list[tuple[np.ndarray, ...]]:  # fmt: skip
    """The packs of a world step (dealt with ``node_size`` ranks a node) laid out from their owners."""
    capacity = world * per_rank
    blocks = [world_block(lens, None, capacity, world, node_size, owners=[owners]) for lens, owners in packs]
    return [_costs(block.tables()[0], lens, node_size) for block, (lens, _) in zip(blocks, packs, strict=True)]


def _costs(table: SpanTable, lens: np.ndarray, node_size: int = NODE_SIZE) -> tuple[np.ndarray, ...]:
    """Per rank: varlen tiles (pad as the varlen kernel runs it: the tail of the row not at all, other pad one
    diagonal tile per 128 tokens), keys received, and of those from other nodes of ``node_size`` ranks."""
    plan = world_exchange(table)
    intra, inter = node_recv(plan, node_size)
    return varlen_live_tiles(table.rows(), lens, table.pack_len, TILE, pad_free=True), intra + inter, inter


def _row(name: str, world: int, per_rank: int, system: str, cost: WorldCost, mbs: list[tuple[np.ndarray, ...]],
         seconds: float, steps: Sequence[int] | None = None) -> dict:  # fmt: skip
    """One system's row from its micro-batches' per-rank costs (``mbs``: tiles, received keys, inter-node keys,
    and where given the positions each rank computes and its forward calls, int64 ``[world]`` each; without them
    every rank computes its ``per_rank`` positions in one call, as a cpdata rank its local row), ``steps``
    micro-batches a step in order (None: one step of them all). The ``step_`` columns sum, over the steps, the
    rank whose sum over that step's micro-batches is largest; ``predicted_ms`` sums each micro-batch's slowest
    rank, ``step_predicted_ms`` each step's (:meth:`WorldCost.seconds`); ``step_calls`` the most forward and
    backward calls a rank makes a step, summed over the steps."""
    columns = [np.stack(column) for column in zip(*mbs, strict=True)]  # int64 [micro-batches, world] each
    tiles, recv, inter = columns[:3]
    positions = columns[3] if len(columns) > 3 else np.full_like(tiles, per_rank)
    calls = columns[4] if len(columns) > 4 else np.ones_like(tiles)
    bounds = list(itertools.pairwise(np.cumsum([0, *(steps or [len(mbs)])]).tolist()))
    if bounds[-1][1] != len(mbs):
        raise ValueError(f"steps of {list(steps or [])} micro-batches do not cover the {len(mbs)} given")
    mean = float(tiles.sum()) / world
    busiest = tiles.max(axis=1).sum()
    step, step_recv, step_inter = (sum(int(a[lo:hi].sum(axis=0).max()) for lo, hi in bounds)
                                   for a in (tiles, recv, inter))  # fmt: skip
    seconds_per_rank = cost.seconds(tiles, recv - inter, inter, positions)  # [micro-batches, world]
    predicted = float(seconds_per_rank.max(axis=1).sum())
    step_predicted = sum(float(seconds_per_rank[lo:hi].sum(axis=0).max()) for lo, hi in bounds)
    step_calls = sum(int(calls[lo:hi].sum(axis=0).max()) for lo, hi in bounds)
    return {
        "distribution": name, "world": f"{world}x{per_rank // 1024}K", "system": system,
        "micro_batches": len(mbs), "tiles": int(busiest), "over_mean": busiest / mean if mean else 1.0,
        "recv_keys": int(recv.max(axis=1).sum()), "inter_keys": int(inter.max(axis=1).sum()),
        "step_tiles": step, "step_over_mean": step / mean if mean else 1.0,
        "step_recv_keys": step_recv, "step_inter_keys": step_inter,
        "predicted_ms": predicted * 1e3, "step_predicted_ms": step_predicted * 1e3, "step_calls": step_calls,
        "solve_ms": seconds * 1e3 / max(len(mbs), 1),
    }  # fmt: skip


def run(*, quick: bool, cost: WorldCost = H100_DEFAULTS, seed: int = 1, corpus: Corpus | None = None
        ) -> list[dict]:  # fmt: skip
    """The section's rows; ``cost`` weighs the deal and predicts ``predicted_ms`` for both systems; ``seed``
    draws the documents' lengths (stdlib's are its files); ``corpus`` (``cpdata bench --lengths PATH``), where
    given, is the one distribution measured, its name the rows' ``distribution``."""
    names, n, k = (("sft", "long_context"), QUICK_PACKS, QUICK_STEPS) if quick else (NAMES, PACKS, STEPS)
    rows, skipped = [], None
    for name in names if corpus is None else (corpus,):
        for world, per_rank in WORLDS:
            packs = first_packs(name, world * per_rank, layout_spec("world", node_size=NODE_SIZE), world, n, seed)
            stream, per_step = stream_packs(name, world, per_rank, n, k, seed)  # (its first step: the step row's)
            laid = [_step(st, world, per_rank) for st in stream]
            stream_docs = [[lens for lens, _ in st] for st in stream]
            their_stream = megatron_steps(stream_docs, world, per_rank, NODE_SIZE)  # (the step row reads step 0)
            for system, (mbs, solve), docs, counts, theirs in (
                (PER_PACK, _cpdata(packs, world, per_rank, cost), [packs], None,
                 megatron_steps([packs], world, per_rank, NODE_SIZE)),
                (STEP, (laid[0], per_step[0]), stream_docs[:1], None, first_step(their_stream)),
                (STREAM, ([c for step in laid for c in step], sum(per_step)), stream_docs, [len(st) for st in stream],
                 their_stream),
            ):  # fmt: skip
                mine = _row(_label(name), world, per_rank, system, cost, mbs, solve, counts)
                flat = [lens for step in docs for lens in step]
                mine["fill"] = float(sum(int(lens.sum()) for lens in flat)) / (len(flat) * world * per_rank)
                if isinstance(theirs, str):
                    skipped = theirs
                    rows.append(mine)
                    continue
                their_mbs, their_seconds, their_counts = theirs
                other = _row(_label(name), world, per_rank, f"{MEGATRON} ({system}'s documents)", cost, their_mbs,
                             sum(their_seconds), their_counts)  # fmt: skip
                other["fill"] = 1.0  # (a GPU holds its sub-samples' tokens: no positions left as pad)
                for column in RATIOS:
                    mine[f"{column}_vs_megatron"] = mine[column] / other[column] if other[column] else (
                        1.0 if mine[column] == 0 else float(mine[column]))  # fmt: skip
                rows += [other, mine]
    if skipped is not None:
        print(f"world: megatron-core cannot be imported ({skipped}); its rows are skipped "
              "(pip install megatron-core>=0.16.1)")  # fmt: skip
    return rows
