"""ShardForRank's blocks: the output never depends on the block size, resume is exact at every batch of a
block, errors keep their position and message, and the source's state is read once per block."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from state_contract import run_save_load_contract
from test_collate import make_plans
from test_loader import documents
from torchdata.nodes import BaseNode, IterableWrapper, Loader, Prefetcher
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.layout.maps import alignment
from cpdata.nodes import shard as shard_module
from cpdata.nodes.collate import Collate
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import build_loader, build_node, shard_graph
from cpdata.nodes.options import Delivery
from cpdata.nodes.shard import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, ShardForRank
from cpdata.worker.batch import ShardedBatch
from cpdata.worker.plan import PackPlan
from tests.flat_options import graph_options, records

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")


def plans_for(layout: str, cp: int, n: int, seed: int = 0) -> list[PackPlan]:
    doc_multiple, pack_multiple = alignment(layout, cp)
    capacity = pack_multiple * (96 // pack_multiple)
    plans, _ = make_plans(np.random.default_rng(seed), n_plans=n, capacity=capacity, doc_multiple=doc_multiple,
                          max_docs=6, extras=True, given_labels=0.2)  # fmt: skip
    return plans


def assert_batches_equal(got: Any, want: Any) -> None:
    """Every tensor, both layout maps, the layout record and the info dict, bit for bit (tuples: per rank)."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_batches_equal(g, w)
        return
    assert isinstance(got, ShardedBatch) and list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    for field in dataclasses.fields(want.layout):
        a, b = getattr(got.layout, field.name), getattr(want.layout, field.name)
        assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, field.name
    assert got.info == want.info


class Counting(BaseNode[Any]):
    """A pass-through node counting its ``state_dict`` calls; raises ``error`` instead of item ``fail_at``."""

    def __init__(self, source: BaseNode[Any], fail_at: int | None = None) -> None:
        super().__init__()
        self.source, self.fail_at, self.states, self.pulled = source, fail_at, 0, 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)
        self.pulled = 0

    def next(self) -> Any:
        item = next(self.source)
        self.pulled += 1
        if self.pulled - 1 == self.fail_at:
            raise ValueError(f"document 1234 is bad (item {self.fail_at})")
        return item

    def get_state(self) -> dict[str, Any]:
        self.states += 1
        return self.source.state_dict()


def outcomes(node: BaseNode[Any], n: int) -> list[Any]:
    """``n`` calls of ``next``: each a batch, or ``(type, message)`` of what it raised."""
    out: list[Any] = []
    for _ in range(n):
        try:
            out.append(next(node))
        except StopIteration:
            out.append("stop")
            break
        except Exception as exc:  # noqa: BLE001  (compared by type and message)
            out.append((type(exc), str(exc)))
    return out


def assert_outcomes_equal(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, (ShardedBatch, tuple)) and not (isinstance(w, tuple) and isinstance(w[0], type)):
            assert_batches_equal(g, w)
        else:
            assert g == w


def test_block_size_is_validated():
    plans = plans_for("thd", 2, n=2)
    for bad in (0, -1, True, 2.5, "4"):
        with pytest.raises(ValueError, match=rf"^block_size must be an int >= 1 or None, got .*{bad!r} \(batches"):
            ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd", block_size=bad)
    assert ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd").block_size is None


@pytest.mark.parametrize(("budget_packs", "want"), [(0, DEFAULT_BLOCK_SIZE), (16, 16), (20, 20), (40, 40),
                                                    (10**6, MAX_BLOCK_SIZE)])  # fmt: skip
def test_the_default_block_holds_16_batches_and_block_tokens_at_most_64_batches(monkeypatch, budget_packs, want):
    plans = plans_for("thd", 2, n=70, seed=5)
    pack_tokens = plans[0].capacity
    monkeypatch.setattr(shard_module, "BLOCK_TOKENS", budget_packs * pack_tokens)
    counting = Counting(Collate(IterableWrapper(plans)))
    node = ShardForRank(counting, cp_size=2, cp_rank=0, layout="thd")
    node.reset()
    first = next(node)
    assert counting.pulled == want  # the first block: pulled before its first batch is served
    rest = list(node)
    assert counting.pulled == 70 and [b.info["pack_indices"] for b in [first, *rest]] == [[i] for i in range(70)]


