"""A global schedule for streams without lengths: WindowedPacks, build_loader(schedule_window=...), CPDataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from torchdata.nodes import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import GraphOptions, build_loader, closing_loader, shard_graph
from cpdata.nodes.options import DataPolicy, SchedulePlan
from cpdata.nodes.shard import ShardForRank
from cpdata.nodes.windowed import WindowedPacks
from tests.flat_options import graph_options, records

CFG = {"capacity": 256, "cp_size": 2, "layout": "thd"}
WKW = dict(CFG, dp_size=3, micro_batches=2, schedule="balanced", overflow="split", schedule_window=64)


class Stream:
    """A re-iterable stream without ``__len__`` (lognormal lengths), counting the rows handed out."""

    def __init__(self, n: int = 301, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        sizes = np.clip(np.round(rng.lognormal(3.5, 1.0, n)), 1, 600).astype(np.int64)
        self.docs = [{"input_ids": rng.integers(1, 1000, size=int(k), dtype=np.int64)} for k in sizes]
        self.rows = 0

    def __iter__(self):
        for d in self.docs:
            self.rows += 1
            yield d


def windowed(src, window, worker=(0, 1), **flat) -> WindowedPacks:
    """``WindowedPacks`` from flat keywords (``schedule`` defaults to ``"balanced"``)."""
    return WindowedPacks(src, graph_options(**{"schedule": "balanced", "schedule_window": window, **flat}), worker=worker)


def _node(src, dp_rank=0, worker=(0, 1), **kw) -> WindowedPacks:
    args = dict(CFG, window=64, dp_rank=dp_rank, dp_size=3, micro_batches=2, overflow="split", worker=worker)
    args.update(kw)
    node = windowed(src, **args)
    node.reset()
    return node


def _pieces(plans) -> list[tuple[int, int, int]]:
    return [(q.index, q.start, q.length) for p in plans for q in p.pieces]


def _digests(loader) -> list[int]:
    with closing_loader(loader):
        return [b.info["digest"] for b in loader]


def test_equal_steps_per_rank_where_the_fallback_is_unequal():
    def count(rank, **kw):
        return len(_digests(build_loader(Stream(), **records(cp_rank=0, dp_rank=rank, dp_size=3, prefetch=0, **CFG, **kw))))

    fallback = [count(r, overflow="split") for r in range(3)]
    windowed = [count(r, **{k: v for k, v in WKW.items() if k not in CFG and k != "dp_size"}) for r in range(3)]
    assert len(set(fallback)) > 1, fallback
    assert len(set(windowed)) == 1 and windowed[0] > 0, windowed
    node = _node(Stream())
    steps = [p.extras["step"] for p in node if p.extras["micro_batch"] == 0]
    assert node.counts["windows"] == 5 and len(steps) == node.counts["steps"] == windowed[0] // 2


@pytest.mark.parametrize("tail", ["pad", "drop"])
def test_every_token_exactly_once_across_ranks_or_counted(tail):
    src = Stream()
    nodes = [_node(src, dp_rank=r, tail=tail) for r in range(3)]
    seen = sorted(x for n in nodes for x in _pieces(list(n)))
    tokens = np.zeros(len(src.docs), dtype=np.int64)
    for doc, start, length in seen:  # sorted: each document's pieces are contiguous, from token 0
        assert start == tokens[doc]
        tokens[doc] += length
    assert len(seen) == len(set(seen))
    total = sum(len(d["input_ids"]) for d in src.docs)
    assert int(tokens.sum()) + nodes[0].counts["tail_dropped_tokens"] == total
    if tail == "pad":
        assert (tokens == [len(d["input_ids"]) for d in src.docs]).all() and nodes[0].counts["empty_packs"] > 0
    else:
        assert nodes[0].counts["tail_dropped_tokens"] > 0
    assert src.rows == 3 * len(src.docs)  # every rank reads the whole stream once


def test_workers_keep_the_order_and_keep_only_their_documents():
    single = _node(Stream(), dp_rank=1)
    full = _pieces(list(single))
    nodes = [_node(Stream(), dp_rank=1, worker=(w, 2)) for w in range(2)]
    parts = [list(n) for n in nodes]
    merged = [p for pair in zip(parts[0], parts[1] + [None], strict=False) for p in pair if p is not None]
    assert _pieces(merged) == full
    for node, plans in zip(nodes, parts, strict=True):  # each keeps (validates) only its own packs' documents
        assert node.documents_kept == len({q.index for p in plans for q in p.pieces}) < single.documents_kept
        assert node.documents_read == len(Stream().docs)
    assert single.documents_kept == len({d for d, _, _ in full})


def test_deterministic_across_processes():
    code = (f"import json,sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from test_windowed import Stream, _node, _pieces; "
            "print(json.dumps(_pieces(list(_node(Stream(), dp_rank=2)))))")  # fmt: skip
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert [tuple(x) for x in json.loads(out.stdout)] == _pieces(list(_node(Stream(), dp_rank=2)))


def test_cp_peers_get_identical_packs():
    kw = {k: v for k, v in WKW.items()}
    a = [_pieces([p]) for p in shard_graph(Stream(), graph_options(dp_rank=1, **kw)).source]
    b = [_pieces([p]) for p in shard_graph(Stream(), graph_options(dp_rank=1, **kw)).source]
    assert a == b and len(a) > 4
    batches = [list(ShardForRank(shard_graph(Stream(), graph_options(dp_rank=1, **kw)), cp_size=2, cp_rank=r, layout="thd"))
               for r in range(2)]  # fmt: skip
    assert len(batches[0]) == len(batches[1])
    keys = ("digest", "real_tokens", "n_documents", "pack_indices", "max_seqlen")
    for x, y in zip(*batches, strict=True):
        assert [x.info[k] for k in keys] == [y.info[k] for k in keys]
    assert sum((b["labels"] != -100).sum().item() for r in batches for b in r) > 0


def test_pack_ids_number_the_epoch_across_windows_and_resume():
    ranks = [list(_node(Stream(), dp_rank=r)) for r in range(3)]
    ids = sorted(p.index for plans in ranks for p in plans)
    assert len({p.extras["window"] for p in ranks[0]}) >= 4
    assert ids == list(range(len(ids))), "every pack of the epoch, all DP ranks, has its own id"
    node = _node(Stream(), dp_rank=1)
    head = [node.next().index for _ in range(9)]
    again = windowed(Stream(), **dict(CFG, window=64, dp_rank=1, dp_size=3, micro_batches=2, overflow="split"))
    again.reset(node.get_state())
    assert head + [p.index for p in again] == [p.index for p in ranks[1]]


@pytest.mark.parametrize("cut", [3, 17, 23])
def test_loader_resume_mid_window_is_exact(cut):
    def make():
        return build_loader(Stream(), **records(cp_rank=0, dp_rank=1, prefetch=0, **{k: v for k, v in WKW.items() if k not in CFG}, **CFG))  # fmt: skip

    full = _digests(make())
    plans = list(_node(Stream(), dp_rank=1))
    assert len(plans) == len(full) and plans[cut - 1].extras["window"] == plans[cut].extras["window"]  # mid-window
    loader = make()
    it = iter(loader)
    head = [next(it).info["digest"] for _ in range(cut)]
    state = loader.state_dict()
    again = make()
    again.load_state_dict(state)
    assert head + _digests(again) == full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_with_workers_resumes_exactly(num_workers):
    kw = dict(WKW, dp_rank=2)
    reference = [b.info["digest"] for b in ShardForRank(shard_graph(Stream(), graph_options(**kw)), cp_size=2, cp_rank=0,
                                                         layout="thd")]  # fmt: skip

    def make():
        extra = {"multiprocessing_context": "fork"} if num_workers else {}
        return StatefulDataLoader(CPDataset(Stream(), **records(cp_rank=0, **kw)), batch_size=None,
                                  num_workers=num_workers, **extra)  # fmt: skip

    assert [b.info["digest"] for b in make()] == reference
    loader = make()
    it = iter(loader)
    head = [next(it).info["digest"] for _ in range(21)]
    state = loader.state_dict()
    del it, loader
    again = make()
    again.load_state_dict(state)
    assert head + [b.info["digest"] for b in again] == reference


def test_epochs_go_on_and_resume_across_the_epoch_end():
    one = _pieces(list(_node(Stream(n=100))))
    node = _node(Stream(n=100), num_epochs=2)
    two = list(node)
    assert _pieces(two) == one + one and {p.extras["epoch"] for p in two} == {0, 1}
    node = _node(Stream(n=100), num_epochs=2)
    head = [node.next() for _ in range(len(two) // 2 + 1)]
    again = windowed(Stream(n=100), **dict(CFG, window=64, dp_size=3, micro_batches=2, overflow="split",
                                                  num_epochs=2))  # fmt: skip
    again.reset(node.get_state())
    assert _pieces(head) + _pieces(list(again)) == _pieces(two)


def test_refusals_name_the_fix():
    with pytest.raises(TypeError, match=r"no longer takes schedule_window=; pass plan=SchedulePlan\(window=\.\.\.\)"):
        build_loader(Stream(), cp_rank=0, schedule_window=8, **CFG)
    with pytest.raises(ValueError, match="shuffle the stream upstream instead of DataPolicy\\(shuffle=True\\)"):
        GraphOptions(**CFG, plan=SchedulePlan(window=8), data=DataPolicy(shuffle=True))
    with pytest.raises(ValueError, match="SchedulePlan.window must be an int >= 1 or None, got 0$"):
        SchedulePlan(window=0)
    with pytest.raises(TypeError, match=r"SchedulePlan\(window=W\)"):
        shard_graph(Stream(), GraphOptions(**CFG, plan=SchedulePlan()))
    with pytest.raises(TypeError, match="re-iterable source"):
        shard_graph(IterableWrapper(Stream().docs), GraphOptions(**CFG, plan=SchedulePlan(window=8)))
    node = _node(Stream(), dp_rank=1)
    [node.next() for _ in range(5)]
    state = node.get_state()
    other = windowed(Stream(seed=1), **dict(CFG, window=64, dp_rank=1, dp_size=3, micro_batches=2,
                                                   overflow="split"))  # fmt: skip
    other.reset(state)
    with pytest.raises(ValueError, match="other document lengths"):
        other.next()
    with pytest.raises(ValueError, match="saved with"):
        _node(Stream(), dp_rank=2).reset(state)


def test_an_overlong_document_is_named_by_its_stream_position():
    docs = [{"input_ids": np.ones(k, dtype=np.int64)} for k in [10] * 70 + [300]]
    node = windowed(docs, window=64, **CFG)
    node.reset()
    with pytest.raises(ValueError, match=r"window 1 of the stream \(documents 64 to 70; add 64 .*document 6 has 300"):
        list(node)


@pytest.mark.parametrize("rows", [150, 192])
def test_a_shorter_stream_that_ends_before_the_saved_window_is_refused(rows):
    node = _node(Stream(), dp_rank=1)
    while node.next().extras["window"] < 3:
        pass
    state = node.get_state()
    assert state["block"]["window"] == 3 and rows <= 3 * 64  # the stream ends before the saved window
    short = Stream()
    short.docs = short.docs[:rows]  # the same rows, cut short: only the replay can tell
    again = windowed(short, **dict(CFG, window=64, dp_rank=1, dp_size=3, micro_batches=2, overflow="split"))
    with pytest.raises(ValueError, match=rf"the saved state is at window 3 .*ends after {rows} rows; restore onto"):
        again.reset(state)
        again.next()


def test_a_state_saved_right_after_a_restore_is_the_restored_one():
    node = _node(Stream(), dp_rank=1)
    head = [node.next() for _ in range(13)]
    state = node.get_state()
    assert state["block"]["window"] > 0 and state["block"]["lengths"] is not None
    again = windowed(Stream(), **dict(CFG, window=64, dp_rank=1, dp_size=3, micro_batches=2, overflow="split"))
    again.reset(state)
    assert again.get_state() == state
    third = windowed(Stream(), **dict(CFG, window=64, dp_rank=1, dp_size=3, micro_batches=2, overflow="split"))
    third.reset(again.get_state())
    assert _pieces(head) + _pieces(list(third)) == _pieces(list(_node(Stream(), dp_rank=1)))


def test_a_state_whose_window_position_is_not_an_int_at_least_0_is_refused():
    node = _node(Stream(), dp_rank=1)
    head = [node.next() for _ in range(13)]
    state = node.get_state()
    assert head and state["block"]["window"] > 0
    kw = dict(CFG, window=64, dp_rank=1, dp_size=3, micro_batches=2, overflow="split")
    for key, bad, shown in (("window", -1, "-1"), ("pack_base", None, "NoneType None"), ("window", 2.0, "float 2.0")):
        with pytest.raises(ValueError, match=rf"^WindowedPacks state's block\['{key}'\] must be an int >= 0, "
                                             rf"got {shown}$"):  # fmt: skip
            windowed(Stream(), **kw).reset({**state, "block": {**state["block"], key: bad}})
    windowed(Stream(), **kw).reset(state)  # the state itself restores
