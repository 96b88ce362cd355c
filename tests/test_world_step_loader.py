"""``StreamPlan(world_step=G)`` through the pipeline: the packer's owners reach every rank's layout, resume deals
the same steps, and what cannot carry owners refuses them."""

from __future__ import annotations

import numpy as np
import pytest

from cpdata import CPDataset
from cpdata.bench.distributions import sample, token_documents
from cpdata.layout.maps import layout_spec
from cpdata.layout.tiles import varlen_live_tiles
from cpdata.layout.world_owners import owned_runs
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.pack import Pack
from cpdata.nodes.source import Documents
from cpdata.packing.records import PackingConfig, PackKeys

W, LOCAL, NODE, STEP = 4, 1024, 2, 4
CAPACITY = W * LOCAL
LAYOUT = layout_spec("world", node_size=NODE)


def _docs(seed: int = 3, n: int = 300) -> list[dict]:
    return token_documents(sample("sft", n, seed), seed)


def _dataset(docs, rank: int, world_step: int = STEP) -> CPDataset:
    return CPDataset(docs, capacity=CAPACITY, cp_size=W, cp_rank=rank, layout=LAYOUT,
                     plan=StreamPlan(overflow="split", world_step=world_step))  # fmt: skip


def _rows(plan) -> list[np.ndarray]:
    starts, lengths, ranks = owned_runs(plan.slot_lens, plan.owners, CAPACITY, W, NODE)
    runs = list(zip(starts.tolist(), lengths.tolist(), ranks.tolist(), strict=True))
    return [np.concatenate([np.arange(a, a + n) for a, n, o in runs if o == r]) for r in range(W)]


def test_every_rank_holds_the_tokens_the_packers_owners_give_it():
    docs = _docs()
    plans = list(Pack(Documents(docs), capacity=CAPACITY, layout=LAYOUT, cp_size=W, overflow="split",
                      world_step=STEP))  # fmt: skip
    assert len(plans) >= 2 * STEP and all(p.owners is not None and p.owners.shape == (len(p.pieces), 2) for p in plans)
    assert any((p.owners[:, 1] > 1).any() for p in plans)  # a document spread over ranks (keys exchanged)
    ranks = [list(_dataset(docs, r)) for r in range(W)]
    assert all(len(batches) == len(plans) for batches in ranks)
    for k, plan in enumerate(plans):
        want = _rows(plan)
        for r in range(W):
            got = ranks[r][k].layout.local_token_global_indices.numpy()
            assert np.array_equal(got, want[r]), (k, r)
            ids = ranks[r][k]["input_ids"].reshape(-1).numpy()
            stream = np.concatenate([np.zeros(0, dtype=np.int64)] + [docs[i]["input_ids"][s : s + n]
                                                                       for i, s, n in plan.columns[:, :3].tolist()])
            real = want[r] < stream.shape[0]
            assert np.array_equal(ids[real], stream[want[r][real]])  # each rank's real tokens, in its local order
        assert len({ranks[r][k].layout.digest for r in range(W)}) == 1


def test_a_step_balances_each_ranks_tiles_summed_over_it_better_than_packs_dealt_alone():
    docs = _docs(seed=5, n=600)

    def step_sums(world_step: int) -> np.ndarray:
        plans = list(Pack(Documents(docs), capacity=CAPACITY, layout=LAYOUT, cp_size=W, overflow="split",
                          world_step=world_step))[:STEP]  # fmt: skip
        ranks = [list(_dataset(docs, r, world_step))[:STEP] for r in range(W)]
        tiles = [varlen_live_tiles(np.stack([ranks[r][k].layout.local_token_global_indices.numpy()
                                              for r in range(W)]), plan.slot_lens, CAPACITY, 128, pad_free=True)
                 for k, plan in enumerate(plans)]  # fmt: skip
        return np.sum(tiles, axis=0)

    stepped, alone = step_sums(STEP), step_sums(1)
    assert stepped.max() / stepped.mean() < alone.max() / alone.mean()
    assert stepped.max() / stepped.mean() <= 1.1


def test_resume_inside_a_step_deals_the_same_steps():
    docs = _docs(seed=7)
    first = _dataset(docs, 1)
    it = iter(first)
    head = [next(it) for _ in range(STEP + 1)]  # one whole step and one micro-batch of the next
    state = first.state_dict()
    rest = list(it)
    resumed = _dataset(docs, 1)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert head and len(again) == len(rest) > 0
    for a, b in zip(rest, again, strict=True):
        assert np.array_equal(a.layout.local_token_global_indices, b.layout.local_token_global_indices)
        assert np.array_equal(a["input_ids"], b["input_ids"]) and a.layout.digest == b.layout.digest