@pytest.mark.parametrize(("layout", "cp", "qkv_format", "batch_size"), [
    ("thd", 4, "thd", 1), ("thd", 2, "thd", 3), ("balanced", 3, "thd", 2), ("balanced", 4, "bshd", 1),
    ("round_robin", 2, "bshd", 2), ("contiguous", 3, "thd", 2), ("identity", 1, "bshd", 1), ("thd", 1, "bshd", 1),
])  # fmt: skip
def test_output_does_not_depend_on_the_block_size(layout, cp, qkv_format, batch_size):
    plans = plans_for(layout, cp, n=25, seed=cp)
    runs = {}
    for k in (1, 8, 3, 100):
        node = ShardForRank(Collate(IterableWrapper(plans), batch_size=batch_size, qkv_format=qkv_format),
                            cp_size=cp, cp_rank=0, layout=layout, all_ranks=True, block_size=k)  # fmt: skip
        runs[k] = list(node)
    n = len(runs[1])
    assert n == -(-25 // batch_size) and n % 8  # a short last block
    assert any(b[0].info["n_documents"] == 0 for b in runs[1]) or batch_size > 1  # empty packs occur
    for k in (8, 3, 100):
        assert len(runs[k]) == n
        for got, want in zip(runs[k], runs[1], strict=True):
            assert_batches_equal(got, want)


@pytest.mark.parametrize(("layout", "qkv_format", "k"), [("thd", "thd", 3), ("balanced", "bshd", 4),
                                                         ("round_robin", "thd", 5)])  # fmt: skip
def test_resume_at_every_batch_of_a_block_equals_the_uninterrupted_run(layout, qkv_format, k):
    plans = plans_for(layout, 2, n=11, seed=5)

    def make() -> ShardForRank:
        return ShardForRank(Collate(IterableWrapper(plans), qkv_format=qkv_format), cp_size=2, cp_rank=1,
                            layout=layout, block_size=k)  # fmt: skip

    reference = run_save_load_contract(make, range(12), assert_batches_equal, epochs=2, round_trips=("pickle",))
    assert len(reference) == 22


def test_a_state_resumes_under_another_block_size():
    plans = plans_for("thd", 2, n=11, seed=1)
    make = lambda k: ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd",  # noqa: E731
                                  block_size=k)  # fmt: skip
    want = list(make(1))
    node = make(4)
    for _ in range(6):
        next(node)
    state = node.state_dict()
    assert state["skip"] == 2
    for k in (1, 3, 8):
        resumed = make(k)
        resumed.reset(state)
        for got, ref in zip(list(resumed), want[6:], strict=True):
            assert_batches_equal(got, ref)


def test_restored_batches_are_skipped_without_gathering_their_tokens(monkeypatch):
    import cpdata.nodes.shard as shard_module

    plans = plans_for("thd", 2, n=8, seed=2)
    node = ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd", block_size=4)
    for _ in range(3):
        next(node)
    state = node.state_dict()
    assert state["skip"] == 3 and len(state["served_digests"]) == 3
    gathered = []
    real = shard_module.fill_rank
    monkeypatch.setattr(shard_module, "fill_rank", lambda stream, *a, **kw: gathered.append(stream) or real(stream, *a, **kw))
    resumed = ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd", block_size=4)
    resumed.reset(state)
    assert [b.info["pack_indices"] for b in resumed] == [[i] for i in range(3, 8)]
    assert len(gathered) == 5  # the three served batches of the block were pulled again, not gathered


def test_a_state_restored_onto_another_source_is_refused():
    plans = plans_for("balanced", 2, n=8, seed=2)
    node = ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="balanced", block_size=4)
    for _ in range(6):
        next(node)
    state = node.state_dict()
    other = plans_for("balanced", 2, n=8, seed=3)  # same count, other documents
    resumed = ShardForRank(Collate(IterableWrapper(other)), cp_size=2, cp_rank=0, layout="balanced", block_size=4)
    resumed.reset(state)
    with pytest.raises(ValueError, match="batch 0 of the saved block has another plan digest now.*same source"):
        next(resumed)
    shorter = ShardForRank(Collate(IterableWrapper(plans[:5])), cp_size=2, cp_rank=0, layout="balanced")
    shorter.reset(state)
    with pytest.raises(ValueError, match="served 2 batches of its block, but the source ends after 1"):
        next(shorter)
    with pytest.raises(ValueError, match="served_digests"):
        shorter.reset({**state, "served_digests": [1]})


def test_source_state_is_read_once_per_block():
    plans = plans_for("thd", 2, n=10, seed=3)
    counting = Counting(Collate(IterableWrapper(plans)))
    node = ShardForRank(counting, cp_size=2, cp_rank=0, layout="thd", block_size=4)
    node.reset()
    states = []
    for _ in range(10):
        next(node)
        states.append(node.state_dict())
    assert [s["skip"] for s in states] == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert counting.states == 3  # blocks of 4, 4, 2
    assert states[0]["source"] is states[3]["source"] and states[4]["source"] is not states[3]["source"]


