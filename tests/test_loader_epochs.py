"""``CPDataLoader`` counts its own epochs: the same shuffled orders for every worker count, persistent or not,
without ``set_epoch``, and an exact resume of the count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpdata import CPDataLoader, CPDataset
from tests.flat_options import records

RNG = np.random.default_rng(11)
DOCS = [{"input_ids": RNG.integers(1, 500, int(n))} for n in RNG.integers(4, 40, 48)]
LENGTHS = [len(d["input_ids"]) for d in DOCS]
KINDS = {
    "live": dict(capacity=64, cp_size=2, layout="thd", shuffle=True, seed=5),
    "balanced": dict(capacity=64, cp_size=2, layout="thd", shuffle=True, seed=5, schedule="balanced",
                     lengths=LENGTHS),  # fmt: skip
}


def _epoch(loader) -> list[tuple]:
    """One epoch: per batch its documents and offsets (host) and its tokens."""
    return [(tuple(b.info["doc_index"]), tuple(b.info["doc_start"]), b["input_ids"].clone()) for b in loader]


def _same(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(x[:2] == y[:2] and torch.equal(x[2], y[2]) for x, y in zip(a, b, strict=True))


def _loader(kind: str, workers: int, persistent: bool = False, **kw) -> CPDataLoader:
    extra = dict(multiprocessing_context="fork", persistent_workers=persistent) if workers else {}
    return CPDataLoader(CPDataset(DOCS, **records(cp_rank=0, **KINDS[kind])), num_workers=workers, **extra, **kw)


@pytest.fixture(scope="module", params=list(KINDS))
def reference(request) -> tuple[str, list[list[tuple]]]:
    loader = _loader(request.param, 0)
    epochs = [_epoch(loader) for _ in range(3)]
    assert not _same(epochs[0], epochs[1]) and not _same(epochs[1], epochs[2]), "shuffled epochs differ"
    return request.param, epochs


@pytest.mark.parametrize("workers,persistent", [(2, False), (2, True), (1, False)])
def test_epochs_advance_alike_for_every_worker_count_without_set_epoch(reference, workers, persistent):
    kind, want = reference
    loader = _loader(kind, workers, persistent)
    got = [_epoch(loader) for _ in range(3)]
    for e in range(3):
        assert _same(got[e], want[e]), f"epoch {e} with num_workers={workers} is not the num_workers=0 epoch {e}"


def test_a_resume_mid_epoch_1_continues_the_epoch_and_the_count(reference):
    kind, want = reference
    loader = _loader(kind, 2, snapshot_every_n_steps=1)
    assert _same(_epoch(loader), want[0])
    it, head = iter(loader), []
    for _ in range(3):
        b = next(it)
        head.append((tuple(b.info["doc_index"]), tuple(b.info["doc_start"]), b["input_ids"].clone()))
    state = loader.state_dict()
    assert state[CPDataLoader.EPOCH_KEY] == 1
    del it
    fresh = _loader(kind, 2, snapshot_every_n_steps=1)
    fresh.load_state_dict(state)
    assert _same(head + _epoch(fresh), want[1]), "the rest of epoch 1 after the resume"
    assert _same(_epoch(fresh), want[2]), "the epoch after a resumed one is the next"


def test_set_epoch_still_chooses_and_persistent_workers_refuse_what_they_cannot_see(reference):
    kind, want = reference
    loader = _loader(kind, 2)
    loader.dataset.set_epoch(1)
    assert _same(_epoch(loader), want[1]), "set_epoch(1) starts epoch 1"
    assert _same(_epoch(loader), want[2]), "and the count goes on from it"
    persistent = _loader(kind, 2, persistent=True)
    assert _same(_epoch(persistent), want[0])
    persistent.dataset.set_epoch(0)
    with pytest.raises(ValueError, match="cannot reach persistent workers"):
        iter(persistent)
