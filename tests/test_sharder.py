"""ContextParallelSharder in one process: construction, token verbs against brute force, raw batches.

CP > 1 here uses a fake mesh (rank and size only): shard verbs need no
collective, and every gather path exercised raises before any collective.
The real multi-rank gather lives in test_gather_dist.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.gather import gather_token_tensor, layout_tensor_on
from cpdata.layout.maps import LAYOUTS, alignment, inverse_indices, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.raw_shard import DeviceShard
from cpdata.nemo.sharder import ContextParallelSharder


class FakeMesh:
    """Enough of a DeviceMesh for one process: dim names, size, local rank, device type."""

    def __init__(self, cp_size: int = 1, cp_rank: int = 0, names=("cp",), device_type: str = "cpu"):
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.mesh_dim_names = names
        self.device_type = device_type

    def __getitem__(self, name):
        return self if name == "cp" else FakeMesh(1, 0, (name,), self.device_type)

    def size(self) -> int:
        return self.cp_size

    def get_local_rank(self) -> int:
        return self.cp_rank

    def get_group(self):
        return None


class Presharded(dict):
    """A worker-style batch: a dict with a ``.layout``."""

    def __init__(self, tensors, layout):
        super().__init__(tensors)
        self.layout = layout


def _unused_shard_batch(*args, **kwargs):
    raise AssertionError("shard_batch should not be called")


def make_layout(rows: np.ndarray, rank: int, **fields) -> ShardLayout:
    return ShardLayout(
        local_token_global_indices=torch.from_numpy(rows[rank]),
        padded_seq_len=rows.size,
        gather_index=torch.from_numpy(inverse_indices(rows)),
        cp_size=rows.shape[0],
        cp_rank=rank,
        **fields,
    )


def direct(mesh, layout=None, **kw) -> ContextParallelSharder:
    return ContextParallelSharder(
        device_mesh=mesh, shard_batch=_unused_shard_batch, shard_layout=layout, **kw
    )


def random_pack(rng: np.random.Generator, layout: str, cp: int) -> tuple[np.ndarray, int]:
    doc_mult, pack_mult = alignment(layout, cp)
    lens = rng.integers(1, 8, size=int(rng.integers(1, 5))) * doc_mult
    total = int(lens.sum())
    return lens, total + (-total) % pack_mult + pack_mult * int(rng.integers(0, 2))


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": torch.nn.Linear(1, 1)},
        {"batch": {}},
        {"num_chunks": 2},
        {"invoke_pre_embed": False},
        {"extra_seq_buffers": {}},
    ],
)
def test_shard_batch_excludes_resolution_args(kwargs):
    with pytest.raises(TypeError, match="mutually exclusive"):
        ContextParallelSharder(shard_batch=_unused_shard_batch, **kwargs)


def test_direct_only_args_and_batch_required():
    with pytest.raises(TypeError, match="require shard_batch"):
        ContextParallelSharder(batch={}, local_token_global_indices=lambda *a: None)
    with pytest.raises(TypeError, match="require shard_batch"):
        ContextParallelSharder(batch={}, shard_layout=ShardLayout())
    with pytest.raises(TypeError, match="batch is required"):
        ContextParallelSharder(model=None, device_mesh=FakeMesh())


def test_meshes_and_shard_stores_layout():
    mesh = FakeMesh(2, 1, names=("dp", "cp", "tp"))
    layout = ShardLayout(padded_seq_len=4)
    calls = []

    def shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
        calls.append((cp_mesh, tp_mesh, loss_mask, padding_token_id))
        return contextlib.nullcontext, {"x": batch["x"] + 1}, layout

    mask = torch.ones(1, 4)
    s = ContextParallelSharder(device_mesh=mesh, shard_batch=shard_batch, loss_mask=mask, padding_token_id=7)
    assert s._cp_mesh is mesh and s._tp_mesh.mesh_dim_names == ("tp",)
    assert s._loss_mask is mask and s._padding_token_id == 7 and s.device == torch.device("cpu")
    ctx, out = s.shard({"x": torch.zeros(2)})
    assert ctx is contextlib.nullcontext and out["x"].tolist() == [1, 1]
    assert s.shard_layout is layout and calls == [(mesh, s._tp_mesh, mask, 7)]
    bare = ContextParallelSharder(device_mesh=FakeMesh(names=("dp",)), shard_batch=shard_batch)
    assert bare._cp_mesh is None and bare._tp_mesh is None


# -- shard_token_tensor: the four cases ------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cp=st.sampled_from([1, 2, 3, 4]), layout=st.sampled_from(LAYOUTS))
def test_shard_token_tensor_matches_brute_force(seed, cp, layout):
    if layout == "identity" and cp > 1:
        layout = "contiguous"
    rng = np.random.default_rng(seed)
    lens, pack_len = random_pack(rng, layout, cp)
    rows = rank_indices(layout, cp, lens, pack_len)
    original = pack_len - int(rng.integers(0, min(pack_len, 3)))
    for r in range(cp):
        s = direct(FakeMesh(cp, r), make_layout(rows, r, original_seq_len=original))
        idx = torch.from_numpy(rows[r])
        # (4) already padded, any seq_dim and trailing dims
        full = torch.randn(2, pack_len, 3)
        assert torch.equal(s.shard_token_tensor(full, seq_dim=1), full[:, idx])
        assert torch.equal(s.shard_token_tensor(full.transpose(0, 1), seq_dim=0), full.transpose(0, 1)[idx])
        # (3) original length, right-padded with fill
        x = torch.arange(original * 2).reshape(2, original)
        padded = torch.cat([x, torch.full((2, pack_len - original), -5)], dim=1)
        assert torch.equal(s.shard_token_tensor(x, seq_dim=-1, fill=-5), padded[:, idx])
        # (2) flat stream: leading dims equal input_row_shape are flattened, seq dim 0
        if pack_len % 2 == 0:
            flat = direct(FakeMesh(cp, r), make_layout(rows, r, input_row_shape=(2, pack_len // 2)))
            rows_bs = torch.randn(2, pack_len // 2, 5)
            assert torch.equal(flat.shard_token_tensor(rows_bs), rows_bs.reshape(pack_len, 5)[idx])


def test_shard_token_tensor_position_map():
    cp, padded_len = 2, 8
    rows = rank_indices("round_robin", cp, (), padded_len)
    positions = torch.tensor([[0, 1, 2, -1, 5], [3, -1, 4, 6, 7]])
    x = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    ref = torch.full((2, padded_len), -1)
    for b in range(2):
        for i in range(5):
            if positions[b, i] >= 0:
                ref[b, positions[b, i]] = x[b, i]
    for r in range(cp):
        s = direct(FakeMesh(cp, r), make_layout(rows, r, input_token_stream_positions=positions))
        assert torch.equal(s.shard_token_tensor(x, fill=-1), ref[:, torch.from_numpy(rows[r])])
        with pytest.raises(ValueError, match="fill="):
            s.shard_token_tensor(x)


def test_shard_token_tensor_length_errors_name_the_values():
    rows = rank_indices("round_robin", 2, (), 12)
    s = direct(FakeMesh(2, 0), make_layout(rows, 0, original_seq_len=10))
    with pytest.raises(ValueError, match=r"padded_seq_len=12 \(original_seq_len=10\).*length 11 on dim 1"):
        s.shard_token_tensor(torch.zeros(2, 11))
    with pytest.raises(ValueError, match="length 10 on dim 1.*fill="):
        s.shard_token_tensor(torch.zeros(2, 10))  # original length without fill
    # captured indices validate the requested padded length (numel x cp_size)
    loose = direct(FakeMesh(2, 0), ShardLayout(local_token_global_indices=torch.arange(6)))
    with pytest.raises(ValueError, match=r"12 tokens \(6 local x cp_size 2\), got padded_seq_len=14"):
        loose.shard_token_tensor(torch.zeros(14))


def test_data_dependent_layout_raises_before_first_shard():
    s = direct(FakeMesh(2, 0))
    with pytest.raises(ValueError, match=r"call shard\(batch\)"):
        s.shard_token_tensor(torch.zeros(1, 8))
    with pytest.raises(NotImplementedError, match=r"before the first shard"):
        s.gather_token_tensor(torch.zeros(1, 4))


# -- gather: single-rank paths and errors ----------------------------------------------------


@pytest.mark.parametrize("seq_dim", [0, 1, -1])
def test_gather_cp1_applies_the_index_map_and_its_gradient(seq_dim):
    rows = np.random.default_rng(0).permutation(10)[None, :]
    s = direct(FakeMesh(1, 0), make_layout(rows, 0, original_seq_len=7))
    shape = [3, 3]
    shape[seq_dim] = 10
    full = torch.randn(*shape)
    local = s.shard_token_tensor(full, seq_dim=seq_dim).requires_grad_()
    assert not torch.equal(local, full)  # the layout really reorders
    gathered = s.gather_token_tensor(local, seq_dim=seq_dim)
    assert torch.equal(gathered, full)
    assert torch.equal(s.gather_token_tensor(local, seq_dim=seq_dim, trim=True), full.narrow(seq_dim, 0, 7))
    w = torch.randn(*shape)
    (gathered * w).sum().backward()
    assert torch.equal(local.grad, w.index_select(seq_dim % 2, torch.from_numpy(rows[0])))


def test_gather_cp1_without_gather_index_uses_local_indices():
    perm = torch.tensor([2, 0, 3, 1])
    s = direct(FakeMesh(1, 0), ShardLayout(local_token_global_indices=perm, padded_seq_len=4))
    full = torch.tensor([[5.0, 6.0, 7.0, 8.0]])
    assert torch.equal(s.gather_token_tensor(s.shard_token_tensor(full)), full)
    assert torch.equal(direct(None).gather_token_tensor(full), full)  # nothing to undo at cp=1


def test_trim_cases_at_cp1():
    rows = np.arange(8)[None, :]
    positions = torch.tensor([[0, 2, -1], [5, -1, 7]])
    s = direct(FakeMesh(), make_layout(rows, 0, input_token_stream_positions=positions))
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    local = s.shard_token_tensor(x, fill=0)
    assert s.gather_token_tensor(local, trim=True, fill=-9).tolist() == [[1, 2, -9], [4, -9, 6]]
    hidden = s.gather_token_tensor(local[..., None].expand(2, 8, 2), trim=True, fill=-9)
    assert hidden.shape == (2, 3, 2) and hidden[..., 1].tolist() == [[1, 2, -9], [4, -9, 6]]
    with pytest.raises(ValueError, match="needs fill="):
        s.gather_token_tensor(local, trim=True)
    rowsh = direct(FakeMesh(), make_layout(rows, 0, input_row_shape=(2, 4)))
    y = torch.randn(2, 4, 3)
    flat = rowsh.shard_token_tensor(y)
    assert flat.shape == (8, 3) and torch.equal(rowsh.gather_token_tensor(flat, seq_dim=0, trim=True), y)
    with pytest.raises(ValueError, match="gathered length 6 on dim 1 != padded_seq_len 8"):
        direct(FakeMesh(), ShardLayout(padded_seq_len=8)).gather_token_tensor(torch.zeros(1, 6), trim=True)
    packed = torch.arange(8.0).view(1, 8)  # a worker's packed row: its stream is the caller's coordinates
    assert torch.equal(direct(FakeMesh(), ShardLayout(padded_seq_len=8)).gather_token_tensor(packed, trim=True), packed)
    with pytest.raises(ValueError, match="trim=True needs a shard layout"):
        direct(FakeMesh()).gather_token_tensor(torch.zeros(1, 4), trim=True)


def test_functional_gather_errors():
    rows = rank_indices("contiguous", 2, (), 8)
    layout = make_layout(rows, 0)
    with pytest.raises(ValueError, match="gather_index is None"):
        gather_token_tensor(torch.zeros(1, 4), ShardLayout(cp_size=2))
    with pytest.raises(ValueError, match=r"3 tokens on dim 1, x cp_size 2 = 6.*covers 8 tokens"):
        gather_token_tensor(torch.zeros(1, 3), layout)
    with pytest.raises(ValueError, match="no process group is initialized"):
        gather_token_tensor(torch.zeros(1, 4), layout)
    with pytest.raises(ValueError, match=r"built for cp_size=2, cp_rank=1 but the CP mesh has cp_size=2 and"):
        direct(FakeMesh(2, 0), make_layout(rows, 1)).gather_token_tensor(torch.zeros(1, 4))


def test_layout_tensors_move_once_per_layout_and_device():
    layout = make_layout(rank_indices("round_robin", 2, (), 8), 0)
    first = layout_tensor_on(layout, "gather_index", "meta")
    assert first.device.type == "meta" and layout_tensor_on(layout, "gather_index", "meta") is first
    assert layout_tensor_on(layout, "gather_index", "cpu") is layout.gather_index  # already there: no copy
    other = make_layout(rank_indices("round_robin", 2, (), 8), 0)
    assert layout_tensor_on(other, "gather_index", "meta") is not first


# -- resolution and the on-device shard of raw batches ---------------------------------------


def test_identity_sharder_works_before_and_after_shard():
    batch = {"input_ids": torch.arange(10).reshape(2, 5)}
    for mesh in (None, FakeMesh(1, 0)):
        s = ContextParallelSharder(None, mesh, batch)
        x = torch.randn(2, 5, 3)
        assert torch.equal(s.shard_token_tensor(x), x) and torch.equal(s.gather_token_tensor(x), x)
        ctx, out = s.shard(batch)
        assert ctx is contextlib.nullcontext and torch.equal(out["input_ids"], batch["input_ids"])
        assert s.shard_layout.original_seq_len == 5 and s.gather_token_tensor(x, trim=True).shape == (2, 5, 3)


def _pad_reference(batch: dict, padded: int, padding_token_id: int) -> dict:
    """Brute-force semantic padding on the last dim, one position at a time."""
    fills = {"input_ids": padding_token_id, "labels": -100, "padding_mask": True, "loss_mask": 0, "extra": 0}
    out = {}
    for key, t in batch.items():
        cols = [t[..., i] for i in range(t.shape[-1])]
        while len(cols) < padded:
            if key == "position_ids":
                cols.append(cols[-1] + 1)
            elif key == "document_ids":
                cols.append(cols[-1])
            else:
                cols.append(torch.full_like(cols[-1], fills[key]))
        out[key] = torch.stack(cols, dim=-1)
    return out


@pytest.mark.parametrize("cp,seq_len", [(2, 5), (2, 8), (3, 7), (4, 9)])
def test_raw_round_robin_pads_semantically_and_shards_like_the_layout(cp, seq_len):
    g = torch.Generator().manual_seed(cp * 100 + seq_len)
    batch = {
        "input_ids": torch.randint(1, 50, (2, seq_len), generator=g),
        "labels": torch.randint(0, 50, (2, seq_len), generator=g),
        "position_ids": torch.arange(seq_len).repeat(2, 1),
        "padding_mask": torch.zeros(2, seq_len, dtype=torch.bool),
        "document_ids": torch.zeros(2, seq_len, dtype=torch.long),
        "cu_seqlens": torch.tensor([0, seq_len], dtype=torch.int32),
        "qkv_format": "bshd",
    }
    loss_mask = torch.ones(2, seq_len)
    padded = seq_len + (-seq_len) % (2 * cp)
    token_keys = ("input_ids", "labels", "position_ids", "padding_mask", "document_ids")
    ref = _pad_reference({k: batch[k] for k in token_keys} | {"loss_mask": loss_mask}, padded, 3)
    rows = rank_indices("round_robin", cp, (), padded)
    for r in range(cp):
        s = ContextParallelSharder(None, FakeMesh(cp, r), batch, padding_token_id=3, loss_mask=loss_mask)
        assert s.local_token_global_indices is not None  # round robin is closed-form
        _, out = s.shard(dict(batch))
        for key, full in ref.items():
            assert out[key].dtype == full.dtype and torch.equal(
                out[key], full[:, torch.from_numpy(rows[r])]
            ), key
        assert out["cu_seqlens"] is batch["cu_seqlens"] and out["qkv_format"] == "bshd"  # metadata untouched
        layout = s.shard_layout
        assert (layout.original_seq_len, layout.padded_seq_len, layout.cp_size, layout.cp_rank) == (
            seq_len,
            padded,
            cp,
            r,
        )
        assert torch.equal(layout.gather_index, torch.from_numpy(inverse_indices(rows)))
        assert isinstance(layout.digest, int)


def test_raw_thd_flattens_rows_and_reads_per_row_slots():
    cp = 2
    # two rows; each row's slots (sentinel -1000 = unused), the last slot of a row absorbs its tail
    seq_lens_padded = torch.tensor([[4, 4, -1000], [8, -1000, -1000]])
    ids = torch.arange(24).reshape(2, 12)
    batch = {"input_ids": ids, "labels": ids + 100, "position_ids": ids % 12, "seq_lens": seq_lens_padded,
             "seq_lens_padded": seq_lens_padded, "qkv_format": "thd"}
    extra = torch.randn(2, 12, 3)
    batch["hidden"] = extra
    rows = rank_indices("thd", cp, [4, 8, 12], 24)  # row 0: [4, 4] + tail 4
    for r in range(cp):
        s = ContextParallelSharder(None, FakeMesh(cp, r), batch, extra_seq_buffers={"hidden": 1})
        assert s.local_token_global_indices is None  # data-dependent: verbs wait for shard()
        _, out = s.shard(batch)
        idx = torch.from_numpy(rows[r])
        assert torch.equal(out["input_ids"], ids.reshape(-1)[idx]) and torch.equal(
            out["labels"], ids.reshape(-1)[idx] + 100
        )
        assert torch.equal(out["hidden"], extra.reshape(24, 3)[idx])
        assert s.shard_layout.input_row_shape == (2, 12) and s.shard_layout.original_seq_len is None
        assert torch.equal(s.shard_token_tensor(extra), out["hidden"])  # caller rows -> local stream


def test_raw_thd_errors_name_the_fix():
    zeros = torch.zeros(1, 8, dtype=torch.long)
    batch = {"input_ids": zeros, "labels": zeros, "position_ids": zeros, "qkv_format": "thd"}
    with pytest.raises(KeyError, match="seq_lens"):
        ContextParallelSharder(None, FakeMesh(2, 0), batch).shard(batch)
    bad = dict(batch, seq_lens=torch.tensor([3, 5]), seq_lens_padded=torch.tensor([3, 5]))
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=4"):
        ContextParallelSharder(None, FakeMesh(2, 0), bad).shard(bad)
    odd = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 7, dtype=torch.long)}
    with pytest.raises(ValueError, match="'labels' has 7 tokens on dim 1 but the primary has 8"):
        ContextParallelSharder(None, FakeMesh(2, 0), odd).shard(odd)


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
@pytest.mark.parametrize("cp", [2, 4])
def test_raw_shard_of_a_collated_pack_equals_the_worker_shard(qkv_format, cp):
    """On-device shard of Collate's full pack == collate_rank (the worker's shard), bit for bit."""
    collate = pytest.importorskip("cpdata.worker.collate")
    from cpdata.worker.plan import DocPiece, PackPlan

    rng = np.random.default_rng(cp)
    layout = "thd" if qkv_format == "thd" else "round_robin"
    doc_mult, pack_mult = alignment(layout, cp)
    plans = []
    for b in range(2):
        lens = rng.integers(2, 9, size=3)
        pieces = tuple(
            DocPiece(index=3 * b + i, start=0, arrays={"input_ids": rng.integers(1, 99, n)})
            for i, n in enumerate(lens)
        )
        slots = lens + (-lens) % doc_mult
        plans.append(
            PackPlan(
                pieces=pieces,
                slot_lens=slots,
                capacity=int(slots.sum()) + (-int(slots.sum())) % pack_mult + pack_mult,
            )
        )
    capacity = max(p.capacity for p in plans)
    plans = [PackPlan(pieces=p.pieces, slot_lens=p.slot_lens, capacity=capacity) for p in plans]
    full = {
        k: torch.from_numpy(np.asarray(v))
        for k, v in collate.collate_pack(plans, qkv_format=qkv_format).items()
    }
    raw = dict(full, qkv_format=qkv_format)
    if qkv_format == "thd":
        rows = rank_indices("thd", cp, full["seq_lens_padded"].numpy(), 2 * capacity)
    else:
        rows = rank_indices("round_robin", cp, (), capacity)
    for r in range(cp):
        _, out = ContextParallelSharder(None, FakeMesh(cp, r), raw).shard(raw)
        worker = collate.collate_rank(plans, rows[r], qkv_format=qkv_format)
        token_keys = [
            k for k in ("input_ids", "labels", "position_ids", "padding_mask", "document_ids") if k in worker
        ]
        assert len(token_keys) == 5
        for key in token_keys:
            expect = torch.from_numpy(np.asarray(worker[key]))
            assert out[key].dtype == expect.dtype and torch.equal(out[key], expect), key


def test_presharded_batch_is_only_moved_and_checked():
    rows = rank_indices("balanced", 2, [3, 5], 8)
    full = torch.arange(8)[None, :]
    for r in range(2):
        layout = make_layout(rows, r)
        batch = Presharded(
            {"input_ids": full[:, torch.from_numpy(rows[r])], "cu_seqlens": torch.tensor([0, 3, 8])}, layout
        )
        s = ContextParallelSharder(None, FakeMesh(2, r), batch)
        assert s.local_token_global_indices is None  # the worker's layout is unknown until shard()
        ctx, out = s.shard(batch)
        assert type(out) is dict and s.shard_layout is layout
        assert isinstance(ctx, AttentionContextFactory) and ctx.layout is layout  # CP attention at cp > 1
        assert all(torch.equal(out[k], batch[k]) for k in batch)
        with pytest.raises(ValueError, match=r"cp_size=2 but the CP mesh has cp_size=4"):
            ContextParallelSharder(None, FakeMesh(4, r), batch).shard(batch)
        with pytest.raises(ValueError, match=rf"tokens of cp_rank={r} but this process is cp_rank={1 - r}"):
            ContextParallelSharder(None, FakeMesh(2, 1 - r), batch).shard(batch)
        with pytest.raises(ValueError, match="loss_mask= applies to raw full batches"):
            ContextParallelSharder(None, FakeMesh(2, r), batch, loss_mask=torch.ones(1, 8)).shard(batch)



def test_presharded_batch_at_cp1_gets_no_cp_attention():
    """cp 1: every key is local, so the sharder hands back no attention context (nullcontext), the batch's
    tensors as they are: the model's own attention runs untouched."""
    rows = rank_indices("identity", 1, [3, 5], 8)
    batch = Presharded({"input_ids": torch.arange(8)[None, :], "document_ids": torch.tensor([[0] * 3 + [1] * 5]),
                        "cu_seqlens_padded": torch.tensor([0, 3, 8])}, make_layout(rows, 0))  # fmt: skip
    for mesh in (None, FakeMesh(1, 0)):
        ctx, out = ContextParallelSharder(None, mesh, batch).shard(batch)
        assert ctx is contextlib.nullcontext and all(torch.equal(out[k], batch[k]) for k in batch)

