"""Faults under load: a killed worker, a failing source. Raise promptly, resume without loss or duplicates.

The corpus is deterministic per index and carries each token's provenance
(``src`` = source index, an extra per-token array), so a batch decodes back
into ``(document index, start, length)`` pieces without trusting the packer's
own bookkeeping.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import Counter

import numpy as np
import psutil
import pytest
from torch.utils.data import get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata.nodes.dataset import CPDataset
from cpdata.nodes.loader import build_loader, build_node, close_loader, shard_graph
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import graph_options, records

pytestmark = [pytest.mark.filterwarnings("ignore:.set_vital. is deprecated"), pytest.mark.timeout(120)]

CFG = dict(capacity=64, cp_size=1, layout="identity", qkv_format="thd", batch_size=2, window=8, overflow="split")
N_DOCS = 400
WORKER_DEATH = r"DataLoader worker \(pid(\(s\))? \d+\) (is killed by signal|exited unexpectedly)"


def doc_length(i: int) -> int:
    """0 for every 13th document, longer than the capacity for every 17th, else 1..40."""
    if i % 13 == 0:
        return 0
    if i % 17 == 0:
        return 64 + 5 * (i % 7)
    return 1 + (i * 7919) % 40


def doc_tokens(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 500, doc_length(i))


class Corpus:
    """A map-style source (``len`` + ``getitem``) with optional faults.

    ``stall_at``: inside a DataLoader worker, reading that document marks the
    worker as stalled in ``stalled[worker_id]`` and waits until ``release`` is
    set (shared memory inherited through fork), as a worker waits on slow
    storage. It polls rather than waiting on a multiprocessing
    Event: ``Event.set()`` waits for every sleeper to wake, and a killed one
    never does. ``fail_at``: reading that document raises OSError.
    """

    def __init__(self, n: int = N_DOCS, *, stall_at: int | None = None, release=None, stalled=None,
                 fail_at: int | None = None) -> None:  # fmt: skip
        self.n, self.stall_at, self.release, self.stalled, self.fail_at = n, stall_at, release, stalled, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i == self.stall_at and get_worker_info() is not None:
            self.stalled[get_worker_info().id] = 1
            deadline = time.monotonic() + 60
            while not self.release.value and time.monotonic() < deadline:
                time.sleep(0.01)
        if i == self.fail_at:
            raise OSError(f"checksum mismatch in shard block {i}")
        ids = doc_tokens(i)
        return {"input_ids": ids, "src": np.full(ids.size, i, dtype=np.int64)}


class IterableCorpus:
    """The same documents as a re-iterable (no ``len``): a streaming source."""

    def __init__(self, n: int = N_DOCS, *, fail_at: int | None = None):
        self.corpus = Corpus(n, fail_at=fail_at)

    def __iter__(self):
        return (self.corpus[i] for i in range(self.corpus.n))


Piece = tuple[int, int, int]


def pieces(batch) -> list[Piece]:
    """``(document index, start, length)`` of every slot of a cp=1 batch, checked against the corpus."""
    ids, src, pos = (batch[k].reshape(-1).numpy() for k in ("input_ids", "src", "position_ids"))
    pad = batch["padding_mask"].reshape(-1).numpy()
    out = []
    for start, n in zip(batch["cu_seqlens_padded"][:-1].tolist(), batch["seq_lens"].tolist(), strict=True):
        if n == 0:
            continue
        doc, first = int(src[start]), int(pos[start])
        assert (src[start : start + n] == doc).all() and not pad[start : start + n].any()
        assert np.array_equal(ids[start : start + n], doc_tokens(doc)[first : first + n])
        out.append((doc, first, n))
    assert int((~pad).sum()) == sum(p[2] for p in out) == batch.info["real_tokens"]
    return out


def every_token_once(batches: list[list[Piece]], n_docs: int = N_DOCS) -> None:
    """The pieces cover each document's tokens exactly once (overflow='split': nothing truncated or dropped)."""
    covered = Counter((doc, t) for batch in batches for doc, start, n in batch for t in range(start, start + n))
    assert max(covered.values()) == 1, "a token was delivered twice"
    want = {(doc, t) for doc in range(n_docs) for t in range(doc_length(doc))}
    assert set(covered) == want, f"{len(want - set(covered))} tokens lost"


def reference() -> list[list[Piece]]:
    return [pieces(b) for b in build_node(Corpus(), **records(cp_rank=0, prefetch=0, pin_memory=False, **CFG))]


def batches_before_reading(index: int) -> int:
    """How many batches an uninterrupted run (no prefetch, one batch per block) delivers before it first reads
    document ``index``."""
    read: list[int] = []

    class Recording(Corpus):
        def __getitem__(self, i):
            read.append(i)
            return super().__getitem__(i)

    opts = {k: v for k, v in CFG.items() if k not in ("cp_size", "layout")}
    node = ShardForRank(shard_graph(Recording(), graph_options(cp_size=CFG["cp_size"], layout=CFG["layout"], **opts)),
                        cp_size=CFG["cp_size"], cp_rank=0, layout=CFG["layout"], block_size=1)  # fmt: skip
    for k, _ in enumerate(node):
        if index in read:
            return k
    raise AssertionError(f"document {index} is never read")


