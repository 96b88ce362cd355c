"""ShardForRank and ShardedBatch: shards reassemble to the full pack; errors name the fix."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from test_collate import make_plans
from torch.utils.data._utils.collate import default_convert
from torchdata.nodes import IterableWrapper

from cpdata.layout.maps import LAYOUTS, alignment, causal_work, rank_indices
from cpdata.nodes.collate import Collate
from cpdata.nodes.shard import ShardForRank, layout_depends_on_documents
from cpdata.worker.batch import ShardedBatch
from cpdata.worker.collate import collate_pack
from cpdata.worker.keys import METADATA_KEYS
from cpdata.worker.shard_block import plan_digest
from cpdata.worker.stream_slots import slot_block

CASES = [(layout, cp) for layout in LAYOUTS for cp in ((1,) if layout == "identity" else (1, 2, 3, 4))]


def plans_for(layout: str, cp: int, n: int, seed: int = 0):
    doc_multiple, pack_multiple = alignment(layout, cp)
    capacity = pack_multiple * max(1, 96 // pack_multiple)  # (tiled: one cp x tile multiple)
    plans, _ = make_plans(np.random.default_rng(seed), n_plans=n, capacity=capacity, doc_multiple=doc_multiple,
                          max_docs=6, extras=True, given_labels=0.2)  # fmt: skip
    return plans


def shard_node(plans, *, batch_size=1, qkv_format="bshd", **kw):
    return ShardForRank(Collate(IterableWrapper(plans), batch_size=batch_size, qkv_format=qkv_format), **kw)


def reassemble(shards, key, qkv_format):
    gather = shards[0].layout.gather_index
    return torch.cat([s[key] for s in shards], dim=-1)[..., gather]


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
@pytest.mark.parametrize(("layout", "cp"), CASES)
def test_all_ranks_reassemble_to_the_full_pack(layout, cp, qkv_format):
    batch_size = 2 if qkv_format == "thd" or not layout_depends_on_documents(layout, cp) else 1
    plans = plans_for(layout, cp, n=5)
    node = shard_node(plans, batch_size=batch_size, qkv_format=qkv_format, cp_size=cp, cp_rank=0, layout=layout,
                      all_ranks=True)  # fmt: skip
    batches = list(node)
    assert len(batches) == -(-5 // batch_size)
    assert len(batches[-1][0].info["pack_indices"]) == 5 - batch_size * (len(batches) - 1)  # short last batch
    for i, shards in enumerate(batches):
        group = plans[i * batch_size : (i + 1) * batch_size]
        full = collate_pack(group, qkv_format=qkv_format)
        assert len(shards) == cp
        for key in full:
            if key in METADATA_KEYS:
                for s in shards:
                    np.testing.assert_array_equal(s[key].numpy(), full[key], err_msg=key)
            else:
                np.testing.assert_array_equal(reassemble(shards, key, qkv_format).numpy(), full[key], err_msg=key)
        stream_len = full["input_ids"].shape[-1]
        lens = slot_block([group]).layout_lens_of(0) if qkv_format == "thd" else group[0].slot_lens
        want_rows = rank_indices(layout, cp, lens, stream_len)
        for r, s in enumerate(shards):
            np.testing.assert_array_equal(s.layout.local_token_global_indices.numpy(), want_rows[r])
            lay = s.layout
            assert (lay.cp_rank, lay.cp_size, lay.padded_seq_len, lay.original_seq_len) == (r, cp, stream_len, None)
            assert lay.input_row_shape == ((len(group), group[0].capacity) if qkv_format == "thd" else None)
            assert lay.local_token_global_indices.dtype == torch.int64
            assert lay.local_token_global_indices.shape == (stream_len // cp,)
            assert s["input_ids"].shape[-1] == stream_len // cp
            assert s["max_seqlen"].shape == () and s["cu_seqlens"].dtype == torch.int32
            assert lay.digest == shards[0].layout.digest == s.info["digest"]
            assert s.info["pack_indices"] == [p.index for p in group]
            assert s.info["real_tokens"] == sum(p.real_tokens for p in group)
            assert s.info["n_documents"] == sum(len(p.pieces) for p in group)
            assert len(s.info["causal_work"]) == cp
        if len(group) == 1:
            assert shards[0].layout.digest == plan_digest(group[0], layout, cp)
        total_work = sum(n * (n + 1) // 2 for p in group for n in p.seq_lens.tolist())
        assert sum(shards[0].info["causal_work"]) == total_work
        flat_docs = full["document_ids"].reshape(-1)
        offset = np.arange(flat_docs.size) - full["cu_seqlens_padded"][flat_docs]
        doc_pos = np.where(full["padding_mask"].reshape(-1), -1, offset).reshape(-1, stream_len)
        want_work = sum(causal_work(want_rows, dp) for dp in doc_pos)
        assert shards[0].info["causal_work"] == want_work.tolist()


@pytest.mark.parametrize(("layout", "cp"), [("thd", 2), ("balanced", 4), ("round_robin", 2)])
def test_one_rank_equals_its_share_of_all_ranks(layout, cp):
    plans = plans_for(layout, cp, n=3, seed=3)
    everyone = list(shard_node(plans, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True))
    for r in range(cp):
        mine = list(shard_node(plans, cp_size=cp, cp_rank=r, layout=layout))
        for a, b in zip(mine, everyone, strict=True):
            assert set(a) == set(b[r])
            for k in a:
                assert torch.equal(a[k], b[r][k]), k
            rows = rank_indices(layout, cp, plans[a.info["pack_indices"][0]].slot_lens, plans[0].capacity)
            np.testing.assert_array_equal(a.layout.local_token_global_indices.numpy(), rows[r])


def test_layout_dependence_is_asked_of_the_layouts():
    assert {name: layout_depends_on_documents(name, 2) for name in LAYOUTS if name != "identity"} == {
        "balanced": True, "contiguous": False, "round_robin": False, "thd": True, "tiled": True, "world": True,
    }  # fmt: skip
    assert not any(layout_depends_on_documents(name, 1) for name in LAYOUTS)


def test_errors_name_the_values():
    plans = plans_for("thd", 2, n=2)
    with pytest.raises(ValueError, match=r"cp_rank=2"):
        shard_node(plans, cp_size=2, cp_rank=2, layout="thd")
    with pytest.raises(ValueError, match=r"cp_rank=-1"):
        shard_node(plans, cp_size=2, cp_rank=-1, layout="thd")
    with pytest.raises(ValueError, match=r"cp_size must be an int >= 1, got 0; use cp_size=1"):
        shard_node(plans, cp_size=0, cp_rank=0, layout="thd")
    with pytest.raises(ValueError, match="unknown layout"):
        shard_node(plans, cp_size=2, cp_rank=0, layout="ring")
    with pytest.raises(ValueError, match="batch_size=1"):
        shard_node(plans, batch_size=2, qkv_format="bshd", cp_size=2, cp_rank=0, layout="thd")
    # Found at run time too, when the source is not a Collate node.
    rows_node = ShardForRank(IterableWrapper(list(Collate(IterableWrapper(plans), batch_size=2))), cp_size=2,
                             cp_rank=0, layout="balanced")  # fmt: skip
    with pytest.raises(ValueError, match="qkv_format='thd'"):
        next(rows_node)


def test_state_refuses_another_configuration():
    plans = plans_for("thd", 2, n=4)
    node = shard_node(plans, cp_size=2, cp_rank=0, layout="thd")
    next(node)
    state = node.state_dict()
    assert state["version"] == 2
    with pytest.raises(ValueError, match="version 1"):  # a state of the per-batch node (no block, no skip)
        shard_node(plans, cp_size=2, cp_rank=0, layout="thd").reset({**state, "version": 1})
    with pytest.raises(ValueError, match="cp_size"):
        shard_node(plans_for("thd", 4, n=4), cp_size=4, cp_rank=0, layout="thd").reset(state)
    with pytest.raises(ValueError, match="layout"):
        shard_node(plans, cp_size=2, cp_rank=0, layout="round_robin").reset(state)
    with pytest.raises(ValueError, match="batch_size"):
        shard_node(plans, batch_size=2, qkv_format="thd", cp_size=2, cp_rank=0, layout="thd").reset(state)
    with pytest.raises(ValueError, match="qkv_format"):
        shard_node(plans, qkv_format="thd", cp_size=2, cp_rank=0, layout="thd").reset(state)
    # Another CP rank of the same group resumes from the same state.
    other = shard_node(plans, cp_size=2, cp_rank=1, layout="thd")
    other.reset(state)
    assert next(other).info["pack_indices"] == [1]


def _one_batch() -> ShardedBatch:
    plans = plans_for("thd", 2, n=1)
    return next(shard_node(plans, cp_size=2, cp_rank=1, layout="thd"))


def test_sharded_batch_reads_like_a_mapping_and_survives_torch_paths():
    batch = _one_batch()
    assert isinstance(batch["input_ids"], torch.Tensor) and "layout" not in batch and len(batch) == len(dict(batch))
    for clone in (pickle.loads(pickle.dumps(batch)), copy.copy(batch), default_convert(batch), batch.to("cpu")):
        assert isinstance(clone, ShardedBatch)
        assert clone.layout.cp_rank == 1 and clone.info == batch.info
        assert all(torch.equal(clone[k], batch[k]) for k in batch)
    converted = default_convert(batch)
    assert converted is not batch and converted.layout is batch.layout


def test_sharded_batch_is_frozen_ish():
    batch = _one_batch()
    with pytest.raises(TypeError, match="keys are fixed"):
        batch["attention_mask"] = torch.zeros(1)
    with pytest.raises(TypeError, match="keys are fixed"):
        del batch["labels"]
    with pytest.raises(ValueError, match="shape .* batch_size=None"):
        batch["labels"] = torch.zeros(3)
    with pytest.raises(AttributeError):
        batch.layout = None
    batch["labels"] = batch["labels"].clone()  # same shape: allowed (torch's convert/pin path)
    extended = batch.replace(attention_mask=torch.ones(2), labels=None)
    assert "attention_mask" in extended and "labels" not in extended and extended.layout is batch.layout
    assert "labels" in batch


def test_collate_node_groups_plans_and_builds_tensors_on_demand():
    plans = plans_for("balanced", 2, n=5)
    batches = list(Collate(IterableWrapper(plans), batch_size=2, qkv_format="thd", padding_token_id=5))
    assert [[p.index for p in b.plans] for b in batches] == [[0, 1], [2, 3], [4]]
    for b in batches:
        assert b.row_shape == (len(b.plans), plans[0].capacity) and b.pack_len == plans[0].capacity
        full = collate_pack(list(b.plans), padding_token_id=5, qkv_format="thd")
        got = b.tensors()
        assert set(got) == set(full) and all(np.array_equal(got[k], full[k]) for k in full)
        for k in METADATA_KEYS:
            np.testing.assert_array_equal(b.metadata[k], full[k])
    with pytest.raises(ValueError, match="batch_size"):
        Collate(IterableWrapper(plans), batch_size=0)
    with pytest.raises(ValueError, match="qkv_format"):
        Collate(IterableWrapper(plans), qkv_format="sbhd")


def test_batch_tensors_share_one_buffer_and_move_in_one_copy(monkeypatch):
    import copy
    import pickle

    batch = next(iter(shard_node(plans_for("balanced", 2, n=2), cp_size=2, cp_rank=1, layout="balanced")))
    buffer = batch._buffer
    assert buffer is not None and buffer.dtype == torch.uint8
    for t in batch.values():  # every tensor is a view of the one buffer
        assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    copies = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    moved = batch.to("cpu", non_blocking=True)
    monkeypatch.undo()
    assert copies == [(batch._batch_bytes(),)]  # the batch part only: the layout maps follow it in the buffer
    for key in batch:
        assert torch.equal(moved[key], batch[key]) and moved[key].dtype == batch[key].dtype
    for other in (copy.copy(batch), pickle.loads(pickle.dumps(batch))):
        assert other._buffer is not None and set(other) == set(batch)
        assert all(torch.equal(other[k], batch[k]) for k in batch)
    batch["labels"] = batch["labels"].clone()  # a replaced key: per-key copies from now on, values intact
    assert batch._buffer is None and torch.equal(batch.to("cpu")["labels"], batch["labels"])