def test_sharded_batch_from_the_workers_is_accepted():
    batch_mod = pytest.importorskip("cpdata.worker.batch")
    rows = rank_indices("thd", 2, [4, 4], 8)
    layout = make_layout(rows, 1)
    batch = batch_mod.ShardedBatch({"input_ids": torch.arange(8)[torch.from_numpy(rows[1])]}, layout=layout)
    s = ContextParallelSharder(None, FakeMesh(2, 1), batch)
    _, out = s.shard(batch)
    assert (
        type(out) is dict and torch.equal(out["input_ids"], batch["input_ids"]) and s.shard_layout is layout
    )


def test_model_hook_owns_the_sharding():
    own = direct(None, ShardLayout(padded_seq_len=3))

    class Model(torch.nn.Module):
        def __init__(self, result):
            super().__init__()
            self.result, self.seen = result, []

        def prepare_model_inputs_for_cp(self, batch, *, num_chunks=1):  # NeMo's signature
            self.seen.append(num_chunks)
            return self.result

    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    mesh = FakeMesh(2, 1)
    model = Model({"cp_sharder": own, "extra_key": 1, "gone": None})
    s = ContextParallelSharder(model, mesh, batch, padding_token_id=5, num_chunks=3)
    assert model.seen == [3] and s.shard_batch is _unused_shard_batch and s.shard_layout is own.shard_layout
    assert s._cp_mesh is mesh and s._padding_token_id == 5
    assert batch["extra_key"] == 1 and batch["gone"] is None  # hook updates merged, None values included
    skipped = ContextParallelSharder(Model({"cp_sharder": own}), mesh, {"input_ids": torch.zeros(1, 4)},
                                     invoke_pre_embed=False)
    assert isinstance(skipped.shard_batch, DeviceShard)
    not_at_cp1 = Model({"cp_sharder": own})
    ContextParallelSharder(not_at_cp1, FakeMesh(1, 0), {"input_ids": torch.zeros(1, 4)})
    assert not_at_cp1.seen == []  # NeMo skips the hook at cp <= 1
    with pytest.raises(TypeError, match="must return a dict"):
        ContextParallelSharder(Model(42), mesh, batch)
    with pytest.raises(ValueError, match=r"^num_chunks must be an int >= 1, got 0 \(pipeline micro-batch chunks\)$"):
        ContextParallelSharder(None, mesh, batch, num_chunks=0)


