"""Epochs of a global schedule: shuffle=True plans each epoch over the (seed, epoch) order, num_epochs runs several."""

from __future__ import annotations

from state_contract import run_save_load_contract
from test_scheduled import CFG, CountingDocs, _node
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.collate import Collate
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import build_loader, shard_graph
from cpdata.nodes.shard import ShardForRank
from cpdata.schedule import CostModel, plan_schedule
from tests.flat_options import graph_options, records


def _pieces(plans) -> list[tuple[int, int, int]]:
    return [(q.index, q.start, q.length) for p in plans for q in p.pieces]


def _epochs(plans) -> list[int]:
    return [p.extras["epoch"] for p in plans]


def test_shuffled_epochs_are_a_pure_function_of_seed_and_epoch():
    kw = dict(CFG, dp_size=2, micro_batches=2, overflow="split", max_delay=1, seed=5)
    lengths = CountingDocs().lengths
    for epoch in (0, 1, 2):
        a = plan_schedule(lengths, cost=CostModel(), shuffle=True, epoch=epoch,
                          **{k: v for k, v in kw.items() if k != "seed"}, seed=5)  # fmt: skip
        b = plan_schedule(lengths, cost=CostModel(), shuffle=True, epoch=epoch,
                          **{k: v for k, v in kw.items() if k != "seed"}, seed=5)  # fmt: skip
        assert (a.doc_index == b.doc_index).all() and (a.pack_offsets == b.pack_offsets).all()
    plain = [plan_schedule(lengths, cost=CostModel(), epoch=e, **{k: v for k, v in kw.items() if k != "seed"})
             for e in (0, 3)]  # fmt: skip
    assert (plain[0].doc_index == plain[1].doc_index).all()  # without shuffle the epoch changes nothing

    # Two epochs in one iter(): every document once per epoch over both ranks, each epoch its own order.
    per_epoch: dict[int, list] = {0: [], 1: []}
    for rank in range(2):
        node = _node(CountingDocs(), dp_rank=rank, shuffle=True, num_epochs=2, seed=5)
        node.reset()
        plans = list(node)
        for p in plans:
            per_epoch[p.extras["epoch"]] += [(q.index, q.start, q.length) for q in p.pieces]
        assert _epochs(plans) == sorted(_epochs(plans)) and set(_epochs(plans)) == {0, 1}
    lengths_of = dict(enumerate(lengths.tolist()))
    for epoch, pieces in per_epoch.items():
        covered: dict[int, int] = {}
        for d, _, n in pieces:
            covered[d] = covered.get(d, 0) + n
        assert covered == {d: n for d, n in lengths_of.items() if n}, epoch
    first = [p for p in per_epoch[0][:20]]
    assert first != per_epoch[1][:20]  # a fresh order in epoch 1


def test_resume_across_an_epoch_boundary_is_exact():
    def make():
        return ShardForRank(Collate(_node(CountingDocs(), shuffle=True, num_epochs=2, seed=2)), cp_size=2,
                            cp_rank=1, layout="thd")  # fmt: skip

    node = _node(CountingDocs(), shuffle=True, num_epochs=2, seed=2)
    node.reset()
    plans = list(node)
    boundary = _epochs(plans).index(1)
    run_save_load_contract(make, [0, boundary - 1, boundary, boundary + 1, len(plans)])

    # A fresh iter() starts the next epoch (epochs=2 here: four epochs over two iter() calls).
    def make_one():
        return _node(CountingDocs(), shuffle=True, seed=2)

    reference = run_save_load_contract(make_one, [0, 3, len(plans) // 2 + 2], epochs=2)
    assert [p.extras["epoch"] for p in reference] == sorted(p.extras["epoch"] for p in reference)
    # The restore plans at most the epoch it resumes in: no replay of earlier epochs' reads.
    late = _node(CountingDocs(), shuffle=True, num_epochs=2, seed=2)
    late.reset({**node.get_state(), "epoch": 1, "item": 0})
    first = next(late)
    assert first.extras["epoch"] == 1 and late.documents_read == len({q.index for q in first.pieces})


def test_workers_and_loader_follow_epochs_exactly():
    kw = dict(CFG, dp_rank=1, dp_size=2, micro_batches=2, schedule="balanced", overflow="split", shuffle=True,
              num_epochs=2, seed=4)  # fmt: skip
    reference = [b.info["digest"] for b in ShardForRank(shard_graph(CountingDocs(), graph_options(**kw)), cp_size=2, cp_rank=0,
                                                         layout="thd")]  # fmt: skip

    def make():
        return StatefulDataLoader(CPDataset(CountingDocs(), **records(cp_rank=0, **kw)), batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")  # fmt: skip

    assert [b.info["digest"] for b in make()] == reference
    loader = make()
    it = iter(loader)
    head = [next(it).info["digest"] for _ in range(len(reference) // 2 + 3)]  # into the second epoch
    state = loader.state_dict()
    del it, loader
    again = make()
    again.load_state_dict(state)
    assert head + [b.info["digest"] for b in again] == reference

    # build_loader: the same sequence; set_epoch on a CPDataset starts that epoch's order.
    loader = build_loader(CountingDocs(), **records(cp_rank=0, prefetch=0, **kw))
    assert [b.info["digest"] for b in loader] == reference
    one = dict(kw, num_epochs=None)
    second = [b.info["digest"] for b in ShardForRank(shard_graph(CountingDocs(), graph_options(**one)), cp_size=2, cp_rank=0,
                                                      layout="thd")]  # fmt: skip
    dataset = CPDataset(CountingDocs(), **records(cp_rank=0, **one))
    dataset.set_epoch(1)
    epoch1 = [b.info["digest"] for b in StatefulDataLoader(dataset, batch_size=None, num_workers=0)]
    assert epoch1 == reference[len(second):] and epoch1 != second
