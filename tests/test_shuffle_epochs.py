"""shuffle=True draws a fresh order per epoch from (seed, epoch); num_epochs passes per iter(); exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpdata import Documents, build_loader, closing_loader
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import DataPolicy, Delivery
from tests.flat_options import records


def _docs(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 100, int(rng.integers(1, 30)))} for _ in range(n)]


def _indices(node) -> list[int]:
    """One ``iter()``'s worth: reset (a new epoch), then every document."""
    node.reset()
    return [d.index for d in node]


def test_each_epoch_is_a_fresh_permutation_shared_by_dp_ranks():
    docs = _docs()
    node = Documents(docs, shuffle=True, seed=7)
    first, second = _indices(node), _indices(node)  # iter() twice: epochs 0 and 1
    assert node.epoch == 1
    assert first == np.random.default_rng((7, 0)).permutation(60).tolist()
    assert second == np.random.default_rng((7, 1)).permutation(60).tolist()
    assert first != second and sorted(first) == sorted(second) == list(range(60))
    assert _indices(Documents(docs, shuffle=True, seed=12345)) != first, "the seed matters"
    assert _indices(Documents(docs)) == list(range(60)), "shuffle=False keeps the source order"
    shards = [_indices(Documents(docs, shuffle=True, seed=7, dp_rank=r, dp_size=3)) for r in range(3)]
    assert [i for j in range(20) for i in (shards[0][j], shards[1][j], shards[2][j])] == first


def test_num_epochs_passes_per_iter_and_the_epoch_is_in_stats_and_state():
    docs = _docs(20)
    node = Documents(docs, shuffle=True, seed=1, num_epochs=3)
    seen = _indices(node)
    assert len(seen) == 60 and all(sorted(seen[k * 20 : (k + 1) * 20]) == list(range(20)) for k in range(3))
    assert node.epoch == 2 and node.state_dict()["epoch"] == 2
    assert len(_indices(Documents(docs, num_epochs=2))) == 40
    collated = shard_graph(docs, GraphOptions(capacity=64, cp_size=1, layout="identity", data=DataPolicy(epochs=2, shuffle=True)))
    collated.reset()
    list(collated)
    assert collated.source.stats.epoch == 1 and collated.source.stats.documents == 40


def _clone(batch):
    return {k: v.clone() for k, v in batch.items()}


@pytest.mark.parametrize("cut", [0, 3])
def test_resume_mid_epoch_after_a_shuffled_epoch_is_exact(cut):
    docs = _docs(80)
    kw = dict(capacity=64, cp_size=2, cp_rank=0, layout="thd", shuffle=True, seed=3, prefetch=0)
    with closing_loader(build_loader(docs, **records(**kw))) as loader:
        epoch0 = [_clone(b) for b in loader]
        it = iter(loader)  # epoch 1
        head = [_clone(next(it)) for _ in range(cut + 2)]
        state = loader.state_dict()
        tail = [_clone(b) for b in it]
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(epoch0, head, strict=False))
    with closing_loader(build_loader(docs, **records(**kw))) as restored:
        restored.load_state_dict(state)
        again = [_clone(b) for b in restored]
    assert len(again) == len(tail) > 0
    for a, b in zip(again, tail, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    with closing_loader(build_loader(docs, **records(**{**kw, "seed": 4}))) as other:
        other.load_state_dict(state)
        with pytest.raises(ValueError, match=r"\(shuffle, seed, num_epochs\)=\(True, 3, None\).*\(True, 4, None\)"):
            next(iter(other))


def test_every_cp_rank_of_a_group_sees_the_same_shuffled_packs():
    docs = _docs(50)
    digests = []
    for rank in range(2):
        with closing_loader(build_loader(docs, capacity=64, cp_size=2, cp_rank=rank, layout="balanced", data=DataPolicy(shuffle=True, seed=9), delivery=Delivery(prefetch=0))) as loader:  # fmt: skip
            digests.append([b.layout.digest for b in loader])
    assert digests[0] == digests[1] and len(digests[0]) > 3


def test_shuffle_arguments_are_checked():
    with pytest.raises(ValueError, match=r"^num_epochs must be an int >= 1 or None, got 0 \(None: one epoch per "
                                         r"iter\(\)\)$"):
        Documents(_docs(3), num_epochs=0)
    with pytest.raises(TypeError, match="^DataPolicy.shuffle must be True or False, got int 1$"):
        Documents(_docs(3), shuffle=1)


def test_stateful_dataloader_workers_follow_set_epoch():
    """Non-persistent workers rebuild the graph every epoch: set_epoch(e) gives epoch e's order, the same as the
    epochs a num_workers=0 loader counts itself."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cpdata import CPDataset

    docs = _docs(60)
    kw = dict(capacity=64, cp_size=1, layout="identity", shuffle=True, seed=5)
    plain = StatefulDataLoader(CPDataset(docs, **records(cp_rank=0, **kw)), batch_size=None, num_workers=0)
    want = [[_clone(b) for b in plain] for _ in range(2)]
    data = CPDataset(docs, **records(cp_rank=0, **kw))
    workers = StatefulDataLoader(data, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = []
    for epoch in range(2):
        data.set_epoch(epoch)
        got.append([_clone(b) for b in workers])
    assert not torch.equal(want[0][0]["input_ids"], want[1][0]["input_ids"]), "epochs differ"
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) > 2
        assert all(torch.equal(a[k], b[k]) for a, b in zip(g, w, strict=True) for k in a)
