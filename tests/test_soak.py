"""Soak (``-m slow``): 10,000 packs through StatefulDataLoader with 2 workers; memory flat, nothing left behind.

Run: ``.venv/bin/python -m pytest tests/test_soak.py -m slow -q -s`` (prints the numbers).

- resident memory of the process tree (parent + workers, psutil RSS) grows
  less than 5% between the end of the warm-up (1,000 packs) and the last pack;
- every pack arrives once, in order (pack indices 0..N-1, real tokens summed
  against the corpus);
- once the loader is deleted no worker process and no thread is left; the
  same holds for an in-process ``build_loader`` abandoned mid-epoch and
  closed with :func:`cpdata.nodes.loader.close_loader` (torchdata 0.11's ``Loader``
  and its iterator form a reference cycle that would otherwise keep the
  prefetch thread alive until cyclic GC), and for a StatefulDataLoader
  abandoned mid-epoch.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import psutil
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import build_loader, close_loader
from tests.flat_options import records

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.set_vital. is deprecated"),
              pytest.mark.timeout(900)]  # fmt: skip

CFG = dict(capacity=256, cp_size=2, layout="thd", qkv_format="thd", batch_size=2, overflow="split")
PACKS = 10_000
WARMUP = 1_000


class Corpus:
    """``n`` documents generated from their index (nothing held in memory): lengths 0..300, some over capacity."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def length(i: int) -> int:
        return 0 if i % 97 == 0 else 1 + (i * 2654435761) % (300 if i % 11 == 0 else 110)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"input_ids": np.random.default_rng(i).integers(0, 32000, self.length(i))}


def corpus_for(packs: int) -> Corpus:
    """A corpus of about ``packs`` full packs (measured by the mean slot length, with 2% slack)."""
    mean = np.mean([Corpus.length(i) for i in range(10_000)])
    return Corpus(int(packs * CFG["capacity"] / mean * 0.995))


def tree_rss() -> int:
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def settle(before_children: set[int], before_threads: int, timeout: float = 15.0) -> tuple[set[int], int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (children() - before_children or threading.active_count() > before_threads):
        gc.collect()
        time.sleep(0.1)
    return children() - before_children, threading.active_count()


def report(line: str) -> None:
    print(f"\n[soak] {line}", flush=True)


def test_soak_10000_packs_through_stateful_dataloader_with_2_workers():
    gc.collect()
    threads0, children0 = threading.active_count(), children()
    corpus = corpus_for(PACKS)
    dl = StatefulDataLoader(CPDataset(corpus, **records(cp_rank=0, **CFG)), batch_size=None, num_workers=2,
                            multiprocessing_context="fork", snapshot_every_n_steps=1)  # fmt: skip
    start = time.monotonic()
    packs, real, samples, warm, peak_threads = 0, 0, [], None, 0
    expected_index = 0
    for batch in dl:
        index = batch.info["pack_indices"]
        assert index == list(range(expected_index, expected_index + len(index))), "a pack lost or repeated"
        expected_index += len(index)
        packs += len(index)
        real += batch.info["real_tokens"]
        if warm is None and packs >= WARMUP:
            gc.collect()
            warm = tree_rss()
            peak_threads = threading.active_count()
        if warm is not None and packs % 500 < len(index):
            samples.append(tree_rss())
        if packs >= PACKS:
            gc.collect()
            samples.append(tree_rss())
            final = samples[-1]
            break
    else:
        pytest.fail(f"the corpus ran out after {packs} packs; enlarge it")
    elapsed = time.monotonic() - start
    snapshot_children = len(children() - children0)
    growth = (final - warm) / warm
    del batch
    dl.dataset.close()
    del dl
    left_children, threads_after = settle(children0, threads0)
    report(f"{packs} packs ({real} real tokens) in {elapsed:.1f}s = {packs / elapsed:.0f} packs/s; "
           f"workers: {snapshot_children}")
    report(f"tree RSS after warm-up ({WARMUP} packs) {warm / 2**20:.1f} MiB, at {packs} packs {final / 2**20:.1f} "
           f"MiB, growth {100 * growth:+.2f}%, max {max(samples) / 2**20:.1f} MiB over {len(samples)} samples")
    report(f"threads: before {threads0}, while running {peak_threads}, after delete {threads_after}; "
           f"worker processes left: {sorted(left_children)}")
    assert snapshot_children == 2
    assert growth < 0.05, f"resident memory grew {100 * growth:.2f}% after warm-up"
    assert not left_children and threads_after == threads0


def test_abandoned_loaders_leave_no_threads_or_processes():
    gc.collect()
    threads0, children0 = threading.active_count(), children()
    corpus = corpus_for(2_000)

    # In-process Loader with a prefetch thread, abandoned mid-epoch.
    loader = build_loader(corpus, **records(cp_rank=1, prefetch=4, **CFG))
    it = iter(loader)
    for _ in range(300):
        next(it)
    running = threading.active_count()
    close_loader(loader)
    del it, loader
    after_close = threading.active_count()

    # StatefulDataLoader with workers, abandoned mid-epoch.
    dl = StatefulDataLoader(CPDataset(corpus, **records(cp_rank=0, **CFG)), batch_size=None, num_workers=2,
                            multiprocessing_context="fork")  # fmt: skip
    it = iter(dl)
    for _ in range(300):
        next(it)
    workers = len(children() - children0)
    del it, dl
    left_children, threads_after = settle(children0, threads0)
    report(f"abandoned build_loader: threads {threads0} -> {running} running -> {after_close} after close_loader")
    report(f"abandoned StatefulDataLoader: {workers} workers -> left {sorted(left_children)}, "
           f"threads after {threads_after}")
    assert running > threads0 and after_close == threads0
    assert workers == 2 and not left_children and threads_after == threads0