def test_raw_batch_attention_mask_and_undeclared_token_tensors():
    ids = torch.arange(1, 9).view(1, 8)
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": attention}
    _, out = ContextParallelSharder(None, FakeMesh(2, 0), dict(batch)).shard(dict(batch))
    rows = rank_indices("round_robin", 2, [], 8)
    assert "attention_mask" not in out
    assert out["padding_mask"].tolist() == [(attention[0] == 0)[rows[0]].tolist()]
    batch = {"input_ids": ids, "token_type_ids": torch.zeros(1, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"\['token_type_ids'\] have the \[B, S\] shape of the primary \(1, 8\)"):
        ContextParallelSharder(None, FakeMesh(2, 0), dict(batch)).shard(dict(batch))


def test_raw_thd_row_of_sentinels_keeps_later_slots_in_place():
    ids = torch.arange(24).view(3, 8)
    seq_lens_padded = torch.tensor([[4, 4], [-1000, -1000], [8, -1000]])
    batch = {"input_ids": ids, "labels": ids, "position_ids": ids, "qkv_format": "thd",
             "seq_lens": seq_lens_padded, "seq_lens_padded": seq_lens_padded}
    _, out = ContextParallelSharder(None, FakeMesh(2, 0), dict(batch)).shard(dict(batch))
    expected = rank_indices("thd", 2, [4, 4, 8, 8], 24)[0]  # the empty row is one padding slot
    assert out["input_ids"].tolist() == expected.tolist()


def test_gather_refuses_an_int32_gather_index_before_any_collective():
    rows = rank_indices("contiguous", 1, [], 4)
    layout = make_layout(rows, 0)
    bad = ShardLayout(**{**layout.__dict__, "gather_index": layout.gather_index.to(torch.int32)})
    with pytest.raises(ValueError, match="gather_index must be int64.*torch.int32"):
        gather_token_tensor(torch.zeros(1, 4, requires_grad=True), bad)


@pytest.mark.parametrize("layout", ["round_robin", "thd", "balanced"])
def test_layout_of_rows_holds_each_rank_s_row_and_the_inverse_of_all(layout):
    cp, pack_len = 4, 64
    rows = rank_indices(layout, cp, [24, 8, 32], pack_len)
    for rank in range(cp):
        got = ShardLayout.of_rows(rows, rank, original_seq_len=60, digest=7)
        assert torch.equal(got.local_token_global_indices, torch.from_numpy(rows[rank]))
        assert torch.equal(torch.from_numpy(rows.reshape(-1))[got.gather_index], torch.arange(pack_len))
        assert (got.padded_seq_len, got.cp_size, got.cp_rank, got.original_seq_len, got.digest) == (
            pack_len, cp, rank, 60, 7)
        assert got.input_row_shape is None and got.kv_exchange is None
