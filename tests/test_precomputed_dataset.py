"""``PrecomputedDataset``: a plan through ``StatefulDataLoader`` workers, in order, resumed exactly in O(1)."""

from __future__ import annotations

import numpy as np
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import Collate, PrecomputedDataset, PrecomputedPacks, ShardForRank, precompute
from cpdata.nodes.options import DataPolicy, Delivery
from cpdata.sources.tokenstore import write_token_store
from tests.flat_options import precompute_records
from tests.state_contract import run_save_load_contract
from tests.test_precompute import assert_batches_equal

KW = {"capacity": 64, "cp_size": 2, "layout": "thd", "overflow": "split"}


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    rng = np.random.default_rng(0)
    docs = [{"input_ids": rng.integers(0, 999, size=int(rng.integers(1, 60)))} for _ in range(120)]
    store = write_token_store(docs, root / "tokens")
    precompute(store, root / "plan", **precompute_records(**KW))
    return root / "plan", store


def _reference(plan, store, batch_size, cp_rank=1):
    return list(ShardForRank(Collate(PrecomputedPacks(plan, store), batch_size=batch_size, qkv_format="thd"),
                             cp_size=2, cp_rank=cp_rank, layout="thd"))  # fmt: skip


def _loader(ds, workers):
    kw = {"multiprocessing_context": "fork"} if workers else {}
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_deliver_the_plan_in_order_and_resume_exactly(plan, workers):
    path, store = plan
    expected = _reference(path, store, batch_size=2)
    ds = PrecomputedDataset(path, store, cp_rank=1, batch_size=2, qkv_format="thd")
    assert len(ds) == len(expected) > 6
    got = list(_loader(ds, workers))
    assert len(got) == len(expected)
    for a, e in zip(got, expected, strict=True):
        assert_batches_equal(a, e)

    loader = _loader(PrecomputedDataset(path, store, cp_rank=1, batch_size=2, qkv_format="thd"), workers)
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    state = loader.state_dict()
    del it, loader
    resumed = _loader(PrecomputedDataset(path, store, cp_rank=1, batch_size=2, qkv_format="thd"), workers)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head) + len(tail) == len(expected)
    for a, e in zip(head + tail, expected, strict=True):
        assert_batches_equal(a, e)


def test_a_worker_reads_only_its_packs_and_restores_without_reading(plan, monkeypatch):
    path, store = plan
    plans = PrecomputedPacks(path, store)
    read: list[int] = []
    original = PrecomputedPacks.plan
    monkeypatch.setattr(PrecomputedPacks, "plan", lambda self, i, epoch=None: read.append(i) or original(self, i, epoch))
    node = plans.with_worker((1, 3), batch=2)
    items = list(node)
    batches = range(1, -(-len(plans) // 2), 3)  # batches 1, 4, 7, ... of two packs each
    assert read == [p for j in batches for p in (2 * j, 2 * j + 1) if p < len(plans)]
    assert len(items) == len(read) and read[:4] == [2, 3, 8, 9]
    read.clear()
    restored = plans.with_worker((1, 3), batch=2)
    restored.reset({**node.get_state(), "item": 14})  # its 5th pack: the first of batch 7
    assert read == [] and next(restored).index == 14 and read == [14]
    run_save_load_contract(lambda: PrecomputedPacks(path, store).with_worker((1, 3), batch=2),
                           midpoints=[0, 3, len(items)], epochs=2)  # fmt: skip
    with pytest.raises(ValueError, match="PrecomputedPacks state was saved with"):
        plans.with_worker((0, 3), batch=2).reset(node.get_state())


def test_configuration_is_checked_in_the_main_process(plan):
    path, store = plan
    with pytest.raises(ValueError, match="precomputed for cp_size=2"):
        PrecomputedDataset(path, store, cp_rank=0, cp_size=4)
    with pytest.raises(ValueError, match="cp_rank"):
        PrecomputedDataset(path, store, cp_rank=2)


def test_options_are_the_shared_records(plan):
    """DP split and delivery travel as DataPolicy/Delivery; 0.3's keywords and the order a plan fixed are refused."""
    path, store = plan
    halves = [list(_loader(PrecomputedDataset(path, store, cp_rank=1, qkv_format="thd",
                                              data=DataPolicy(dp_rank=r, dp_size=2)), 0)) for r in (0, 1)]  # fmt: skip
    whole = _reference(path, store, 1)
    n = len(whole) // 2
    assert len(halves[0]) == len(halves[1]) == n > 4
    for r in (0, 1):
        for got, want in zip(halves[r], whole[r::2][:n], strict=True):
            assert_batches_equal(got, want)
    for old, record in (("dp_size", "DataPolicy.dp_size"), ("prefetch", "Delivery.prefetch"),
                        ("kv_exchange", "Delivery.kv_exchange")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"PrecomputedDataset\(\) no longer takes {old}=.*{record}"):
            PrecomputedDataset(path, store, cp_rank=0, **{old: 1})
    with pytest.raises(TypeError, match=r"PrecomputedPacks\(\) no longer takes vocab_size=.*DataPolicy.vocab_size"):
        PrecomputedPacks(path, store, vocab_size=1000)
    for fixed in ({"seed": 1}, {"shuffle": True}, {"epochs": 2}):
        with pytest.raises(ValueError, match=rf"fixed its order.*DataPolicy\({next(iter(fixed))}="):
            PrecomputedDataset(path, store, cp_rank=0, data=DataPolicy(**fixed))
    with pytest.raises(ValueError, match="padding_token_id=1000 is >= vocab_size=999"):
        PrecomputedDataset(path, store, cp_rank=0, padding_token_id=1000, data=DataPolicy(vocab_size=999))
    with pytest.raises(TypeError, match="PrecomputedDataset does not pin"):
        PrecomputedDataset(path, store, cp_rank=0, delivery=Delivery(pin_memory=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_kv_exchange_and_block_size_reach_the_workers_batches(plan, workers):
    """The live path's shard options: each batch carries the exchange plan ShardForRank builds for the same pack."""
    path, store = plan
    expected = list(ShardForRank(Collate(PrecomputedPacks(path, store), batch_size=2, qkv_format="thd"),
                                 cp_size=2, cp_rank=1, layout="thd", kv_exchange=True))  # fmt: skip
    ds = PrecomputedDataset(path, store, cp_rank=1, batch_size=2, qkv_format="thd",
                            delivery=Delivery(kv_exchange=True, block_size=3))
    got = list(_loader(ds, workers))
    assert len(got) == len(expected) > 6
    for a, e in zip(got, expected, strict=True):
        assert_batches_equal(a, e)
        mine, ref = a.layout.kv_exchange, e.layout.kv_exchange
        assert mine is not None and ref is not None
        assert (mine.send_counts, mine.recv_counts) == (ref.send_counts, ref.recv_counts)
        assert np.array_equal(mine.send_runs, ref.send_runs) and np.array_equal(mine.recv_runs, ref.recv_runs)
    assert sum(b.layout.kv_exchange.n_recv for b in got) > 0  # something is exchanged at all
    plain = next(iter(_loader(PrecomputedDataset(path, store, cp_rank=1, batch_size=2, qkv_format="thd"), 0)))
    assert plain.layout.kv_exchange is None
