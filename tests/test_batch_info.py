"""``ShardedBatch.info``: host-side Python ints the model side reads instead of ``.item()`` on the device."""

from __future__ import annotations

import pickle

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import CPDataset, build_loader, closing_loader
from tests.flat_options import records

LENS = [7, 30, 3, 12, 45, 1, 9, 20, 16, 5, 33, 2]
CFG = dict(capacity=48, cp_size=2, layout="thd", qkv_format="thd", overflow="split")


def _docs() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 50, (n,), generator=g).tolist()} for n in LENS]


def _check(batch) -> None:
    info = batch.info
    assert info["layout"] == "thd"
    for key in ("max_seqlen", "max_seqlen_padded"):
        assert type(info[key]) is int, key
    assert info["max_seqlen"] == int(batch["max_seqlen"]) == int(batch["seq_lens"].max())
    assert info["max_seqlen_padded"] == int(batch["seq_lens_padded"].max())
    assert info["max_seqlen"] <= info["max_seqlen_padded"]


def test_info_carries_the_lengths_as_python_ints_through_copies():
    with closing_loader(build_loader(_docs(), **records(cp_rank=1, prefetch=0, **CFG))) as loader:
        batches = list(loader)
    assert len(batches) > 2
    for batch in batches:
        _check(batch)
        for copy in (pickle.loads(pickle.dumps(batch)), batch.to("cpu", copy=True), batch.to("meta")):
            assert copy.info == batch.info
    assert batches[-1].to("meta")["input_ids"].is_meta  # info needs no read of the tensors


def test_info_survives_stateful_dataloader_workers():
    ds = CPDataset(_docs(), **records(cp_rank=0, **CFG))
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    batches = list(loader)
    assert len(batches) > 2
    for batch in batches:
        _check(batch)
