"""Section ``long_document``: one epoch over a JSONL holding a very long document, online and offline.

400 short documents (1..2,000 tokens) with one of 5M tokens (500K with ``--quick``) in the middle, one JSONL
file, packed at 32K for ``thd`` at cp 2 with ``overflow="split"``. ``online_s``: ``Documents -> Pack ->
Collate -> ShardForRank``, one epoch, rank 0; ``offline_s``: the same through ``PrecomputedPacks`` from a plan
made beforehand (``precompute_s``). Both read the same opened :class:`~cpdata.sources.JsonlDocuments`; the
offline reader parses the long row once per epoch, not once per piece. Each time is the best of three epochs,
run alternately after a ``gc.collect()``; ``ratio`` = offline / online.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["COLUMNS", "run"]

COLUMNS: tuple[str, ...] = ("doc_tokens", "pieces", "online_s", "offline_s", "ratio")
TABLE: tuple[str, ...] = (*COLUMNS, "precompute_s", "packs")
TITLE = "seconds per epoch over a JSONL with one very long document (thd, cp 2, capacity 32K, split)"
CAPACITY, CP, LAYOUT = 32768, 2, "thd"
REPEATS = 3


def _write_corpus(path: Path, long_tokens: int) -> None:
    rng = np.random.default_rng(0)
    short = [rng.integers(0, 50_000, int(n)).tolist() for n in rng.integers(1, 2000, 400)]
    with open(path, "w") as f:
        for i, ids in enumerate(short):
            if i == len(short) // 2:
                f.write(json.dumps({"input_ids": rng.integers(0, 50_000, long_tokens).tolist()}) + "\n")
            f.write(json.dumps({"input_ids": ids}) + "\n")


def _epoch(node) -> tuple[float, int]:
    gc.collect()  # the previous epoch's graph (reference cycles) may still hold the long document
    start = time.perf_counter()
    n = sum(1 for _ in node)
    return time.perf_counter() - start, n


def run(*, quick: bool = False) -> list[dict]:
    from cpdata.bench.distributions import split_graph
    from cpdata.nodes.collate import Collate
    from cpdata.nodes.options import StreamPlan
    from cpdata.nodes.shard import ShardForRank
    from cpdata.offline import PrecomputedPacks, precompute
    from cpdata.sources import open_dataset

    long_tokens = 500_000 if quick else 5_000_000
    kw = dict(capacity=CAPACITY, cp_size=CP, layout=LAYOUT, plan=StreamPlan(overflow="split"))
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "long.jsonl"
        _write_corpus(data, long_tokens)
        docs = open_dataset(data)
        start = time.perf_counter()
        store = precompute(docs, Path(tmp) / "plan", **kw)
        precompute_s = time.perf_counter() - start
        long_index = int(np.argmax(docs.lengths))
        pieces = int((store.arrays["doc_index"] == long_index).sum())
        online, offline = [], []
        for _ in range(REPEATS):  # alternated, best of each: both see the same caches and load
            online.append(_epoch(ShardForRank(split_graph(docs, CAPACITY, CP, LAYOUT), cp_size=CP, cp_rank=0,
                                              layout=LAYOUT)))
            plans = PrecomputedPacks(Path(tmp) / "plan", docs, cp_size=CP, layout=LAYOUT)
            offline.append(_epoch(ShardForRank(Collate(plans), cp_size=CP, cp_rank=0, layout=LAYOUT)))
        (online_s, packs), (offline_s, offline_packs) = min(online), min(offline)
    assert offline_packs == packs, (offline_packs, packs)
    return [{
        "doc_tokens": long_tokens, "pieces": pieces, "online_s": round(online_s, 3),
        "offline_s": round(offline_s, 3), "ratio": round(offline_s / online_s, 3),
        "precompute_s": round(precompute_s, 3), "packs": packs,
    }]  # fmt: skip
