"""Section ``worker``: pack + collate + shard throughput of one worker core vs memcpy.

The worker pipeline of one CP rank (``Documents -> Pack -> Collate ->
ShardForRank``, default packer, SFT-like documents with random token ids made
beforehand) runs over a fixed stream on one thread. ``tokens_per_s`` counts
the tokens of the *full* packs per second, while only rank 0's output is
built. The baseline moves the same output bytes with ``np.copyto``, pack by
pack, from a fresh source buffer into a fresh destination (as large as the
whole run's output, so it streams through memory like the worker's output
does), in the same run: ``memcpy_tokens_per_s`` is full-pack tokens per second
at that speed and ``fraction_of_memcpy`` the ratio. Output bytes are the
rank's batch tensors (token tensors + stream metadata); the layout maps
(``layout_bytes_per_token``, extra) are left out of the baseline, which makes
it faster and the target harder.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cpdata.bench.distributions import sample
from cpdata.bench.timing import median_seconds

__all__ = ["COLUMNS", "TABLE", "run"]

COLUMNS: tuple[str, ...] = (
    "layout", "cp_size", "capacity", "tokens_per_s", "memcpy_tokens_per_s", "fraction_of_memcpy",
)
TABLE: tuple[str, ...] = (*COLUMNS, "packs", "output_bytes_per_token", "layout_bytes_per_token")
TITLE = "Documents -> Pack -> Collate -> ShardForRank on one core vs np.copyto of the same output bytes"
LAYOUTS: tuple[str, ...] = ("contiguous", "round_robin", "thd", "balanced")
VOCAB = 32000


def _documents(tokens: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = sample("sft", int(tokens / 670) + 16, seed)
    return [{"input_ids": rng.integers(0, VOCAB, size=int(n), dtype=np.int64)} for n in lengths]


def _pipeline(docs, capacity: int, cp_size: int, layout: str):
    from cpdata.loader import shard_graph
    from cpdata.nodes.shard import ShardForRank

    collate = shard_graph(docs, capacity=capacity, cp_size=cp_size, layout=layout, overflow="split")
    return ShardForRank(collate, cp_size=cp_size, cp_rank=0, layout=layout)


def _run_pipeline(docs, capacity: int, cp_size: int, layout: str) -> tuple[float, list[int], int, int]:
    """Seconds for the whole stream, output bytes per pack, full-pack tokens, layout bytes."""
    node = _pipeline(docs, capacity, cp_size, layout)
    out_bytes, tokens, layout_bytes = [], 0, 0
    t0 = time.perf_counter()
    node.reset()
    for batch in node:
        out_bytes.append(sum(t.numel() * t.element_size() for t in batch.values()))
        tokens += int(batch.info["pack_tokens"])
        lay = batch.layout
        layout_bytes += sum(t.numel() * t.element_size() for t in (lay.local_token_global_indices, lay.gather_index))
    return time.perf_counter() - t0, out_bytes, tokens, layout_bytes


def _memcpy_seconds(out_bytes: list[int], repeats: int) -> float:
    offsets = np.concatenate([[0], np.cumsum(out_bytes)])
    src = np.ones(int(offsets[-1]), dtype=np.uint8)
    dst = np.zeros_like(src)  # touched: page faults stay out of the timing
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))

    def copy_all() -> None:
        for lo, hi in bounds:
            np.copyto(dst[lo:hi], src[lo:hi])

    return median_seconds(copy_all, repeats=repeats, warmup=1)


def _one(capacity: int, cp_size: int, layout: str, packs: int, repeats: int) -> dict:
    docs = _documents(capacity * packs, seed=capacity + cp_size)
    _run_pipeline(docs[: max(8, len(docs) // 8)], capacity, cp_size, layout)  # warm caches and imports
    runs = [_run_pipeline(docs, capacity, cp_size, layout) for _ in range(repeats)]
    seconds = float(np.median([r[0] for r in runs]))
    _, out_bytes, tokens, layout_bytes = runs[0]
    copy_s = _memcpy_seconds(out_bytes, repeats=max(3, repeats))
    return {
        "layout": layout, "cp_size": cp_size, "capacity": capacity,
        "tokens_per_s": tokens / seconds, "memcpy_tokens_per_s": tokens / copy_s,
        "fraction_of_memcpy": copy_s / seconds, "packs": len(out_bytes),
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
