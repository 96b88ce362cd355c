"""Section ``worker``: pack + collate + shard on one worker core, against the in-step anchor and memcpy.

One CP rank's pipeline (``Documents -> Pack -> Collate -> ShardForRank``, SFT-like documents) on one thread in
its steady state (one untimed pass, then a ``reset()`` and a pass per repeat); output bytes come from the
batch's buffer plan, since host views are built by the consumer. ``tokens_per_s`` counts full-pack tokens;
``cpdata_us_per_pack`` / ``ns_per_pack_token`` are the same time per pack and per pack token. The anchor
(``anchor_host_us``): :func:`~cpdata.bench.anchors.anchor_collate` +
:func:`~cpdata.bench.anchors.anchor_shard` of the same packs (``balanced`` against ``round_robin``), no
packing. ``ratio``: the median of round-by-round ratios (load moves both sides together).
``fraction_of_memcpy``: ``np.copyto`` of the same output bytes over cpdata's time.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cpdata.bench.anchors import ANCHOR_LAYOUTS, anchor_collate, anchor_shard
from cpdata.bench.distributions import sample, split_graph, token_documents
from cpdata.bench.timing import alternating_medians, paired_ratio

__all__ = ["COLUMNS", "TABLE", "run", "worker_ratio"]

COLUMNS: tuple[str, ...] = (
    "layout", "cp_size", "capacity", "cpdata_us_per_pack", "anchor_host_us", "ratio", "ns_per_pack_token",
    "tokens_per_s", "memcpy_tokens_per_s", "fraction_of_memcpy",
)
TABLE: tuple[str, ...] = (*COLUMNS, "packs", "output_bytes_per_token", "layout_bytes_per_token")
TITLE = "Documents -> Pack -> Collate -> ShardForRank on one core vs in-step collate + shard, and memcpy"
LAYOUTS: tuple[str, ...] = ("contiguous", "round_robin", "thd", "balanced")


def worker_ratio(row: dict) -> float:
    """cpdata / anchor per pack of a row: its paired ``ratio``, or the ratio of its medians for results
    written before that column existed."""
    return row["ratio"] if "ratio" in row else row["cpdata_us_per_pack"] / row["anchor_host_us"]


def _run_pipeline(node) -> tuple[float, list[int], int, int]:
    """Seconds for one pass of ``node`` over its stream (from ``reset()``), output bytes per pack,
    full-pack tokens, layout bytes."""
    out_bytes, tokens, layout_bytes = [], 0, 0
    t0 = time.perf_counter()
    node.reset()
    for batch in node:  # byte counts from the batch's buffer plan: reading the tensors would build host views
        out_bytes.append(batch.nbytes())
        tokens += int(batch.info["pack_tokens"])
        layout_bytes += batch._map_nbytes()
    return time.perf_counter() - t0, out_bytes, tokens, layout_bytes


def _anchor(plans: list, capacity: int, cp_size: int, layout: str):
    """``run()`` of the in-step anchor over ``plans`` (checked against cpdata's full pack first)."""
    from cpdata.layout.maps import alignment
    from cpdata.worker.collate import collate_pack

    anchor_layout = layout if layout in ANCHOR_LAYOUTS else "round_robin"
    doc_multiple = alignment(layout, cp_size)[0]
    device = torch.device("cpu")
    documents = [[p.arrays["input_ids"] for p in plan.pieces] for plan in plans]
    first = anchor_collate(documents[0], capacity=capacity, doc_multiple=doc_multiple)
    want = collate_pack(plans[:1])["input_ids"]
    assert np.array_equal(first["input_ids"].numpy(), want), "anchor and cpdata disagree on the pack's input_ids"

    def run() -> None:
        for docs in documents:
            full = anchor_collate(docs, capacity=capacity, doc_multiple=doc_multiple)
            anchor_shard(full, layout=anchor_layout, cp_size=cp_size, cp_rank=0, device=device)

    return run


def _memcpy_seconds(out_bytes: list[int], repeats: int) -> float:
    offsets = np.concatenate([[0], np.cumsum(out_bytes)])
    src = np.ones(int(offsets[-1]), dtype=np.uint8)
    dst = np.zeros_like(src)  # touched: page faults stay out of the timing
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))

    def copy_all() -> None:
        for lo, hi in bounds:
            np.copyto(dst[lo:hi], src[lo:hi])

    return alternating_medians((copy_all,), repeats=repeats, warmup=1)[0]


def _one(capacity: int, cp_size: int, layout: str, packs: int, repeats: int) -> dict:
    from cpdata.nodes.shard import ShardForRank

    seed = capacity + cp_size
    docs = token_documents(sample("sft", int(capacity * packs / 670) + 16, seed), seed)
    graph = split_graph(docs, capacity, cp_size, layout)
    node = ShardForRank(graph, cp_size=cp_size, cp_rank=0, layout=layout)
    _run_pipeline(node)  # one untimed pass: imports, caches and the reading nodes' buffer pools warm
    fresh = split_graph(docs, capacity, cp_size, layout)  # the same packs again, for the anchor
    anchor = _anchor([plan for batch in fresh for plan in batch.plans], capacity, cp_size, layout)
    anchor()
    runs, anchor_s = [], []
    for _ in range(repeats):  # alternate, so both sides see the same machine load
        runs.append(_run_pipeline(node))
        t0 = time.perf_counter()
        anchor()
        anchor_s.append(time.perf_counter() - t0)
    seconds = float(np.median([r[0] for r in runs]))
    ratio = paired_ratio([r[0] for r in runs], anchor_s)
    _, out_bytes, tokens, layout_bytes = runs[0]
    n_packs = len(out_bytes)
    copy_s = _memcpy_seconds(out_bytes, repeats=max(3, repeats))
    return {
        "layout": layout, "cp_size": cp_size, "capacity": capacity,
        "cpdata_us_per_pack": seconds / n_packs * 1e6, "anchor_host_us": float(np.median(anchor_s)) / n_packs * 1e6,
        "ratio": ratio,
        "ns_per_pack_token": seconds / tokens * 1e9,
        "tokens_per_s": tokens / seconds, "memcpy_tokens_per_s": tokens / copy_s,
        "fraction_of_memcpy": copy_s / seconds, "packs": n_packs,
        "output_bytes_per_token": sum(out_bytes) / tokens, "layout_bytes_per_token": layout_bytes / tokens,
    }


def run(*, quick: bool) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if quick:
            plan = [(32768, cp, layout) for layout in ("thd", "balanced") for cp in (2, 4, 8)]
            return [_one(c, cp, layout, packs=16, repeats=3) for c, cp, layout in plan]
        plan = [(c, cp, layout) for layout in LAYOUTS for cp in (2, 4, 8) for c in (8192, 32768, 131072)]
        return [_one(c, cp, layout, packs=max(16, (4 << 20) // c), repeats=5) for c, cp, layout in plan]
    finally:
        torch.set_num_threads(threads)