def loader(source, **kw) -> StatefulDataLoader:
    # blocks of 16 batches: the default block of such short packs would need more documents than the
    # workers read before the source stalls, so no batch would come before the kill
    return StatefulDataLoader(CPDataset(source, **records(cp_rank=0, block_size=16, **CFG)), batch_size=None, num_workers=2,
                              multiprocessing_context="fork", snapshot_every_n_steps=1, **kw)  # fmt: skip


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def wait_for_no_children(before: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children() - before, f"worker processes left behind: {children() - before}"


def forget(err: BaseException) -> None:
    """Free what the traceback holds now (a DataLoader iterator left to the cyclic GC joins each worker for 5 s)."""
    traceback.clear_frames(err.__traceback__)


def test_the_corpus_exercises_empty_and_overlong_documents():
    ref = reference()
    assert len(ref) >= 40
    assert any(doc_length(i) == 0 for i in range(N_DOCS)) and any(doc_length(i) > 64 for i in range(N_DOCS))
    assert any(start > 0 for batch in ref for _, start, _ in batch), "some document was split across packs"
    every_token_once(ref)


def test_killed_worker_raises_promptly_and_resume_delivers_exactly_the_rest():
    ref = reference()
    before = children()
    ctx = mp.get_context("fork")
    release, stalled = ctx.RawValue("b", 0), ctx.RawArray("b", 2)
    stall_at = 220  # both workers block there, mid-epoch, with batches before it delivered
    dl = loader(Corpus(stall_at=stall_at, release=release, stalled=stalled))
    it = iter(dl)
    workers = sorted(children() - before)
    assert len(workers) == 2
    victim = workers[0]
    head: list[list[Piece]] = []
    state = dl.state_dict()
    last_progress = [time.monotonic()]
    killed_at: list[float] = []

    def kill_when_stalled() -> None:
        # Kill only once both workers wait in the source and the main process has drained what they made,
        # so no batch of the victim is in flight (its shared-memory handles would die with it).
        while not all(stalled) or time.monotonic() - last_progress[0] < 0.5:
            time.sleep(0.02)
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_stalled, daemon=True)
    killer.start()
    with pytest.raises(RuntimeError, match=WORKER_DEATH) as info:
        for batch in it:
            head.append(pieces(batch))
            state = dl.state_dict()  # the checkpoint a training loop saves after every step
            last_progress[0] = time.monotonic()
    raised_after = time.monotonic() - killed_at[0]
    print(f"[faults] worker {victim} killed after {len(head)} batches; the loader raised {raised_after:.3f}s later")
    assert raised_after < 6, f"the loader took {raised_after:.1f}s to notice the dead worker"  # docs/bad-input.md: < 6 s
    assert str(victim) in str(info.value)
    release.value = 1
    forget(info.value)
    killer.join(5)
    del it, dl, info
    gc.collect()
    wait_for_no_children(before)

    assert 5 <= len(head) < len(ref) - 5, "the kill must land mid-epoch"
    assert head == ref[: len(head)]
    resumed = loader(Corpus())
    resumed.load_state_dict(state)
    rest = [pieces(b) for b in resumed]
    del resumed
    expected = ref[len(head) :]
    assert Counter(p for b in rest for p in b) == Counter(p for b in expected for p in b), "lost or duplicated"
    assert [sum(n for *_, n in b) for b in rest] == [sum(n for *_, n in b) for b in expected]
    assert rest == expected, "the resumed run delivers the uninterrupted run's packs in order"
    every_token_once(head + rest)
    wait_for_no_children(before)


FAIL_AT = 237


@pytest.mark.parametrize("kind", ["sequence", "iterable"])
def test_source_error_mid_stream_propagates_with_the_document_index_through_build_loader(kind):
    source = Corpus(fail_at=FAIL_AT) if kind == "sequence" else IterableCorpus(fail_at=FAIL_AT)
    ref = reference()
    threads = threading.active_count()
    got = []
    ld = build_loader(source, **records(cp_rank=0, prefetch=2, **CFG))
    start = time.monotonic()
    with pytest.raises(OSError) as info:
        for batch in ld:
            got.append(pieces(batch))
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert f"reading document {FAIL_AT} from the source failed" in message
    assert f"checksum mismatch in shard block {FAIL_AT}" in message
    n_before = batches_before_reading(FAIL_AT)
    assert n_before >= 5 and got == ref[:n_before], "exactly the batches before the failure arrive, intact"
    forget(info.value)
    close_loader(ld)
    assert threading.active_count() == threads, "the prefetch thread stopped"


@pytest.mark.parametrize("fault", ["source_raises", "invalid_document"])
def test_source_error_mid_stream_propagates_with_the_document_index_through_workers(fault):
    before = children()
    if fault == "source_raises":
        source, exc = Corpus(fail_at=FAIL_AT), OSError
        parts = [f"reading document {FAIL_AT} from the source failed", "checksum mismatch"]
    else:

        class Invalid(Corpus):
            def __getitem__(self, i):
                item = super().__getitem__(i)
                return {"input_ids": item["input_ids"].astype(np.float32)} if i == FAIL_AT else item

        source, exc = Invalid(), TypeError
        parts = [f"document {FAIL_AT}: 'input_ids' must hold integers", "float32"]
    ref = reference()
    dl = loader(source)
    got = []
    start = time.monotonic()
    with pytest.raises(exc) as info:
        for batch in dl:
            got.append(pieces(batch))
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "DataLoader worker process" in message and all(p in message for p in parts), message
    n_before = batches_before_reading(FAIL_AT)
    assert n_before >= 5 and got == ref[:n_before], "exactly the batches before the failure arrive, intact"
    forget(info.value)
    del dl, info
    gc.collect()
    wait_for_no_children(before)
