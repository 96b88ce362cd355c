"""Side by side with the installed NeMo Automodel 0.7.0 release (its ``ContextParallelSharder``, torch only).

What is compared, each on the same batch:

- the TE THD path at cp = 1 emits ``_thd_local_indices`` (NeMo's packed-VLM models pop it): same keys, same
  values, every tensor equal;
- ``extra_seq_buffers={"teacher_logits": 1}`` with no such key: NeMo's round-robin path raises ``KeyError``
  at ``shard()``, and so does cpdata's (same message), on the round-robin and the THD path;
- a model whose ``backend.attn`` is ``"magi"``: NeMo resolves MagiAttention's own ``shard_batch``; cpdata,
  without ``magi_attention`` installed, refuses naming MagiAttention (never a round-robin), and with it hands
  the batch to that same NeMo function.

Paths NeMo runs only with Transformer Engine or MagiAttention installed (TE's THD partition at cp > 1, magi's
dispatch) are not run here: no GPU stack on this machine. cpdata's cp > 1 THD values are checked against
TE's documented partition in tests/test_nemo_parity.py.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from test_sharder import FakeMesh

from cpdata.nemo.sharder import ContextParallelSharder

nemo_utils = pytest.importorskip("nemo_automodel.components.distributed.context_parallel.utils")
nemo_sharder = pytest.importorskip("nemo_automodel.components.distributed.context_parallel.sharder")
NemoSharder = nemo_sharder.ContextParallelSharder

TE = SimpleNamespace(backend=SimpleNamespace(attn="te"))
SDPA = SimpleNamespace(backend=SimpleNamespace(attn="sdpa"))
MAGI = SimpleNamespace(backend=SimpleNamespace(attn="magi"))


def test_the_installed_release_is_0_7_0():
    from importlib.metadata import version

    assert version("nemo-automodel") == "0.7.0"


def thd_batch() -> dict:
    ids = torch.arange(1, 13).view(2, 6)
    return {
        "input_ids": ids,
        "labels": ids + 100,
        "position_ids": torch.arange(6).repeat(2, 1),
        "seq_lens": torch.tensor([[3, 2], [2, 3]]),
        "seq_lens_padded": torch.tensor([[4, 2], [3, 3]]),
        "qkv_format": "thd",
    }


def bshd_batch(**extra) -> dict:
    ids = torch.arange(1, 17).view(2, 8)
    return {"input_ids": ids, "labels": ids + 100, **extra}


def test_thd_cp1_batch_has_nemos_thd_local_indices_and_every_key_equal():
    nemo = NemoSharder(TE, None, thd_batch())
    _, want = nemo.shard(thd_batch())
    ours = ContextParallelSharder(TE, None, thd_batch())
    _, got = ours.shard(thd_batch())
    assert "_thd_local_indices" in want, "the release adds the key at cp = 1"
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert torch.equal(got["_thd_local_indices"], ours.shard_layout.local_token_global_indices)


def test_a_missing_extra_seq_buffer_raises_keyerror_like_nemo():
    kw = dict(extra_seq_buffers={"teacher_logits": 1})
    nemo = NemoSharder(SDPA, FakeMesh(2, 0), bshd_batch(), **kw)
    with pytest.raises(KeyError, match="teacher_logits") as want:
        nemo.shard(bshd_batch())
    ours = ContextParallelSharder(SDPA, FakeMesh(2, 0), bshd_batch(), **kw)
    with pytest.raises(KeyError) as got:
        ours.shard(bshd_batch())
    assert str(got.value) == str(want.value)
    # the THD path (NeMo refuses extra buffers there outright; cpdata shards them, so it checks them too)
    with pytest.raises(KeyError, match="Extra CP sequence buffer 'teacher_logits' is missing from the batch"):
        ContextParallelSharder(TE, FakeMesh(2, 0), thd_batch(), **kw).shard(thd_batch())
    # given, it is sharded with the batch on both
    logits = torch.randn(2, 8, 3)
    _, out = ContextParallelSharder(SDPA, FakeMesh(2, 1), bshd_batch(), **kw).shard(bshd_batch(teacher_logits=logits))
    assert out["teacher_logits"].shape == (2, 4, 3)


def test_a_magi_model_is_handed_to_magiattention_or_refused_never_round_robined(monkeypatch):
    nemo = NemoSharder(MAGI, FakeMesh(2, 0), bshd_batch())
    assert nemo.shard_batch.__qualname__.endswith("_shard_batch_magi"), "the release hands magi models to magi"
    if importlib.util.find_spec("magi_attention") is None:
        with pytest.raises(ValueError, match="MagiAttention") as err:
            ContextParallelSharder(MAGI, FakeMesh(2, 0), bshd_batch())
        assert "magi_attention" in str(err.value) and "round-robin" in str(err.value)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "magi_attention" else real(name, *a))  # fmt: skip
    ours = ContextParallelSharder(MAGI, FakeMesh(2, 0), bshd_batch())
    handed = ours.shard_batch.shard_batch  # cpdata reads the layout NeMo's function returns into its own record
    assert handed.__qualname__ == nemo.shard_batch.__qualname__
    assert handed.__module__ == "nemo_automodel.components.distributed.context_parallel.utils"
    config_magi = SimpleNamespace(config=SimpleNamespace(_attn_implementation="magi"))  # HF's attn_implementation
    assert ContextParallelSharder(config_magi, FakeMesh(2, 0), bshd_batch()).shard_batch.shard_batch.__qualname__ == (
        nemo.shard_batch.__qualname__)


def test_a_worker_sharded_batch_for_a_magi_model_is_refused():
    from cpdata.layout.shard_layout import ShardLayout
    from cpdata.worker.batch import ShardedBatch

    batch = ShardedBatch({"input_ids": torch.arange(4).view(1, 4)}, layout=ShardLayout(cp_size=2), info={})
    with pytest.raises(ValueError, match="MagiAttention.*already sharded by cpdata"):
        ContextParallelSharder(MAGI, FakeMesh(2, 0), batch)