def test_world_step_refuses_what_cannot_carry_its_owners():
    docs = _docs(n=40)
    with pytest.raises(ValueError, match="world_step=4 deals micro-batches of a 'world' layout"):
        PackingConfig.resolve(capacity=CAPACITY, layout="tiled", cp_size=W, world_step=4)
    with pytest.raises(ValueError, match="world_step=2 .* algorithm 'next_fit'"):
        PackingConfig.resolve(capacity=CAPACITY, layout=LAYOUT, cp_size=W, algorithm="next_fit", world_step=2)
    with pytest.raises(ValueError, match="StreamPlan.world_step"):
        StreamPlan(world_step=0)
    with pytest.raises(ValueError, match="batch_size=1 with StreamPlan"):
        next(iter(CPDataset(docs, capacity=CAPACITY, cp_size=W, cp_rank=0, layout=LAYOUT, batch_size=2,
                            qkv_format="thd", plan=StreamPlan(overflow="split", world_step=2))))  # fmt: skip
    from cpdata.offline.precompute_plan import precompute

    with pytest.raises(ValueError, match=r"StreamPlan\(world_step=2\): a precomputed plan stores slot lengths"):
        precompute(docs, "never-written", capacity=CAPACITY, cp_size=W, layout=LAYOUT,
                   plan=StreamPlan(overflow="split", world_step=2))  # fmt: skip
    keys = np.arange(3, dtype=np.int64)
    with pytest.raises(ValueError, match="packs with owners and packs without"):
        PackKeys.concat([PackKeys(keys=keys, sizes=np.array([3]), owners=np.zeros((3, 2), dtype=np.int64)),
                         PackKeys(keys=keys, sizes=np.array([3]))])  # fmt: skip


@pytest.mark.parametrize("step", [2, 3, 4])
def test_a_stream_whose_last_window_closes_no_step_ends_with_its_owned_packs(step: int) -> None:
    """Twelve short documents at 4 x 16 tokens: a window that closes no step yields no packs (and no owners);
    joined with the packs the end of the stream closes (with owners) they make one stream, every document dealt
    once (a window's empty output once refused to join: "packs with owners and packs without")."""
    from tests import hf_zoo

    docs = hf_zoo.docs()
    plans = list(Pack(Documents(docs), capacity=64, layout=LAYOUT, cp_size=W, overflow="split", world_step=step))
    assert all(p.owners is not None for p in plans)
    dealt = sorted((i, s) for p in plans for i, s, _ in p.columns[:, :3].tolist())
    assert [i for i, s in dealt if s == 0] == list(range(len(docs)))  # each document's first token dealt once
    assert sum(int(p.slot_lens.sum()) for p in plans) == sum(len(d["input_ids"]) for d in docs)
    empty = PackKeys(keys=np.zeros(0, dtype=np.int64), sizes=np.zeros(0, dtype=np.int64))
    owned = PackKeys(keys=np.arange(3, dtype=np.int64), sizes=np.array([3]), owners=np.zeros((3, 2), np.int64))
    joined = PackKeys.concat([empty, owned, empty])
    assert joined.owners is not None and joined.keys.tolist() == [0, 1, 2] and joined.sizes.tolist() == [3]


def test_owners_that_do_not_fit_the_pack_are_refused():
    lens = np.array([LOCAL, 10], dtype=np.int64)
    with pytest.raises(ValueError, match="outside a world of 4"):
        owned_runs(lens, np.array([[0, 1], [3, 2]]), CAPACITY, W, NODE)
    with pytest.raises(ValueError, match="give a rank 1034 tokens"):
        owned_runs(lens, np.array([[0, 1], [0, 1]]), CAPACITY, W, NODE)


def test_a_shard_stage_under_another_node_size_than_the_deals_is_refused():
    """The packs of a world step dealt at 2 ranks a node, sharded under 4 (or one node: ``"world"``): a spread
    document's cut depends on the node size, so the owners would lay out runs the deal did not balance. Refused
    when the graph is built, naming both layouts; the deal's own layout builds."""
    from cpdata.nodes.loader import GraphOptions, shard_graph
    from cpdata.nodes.shard import ShardForRank

    graph = shard_graph(_docs(n=40), GraphOptions(capacity=CAPACITY, cp_size=W, layout=LAYOUT,
                                                  plan=StreamPlan(overflow="split", world_step=STEP)))  # fmt: skip
    for other in (layout_spec("world", node_size=4), "world"):
        with pytest.raises(ValueError, match=rf"dealt by world steps under layout '{LAYOUT}' \(2 ranks a node\) "
                                             rf"and sharded under layout '{other}' \(4\)"):  # fmt: skip
            ShardForRank(graph, cp_size=W, cp_rank=0, layout=other)
    assert next(iter(ShardForRank(graph, cp_size=W, cp_rank=0, layout=LAYOUT))).layout.cp_size == W
