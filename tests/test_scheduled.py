"""Reading only your own packs: ScheduledPacks, build_loader(schedule=...), CPDataset with workers."""

from __future__ import annotations

import numpy as np
import pytest
from state_contract import run_save_load_contract
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.collate import Collate
from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import build_loader, closing_loader, shard_graph
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.scheduled import ScheduledPacks
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import graph_options, precompute_records, records

CFG = {"capacity": 256, "cp_size": 2, "layout": "thd"}


class CountingDocs:
    """An indexable source with known lengths that records every index read."""

    def __init__(self, n: int = 300, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        sizes = np.clip(np.round(rng.lognormal(3.5, 1.0, n)), 1, 400).astype(np.int64)
        self.docs = [{"input_ids": rng.integers(1, 1000, size=int(k), dtype=np.int64)} for k in sizes]
        self.lengths = sizes
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        self.reads.append(int(i))
        return self.docs[i]


def scheduled(src, worker=(0, 1), **flat) -> ScheduledPacks:
    """``ScheduledPacks`` from flat keywords (``schedule`` defaults to ``"balanced"``)."""
    return ScheduledPacks(src, graph_options(**{"schedule": "balanced", **flat}), worker=worker)


def _node(src, dp_rank=0, worker=(0, 1), **kw) -> ScheduledPacks:
    args = dict(CFG, dp_rank=dp_rank, dp_size=2, micro_batches=2, overflow="split", max_delay=1, worker=worker)
    args.update(kw)
    return scheduled(src, **args)


def _docs_of(plans) -> list[tuple[int, int, int]]:
    return [(p.index, q.start, q.length) for p in plans for q in p.pieces]


def test_every_rank_gets_equal_steps_and_reads_only_its_documents():
    seen = []
    for rank in range(2):
        src = CountingDocs()
        node = _node(src, dp_rank=rank)
        node.reset()
        plans = list(node)
        sched = node.schedule
        assert len(plans) == sched.num_steps * 2 and sched.stats.max_delay_steps <= 1
        assert sorted(set(src.reads)) == sched.documents_of(rank).tolist()  # nothing else was read
        assert len(src.reads) == node.documents_read
        seen += [(q.index, q.start, q.length) for p in plans for q in p.pieces]
        for p in plans:
            assert int(p.slot_lens.sum()) <= CFG["capacity"]
    lengths = CountingDocs().lengths
    covered = {}
    for d, s, n in seen:
        covered.setdefault(d, []).append((s, n))
    for d, n in enumerate(lengths.tolist()):  # the two ranks together: every token exactly once
        parts = sorted(covered[d])
        assert parts[0][0] == 0 and sum(k for _, k in parts) == n
        assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))


@pytest.mark.parametrize("num_workers", [2, 3])
def test_workers_split_the_packs_and_read_only_theirs(num_workers):
    src = CountingDocs()
    whole = _node(src)
    whole.reset()
    reference = list(whole)
    per_worker_reads, merged = [], [None] * len(reference)
    for w in range(num_workers):
        s = CountingDocs()
        node = _node(s, worker=(w, num_workers))
        node.reset()
        items = list(node)
        for i, plan in enumerate(items):
            merged[w + num_workers * i] = plan
        per_worker_reads.append(len(s.reads))
        mine = {q.index for p in items for q in p.pieces}
        assert set(s.reads) == mine  # a worker reads only the documents of its own packs
    assert _docs_of(merged) == _docs_of(reference)
    assert sum(per_worker_reads) <= len(src.reads) + 2 * len(reference)  # split documents re-read per pack
    assert max(per_worker_reads) < 0.75 * len(src.reads)  # reads divide between workers


