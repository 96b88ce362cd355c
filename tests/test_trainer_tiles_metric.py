"""The CP trainer logs the bench's attention imbalance: the busiest rank's live tiles over the ideal.

Two gloo ranks feed their own batches of a cp 2 pipeline to ``PackMetrics``
(what the trainer's ``compute_loss`` does) and drain one log line; the figure
must equal the bench's ``tiles_max_over_ideal`` computed from every rank's rows
at once (``live_tiles`` over the ranks' rows, ``block_tiles`` for the pack at
cp 1), mean over the packs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from cpdata.integrations.metrics import TILE, PackMetrics
from cpdata.layout.tiles import block_tiles, live_tiles
from cpdata.nodes.loader import shard_graph
from cpdata.nodes.shard import ShardForRank
from tests.dist_utils import run_ranks
from tests.flat_options import graph_options

CAPACITY = 1024


def _docs() -> list[dict]:
    rng = np.random.default_rng(4)
    return [{"input_ids": rng.integers(1, 99, int(n))} for n in rng.lognormal(5.0, 1.0, 60).clip(2, 900)]


def _packs(layout: str, rank: int | None) -> list:
    graph = shard_graph(_docs(), graph_options(capacity=CAPACITY, cp_size=2, layout=layout, overflow="split"))
    node = ShardForRank(graph, cp_size=2, cp_rank=rank or 0, layout=layout, all_ranks=rank is None)
    return list(node)


def _logged(rank: int, world: int, layout: str) -> float:
    metrics = PackMetrics(cp_group=dist.group.WORLD, cp_size=world)
    for batch in _packs(layout, rank):
        metrics.add(batch)
    return metrics.drain()["cp_tiles_max_over_ideal"]


def _bench_figure(layout: str) -> float:
    over = []
    for batches in _packs(layout, None):
        rows = np.stack([b.layout.local_token_global_indices.numpy() for b in batches])
        lens = np.diff(batches[0]["cu_seqlens_padded"].numpy())
        total = int(block_tiles(lens, CAPACITY, TILE).sum())
        over.append(live_tiles(rows, lens, CAPACITY, TILE).max() / (total / 2))
    return float(np.mean(over))


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_the_logged_imbalance_is_the_benchs_tiles_max_over_ideal(layout):
    logged = run_ranks(_logged, 2, layout, timeout=120)
    reference = _bench_figure(layout)
    print(f"{layout}: logged {logged[0]:.4f}, bench {reference:.4f}")
    assert logged[0] == logged[1] == pytest.approx(reference, rel=1e-12)
    if layout == "contiguous":
        assert reference > 1.2  # causal masks load the last rank: a figure the check can tell apart from 1
