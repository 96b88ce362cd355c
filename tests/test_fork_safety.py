"""Readers are safe across threads and forked dataloader workers (each process reads through its own handle)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import CPDataset, open_dataset
from cpdata.nodes.options import DataPolicy


def _write(path, n=400, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            ids = rng.integers(0, 1000, int(rng.integers(1, 60))).tolist()
            mask = [int(j >= len(ids) // 3) for j in range(len(ids))]
            f.write(json.dumps({"input_ids": ids, "assistant_masks": mask, "note": "x" * (i % 13)}) + "\n")
            if i % 50 == 7:
                f.write("\n")  # blank lines are not documents
    return path


def test_jsonl_reads_from_many_threads_are_exact(tmp_path):
    ds = open_dataset(_write(tmp_path / "d.jsonl"))
    want = [ds[i] for i in range(len(ds))]
    order = np.random.default_rng(1).integers(0, len(ds), 4000).tolist()
    fresh = open_dataset(tmp_path / "d.jsonl")
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(fresh.__getitem__, order))
    for i, row in zip(order, got, strict=True):
        assert row.keys() == want[i].keys()
        assert all(np.array_equal(row[k], want[i][k]) for k in row)


def test_threads_racing_on_the_first_read_share_one_handle(tmp_path):
    """Eight threads make a fresh reader's first read at the same instant, 40 times: every row is read
    exactly (a thread whose handle was replaced by another's would read through a closed or reused descriptor)."""
    path = _write(tmp_path / "d.jsonl", n=64)
    want = [open_dataset(path)[i] for i in range(8)]
    for _ in range(40):
        fresh = open_dataset(path)
        start = threading.Barrier(8)

        def read(i, fresh=fresh, start=start):
            start.wait()
            return fresh[i]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(read, range(8)))
        for row, ref in zip(got, want, strict=True):
            assert all(np.array_equal(row[k], ref[k]) for k in ref)


def _batches(ds, num_workers):
    data = CPDataset(ds, capacity=128, cp_size=2, cp_rank=0, layout="thd", qkv_format="thd", data=DataPolicy(labels_alignment="inputs"))  # fmt: skip
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = StatefulDataLoader(data, batch_size=None, num_workers=num_workers, **kw)
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_forked_workers_after_a_parent_read_give_the_zero_worker_batches(tmp_path):
    """The parent reads (opening its handle), then two forked workers read the same file at once: the batches
    are bit-identical to num_workers=0 (a shared handle's offset made workers read each other's rows)."""
    ds = open_dataset(_write(tmp_path / "d.jsonl", n=600))
    assert ds[0]["input_ids"].size and ds[len(ds) - 1]["input_ids"].size  # the parent's handle is open
    want = _batches(ds, 0)
    got = _batches(ds, 2)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