def test_resume_is_exact_and_constant_time():
    src = CountingDocs()

    def make():
        return ShardForRank(Collate(_node(CountingDocs())), cp_size=2, cp_rank=1, layout="thd")

    node = _node(src)
    node.reset()
    n = len(list(node))
    run_save_load_contract(make, [0, 1, n // 2, n - 1, n])
    late = _node(CountingDocs())
    late.reset({**node.get_state(), "item": n - 1})
    first = next(late)
    assert late.documents_read == len({q.index for q in first.pieces})  # no replay: only the last pack is read


def test_refuses_another_configuration_or_dataset():
    node = _node(CountingDocs())
    node.reset()
    next(node)
    state = node.get_state()
    with pytest.raises(ValueError, match="micro_batches"):
        _node(CountingDocs(), micro_batches=3).reset(state)
    with pytest.raises(ValueError, match="other document lengths"):
        _node(CountingDocs(seed=1)).reset(state)
    for bad, shown in ((-1, "-1"), (None, "NoneType None"), (1.0, "float 1.0")):
        with pytest.raises(ValueError, match=rf"^ScheduledPacks state's item must be an int >= 0, got {shown}$"):
            _node(CountingDocs()).reset({**state, "item": bad})
    _node(CountingDocs()).reset(state)  # the state itself restores


def test_sources_without_lengths_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="lengths="):
        scheduled([{"input_ids": [1, 2]}], **CFG)
    with pytest.raises(TypeError, match="__getitem__"):
        scheduled(iter([]), lengths=[2], **CFG)
    docs = CountingDocs(20)
    docs.lengths = docs.lengths + 1
    node = scheduled(docs, **CFG)
    node.reset()
    with pytest.raises(ValueError, match="its length was given as"):
        list(node)
    with pytest.raises(TypeError, match="unexpected keyword argument 'micro_batches'"):
        StreamPlan(micro_batches=2)  # an option of the schedule cannot reach the streaming packer


def _digests(loader) -> list[int]:
    with closing_loader(loader):
        return [b.info["digest"] for b in loader]


def test_in_order_at_one_rank_equals_todays_pipeline():
    src = CountingDocs(200)
    today = _digests(build_loader(src.docs, **records(cp_rank=0, prefetch=0, **CFG)))
    planned = _digests(build_loader(src, **records(cp_rank=0, prefetch=0, schedule="in_order", **CFG)))
    assert planned == today and len(today) > 10


def test_loader_resume_exact_and_equal_counts_per_rank():
    def make(rank):
        return build_loader(CountingDocs(), **records(cp_rank=0, dp_rank=rank, dp_size=2, micro_batches=2, schedule="balanced", overflow="split", prefetch=0, **CFG))  # fmt: skip

    counts = [len(_digests(make(r))) for r in range(2)]
    assert counts[0] == counts[1] > 4
    full = _digests(make(1))
    loader = make(1)
    it = iter(loader)
    head = [next(it).info["digest"] for _ in range(3)]
    state = loader.state_dict()
    again = make(1)
    again.load_state_dict(state)
    assert head + _digests(again) == full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_with_workers_resumes_exactly(num_workers):
    kw = dict(CFG, dp_rank=1, dp_size=2, micro_batches=2, schedule="balanced", overflow="split")
    reference = [b.info["digest"] for b in ShardForRank(shard_graph(CountingDocs(), graph_options(**kw)), cp_size=2, cp_rank=0,
                                                         layout="thd")]  # fmt: skip

    def make():
        extra = {"multiprocessing_context": "fork"} if num_workers else {}
        return StatefulDataLoader(CPDataset(CountingDocs(), **records(cp_rank=0, **kw)), batch_size=None,
                                  num_workers=num_workers, **extra)  # fmt: skip

    assert [b.info["digest"] for b in make()] == reference
    loader = make()
    it = iter(loader)
    head = [next(it).info["digest"] for _ in range(3)]
    state = loader.state_dict()
    del it, loader
    again = make()
    again.load_state_dict(state)
    assert head + [b.info["digest"] for b in again] == reference


def test_empty_tail_packs_collate_to_pure_padding():
    docs = CountingDocs(5)
    node = scheduled(docs, capacity=512, layout="thd", cp_size=2, dp_size=2, dp_rank=1, micro_batches=2)
    assert node.schedule.stats.empty_packs > 0
    batches = list(ShardForRank(Collate(node), cp_size=2, cp_rank=0, layout="thd"))
    empty = [b for b in batches if b.info.get("num_docs", 1) == 0 or not (b["labels"] != -100).any()]
    assert empty and all((b["labels"] == -100).all() for b in empty)


def test_precompute_writes_the_same_schedule_and_serves_equal_counts(tmp_path):
    import json

    from cpdata.cli import main as cli_main
    from cpdata.offline import PrecomputedPacks
    from cpdata.offline.precompute_plan import precompute
    from cpdata.sources import open_dataset

    src = CountingDocs(120)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d["input_ids"].tolist()}) + "\n" for d in src.docs))
    docs = open_dataset(path)
    kw = dict(CFG, overflow="split")
    store = precompute(docs, tmp_path / "plan", **precompute_records(dp_size=2, micro_batches=2, max_delay=1, **kw))
    assert store.manifest["schedule"]["dp_size"] == 2
    counts = []
    for rank in range(2):
        served = PrecomputedPacks(tmp_path / "plan", docs, data=DataPolicy(dp_rank=rank, dp_size=2))
        served.reset()
        online = scheduled(docs, dp_rank=rank, dp_size=2, micro_batches=2, max_delay=1, **kw)
        online.reset()
        a, b = list(served), list(online)
        counts.append(len(a))
        assert [(q.index, q.start, q.length, q.next_label) for p in a for q in p.pieces] == \
            [(q.index, q.start, q.length, q.next_label) for p in b for q in p.pieces]
        assert [p.slot_lens.tolist() for p in a] == [p.slot_lens.tolist() for p in b]
    assert counts[0] == counts[1] > 2
    with pytest.raises(ValueError, match="dp_size=2"):
        PrecomputedPacks(tmp_path / "plan", docs, data=DataPolicy(dp_rank=0, dp_size=4))
    assert cli_main(["precompute", str(path), "--capacity", "256", "--cp-size", "2", "--layout", "thd",
                     "--overflow", "split", "--dp-size", "2", "--micro-batches", "2", "--max-delay", "1",
                     "--out", str(tmp_path / "cli"), "--quiet"]) == 0  # fmt: skip
    cli = PrecomputedPacks(tmp_path / "cli", docs, data=DataPolicy(dp_rank=1, dp_size=2))
    assert (cli.store.arrays["doc_index"] == store.arrays["doc_index"]).all()