@pytest.mark.parametrize("fail_at", [0, 2, 4, 5])
def test_a_source_error_mid_block_comes_after_the_batches_pulled_before_it(fail_at):
    plans = plans_for("balanced", 2, n=9, seed=4)
    runs = {}
    for k in (1, 4):
        counting = Counting(Collate(IterableWrapper(plans)), fail_at=fail_at)
        runs[k] = outcomes(ShardForRank(counting, cp_size=2, cp_rank=0, layout="balanced", block_size=k), 12)
    assert runs[1][fail_at] == (ValueError, f"document 1234 is bad (item {fail_at})")
    assert [b.info["pack_indices"] for b in runs[1][:fail_at]] == [[i] for i in range(fail_at)]
    assert_outcomes_equal(runs[4], runs[1])  # the same batches, the same error at the same place, then the rest


def test_a_bad_batch_mid_block_raises_there_with_the_per_batch_message():
    plans = plans_for("thd", 2, n=9, seed=6)
    at = next(i for i in range(4, 9) if len(plans[i].columns) > 1 and plans[i].slot_lens.sum() < plans[i].capacity)
    bad = plans[at]
    slots = bad.slot_lens.copy()
    slots[0] += 1  # no longer a multiple of 2 * cp: Collate takes it, the layout refuses it
    plans[at] = PackPlan(pieces=bad.pieces, slot_lens=slots, capacity=bad.capacity, index=bad.index)
    runs = {}
    for k in (1, 4, 8):
        node = ShardForRank(Collate(IterableWrapper(plans)), cp_size=2, cp_rank=0, layout="thd", block_size=k)
        runs[k] = outcomes(node, 12)
    assert runs[1][at][0] is ValueError and "multiple of 2*cp_size=4" in runs[1][at][1]
    assert len(runs[1]) == 10 and runs[1][-1] == "stop"
    assert_outcomes_equal(runs[4], runs[1])
    assert_outcomes_equal(runs[8], runs[1])


def test_bshd_rows_of_a_document_layout_are_refused_when_served():
    plans = plans_for("balanced", 2, n=4)
    node = ShardForRank(IterableWrapper(list(Collate(IterableWrapper(plans), batch_size=2))), cp_size=2, cp_rank=0,
                        layout="balanced", block_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="qkv_format='thd'"):
        next(node)


def test_loader_with_a_prefetcher_resumes_at_every_batch_of_a_block():
    docs = documents(40)
    cfg = {"capacity": 64, "cp_size": 2, "layout": "thd", "algorithm": "bfd", "seed": 3}

    def make() -> Loader:
        return Loader(Prefetcher(ShardForRank(shard_graph(docs, graph_options(**cfg)), cp_size=2, cp_rank=0, layout="thd",
                                              block_size=3), prefetch_factor=2))  # fmt: skip

    want = [b.info["digest"] for b in make()]
    assert len(want) >= 7
    for mid in range(len(want)):  # (a state saved after the last batch starts the next epoch: test_loader)
        loader = make()
        it = iter(loader)
        head = [next(it).info["digest"] for _ in range(mid)]
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [b.info["digest"] for b in resumed] == want, mid


def test_stateful_dataloader_with_workers_resumes_inside_a_block():
    docs = documents(240, seed=1)
    k = DEFAULT_BLOCK_SIZE  # (the default block of such short packs is larger: more than the stream)
    cfg = {"capacity": 64, "cp_size": 2, "layout": "thd", "algorithm": "bfd", "seed": 3, "prefetch": 0, "block_size": k}

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(CPDataset(docs, **records(cp_rank=0, **cfg)), batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")  # fmt: skip

    want = [b.info["digest"] for b in make()]
    assert len(want) > 2 * k + 4  # each worker serves more than one block
    for mid in (3, 2 * k - 1, 2 * k + 3):
        loader = make()
        it = iter(loader)
        head = [next(it).info["digest"] for _ in range(mid)]
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        assert head + [b.info["digest"] for b in resumed] == want, mid


def test_the_loaders_pass_block_size_to_the_node_and_refuse_a_bad_one():
    docs = documents(60, seed=2)
    cfg = {"capacity": 64, "cp_size": 2, "cp_rank": 0, "layout": "balanced", "seed": 3, "prefetch": 0}
    node = build_node(docs, **records(block_size=3, **cfg))
    assert isinstance(node, ShardForRank) and node.block_size == 3
    assert build_node(docs, **records(**cfg)).block_size is None  # sized by tokens
    want = [b.info["digest"] for b in build_loader(docs, **records(block_size=1, **cfg))]
    assert len(want) > 5 and [b.info["digest"] for b in build_loader(docs, **records(block_size=5, **cfg))] == want
    dataset = CPDataset(docs, **records(block_size=2, **{k: v for k, v in cfg.items() if k != "prefetch"}))
    assert [b.info["digest"] for b in StatefulDataLoader(dataset, batch_size=None)] == want
    for bad, error in ((0, ValueError), (2.5, TypeError), (True, TypeError)):  # refused where it is written
        with pytest.raises(error, match=rf"^Delivery.block_size must be an int >= 1 or None, got .*{bad!r}$"):
            Delivery(block_size=bad)