class LoggedDocs(CountingDocs):
    """Appends ``pid index`` per read to a file: reads made inside dataloader workers are visible."""

    def __init__(self, log, **kw) -> None:
        super().__init__(**kw)
        self.log = str(log)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        import os

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {int(i)}\n")
        return self.docs[i]


def test_dataloader_workers_read_only_their_own_documents(tmp_path):
    kw = dict(CFG, dp_rank=0, dp_size=2, micro_batches=2, schedule="balanced", overflow="split")
    reads = {}
    for workers in (1, 2):
        log = tmp_path / f"reads{workers}.txt"
        ds = CPDataset(LoggedDocs(log), **records(cp_rank=0, **kw))
        log.write_text("")  # planning in the main process reads lengths only
        batches = list(StatefulDataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork"))
        rows = [line.split() for line in log.read_text().splitlines()]
        by_pid: dict[str, list[int]] = {}
        for pid, i in rows:
            by_pid.setdefault(pid, []).append(int(i))
        assert len(by_pid) == workers and batches
        reads[workers] = sorted(i for v in by_pid.values() for i in v)
        mine = ds._scheduled.schedule.documents_of(0).tolist()
        assert sorted(set(reads[workers])) == mine  # only this rank's documents, all of them
        if workers == 2:  # each worker read a disjoint share, apart from documents split across packs
            shares = [set(v) for v in by_pid.values()]
            overlap = sum(len(a & b) for k, a in enumerate(shares) for b in shares[k + 1 :])
            assert overlap <= ds._scheduled.schedule.stats.split + 2
    assert len(reads[2]) <= len(reads[1]) + 2 * len(set(reads[1])) // 10 + 4  # no worker re-reads the stream


def test_labels_follow_the_declared_alignment_as_in_todays_pipeline():
    src = CountingDocs(150)
    rng = np.random.default_rng(5)
    for d in src.docs:  # prompt masked, answer trained; labels aligned with input_ids (HF convention)
        labels = d["input_ids"].copy()
        labels[: int(rng.integers(0, len(labels)))] = -100
        d["labels"] = labels

    def labels_of(loader) -> list[np.ndarray]:
        with closing_loader(loader):
            return [np.asarray(b["labels"]) for b in loader]

    today = labels_of(build_loader(src.docs, **records(cp_rank=0, prefetch=0, labels_alignment="inputs", **CFG)))
    planned = labels_of(build_loader(src, **records(cp_rank=0, prefetch=0, labels_alignment="inputs", schedule="in_order", **CFG)))  # fmt: skip
    assert len(planned) == len(today) > 5
    for a, b in zip(planned, today, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="labels_alignment"):
        list(scheduled(src, **CFG))


def test_hf_dataset_plans_from_its_lengths():
    import datasets

    src = CountingDocs(80)
    hf = datasets.Dataset.from_dict({"input_ids": [d["input_ids"].tolist() for d in src.docs]})
    kw = dict(CFG, dp_rank=1, dp_size=2, micro_batches=2, overflow="split")
    a, b = scheduled(hf, **kw), scheduled(src, **kw)
    a.reset()
    b.reset()
    assert _docs_of(list(a)) == _docs_of(list(b)) and a.schedule.num_steps > 1
