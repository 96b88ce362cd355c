"""The one-collective gather on real gloo ranks: round trips, the gradient contract, collective count.

Each test forks its ranks once (tests/dist_utils.py) and loops over the layouts
inside them. Every rank builds the same random packs from a shared seed, takes
row ``r`` of ``rank_indices`` as its layout, and compares against the
single-process brute force (``full[..., rows[r]]``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from cpdata.layout.maps import LAYOUTS, alignment, inverse_indices, rank_indices
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.sharder import ContextParallelSharder

COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "batch_isend_irecv",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
)
GATHERS = {"all_gather_single", "all_gather_into_tensor"}
SCATTERS = {"reduce_scatter_single", "reduce_scatter_tensor"}


@contextlib.contextmanager
def counting_collectives():
    """Replace every torch.distributed collective by a wrapper recording (name, [(dtype, shape)])."""
    calls: list[tuple[str, list[tuple[torch.dtype, tuple[int, ...]]]]] = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if name == "batch_isend_irecv":  # as all_to_all_single's (received, sent): each side's rows summed
                ops = args[0]
                tensors = [torch.cat([op.tensor for op in ops if op.op.__name__ == side] or
                                     [ops[0].tensor[:0]]) for side in ("irecv", "isend")]  # fmt: skip
            calls.append((name, [(t.dtype, tuple(t.shape)) for t in tensors]))
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _no_shard(*args, **kwargs):
    raise AssertionError("not used")


def _packs(cp: int, seed: int):
    """(layout, rows, original_seq_len) for every layout valid at ``cp``, two packs each."""
    rng = np.random.default_rng(seed)
    for layout in LAYOUTS:
        if layout == "identity" and cp > 1:
            continue
        for _ in range(2):
            doc_mult, pack_mult = alignment(layout, cp)
            lens = rng.integers(1, 7, size=int(rng.integers(1, 5))) * doc_mult
            total = int(lens.sum())
            pack_len = total + (-total) % pack_mult + pack_mult * int(rng.integers(0, 2))
            rows = rank_indices(layout, cp, lens, pack_len)
            yield layout, rows, max(1, pack_len - int(rng.integers(0, 4)))


def _sharder(mesh, rows, rank, **fields) -> ContextParallelSharder:
    layout = ShardLayout(
        local_token_global_indices=torch.from_numpy(rows[rank]),
        padded_seq_len=rows.size,
        gather_index=torch.from_numpy(inverse_indices(rows)),
        cp_size=rows.shape[0],
        cp_rank=rank,
        digest=1,
        **fields,
    )
    return ContextParallelSharder(device_mesh=mesh, shard_batch=_no_shard, shard_layout=layout)


def _roundtrip_and_grad(rank: int, cp: int) -> dict:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    stats = {"layouts": set(), "reordered": 0, "checked": 0}
    for layout, rows, original in _packs(cp, seed=cp):
        stats["layouts"].add(layout)
        stats["reordered"] += int(not np.array_equal(np.concatenate(rows), np.arange(rows.size)))
        s = _sharder(mesh, rows, rank, original_seq_len=original)
        idx = torch.from_numpy(rows[rank])
        g = torch.Generator().manual_seed(original)
        for shape, seq_dim in (
            ((original,), 0),
            ((2, original), 1),
            ((2, original, 3), 1),
            ((original, 4), 0),
            ((2, 3, original), -1),
        ):
            x = torch.randn(*shape, generator=g, dtype=torch.float64)
            local = s.shard_token_tensor(x, seq_dim=seq_dim, fill=0.0)
            padded = torch.cat(
                [
                    x,
                    x.new_zeros(
                        *x.shape[: seq_dim % x.dim()], rows.size - original, *x.shape[seq_dim % x.dim() + 1 :]
                    ),
                ],
                dim=seq_dim,
            )
            assert torch.equal(local, padded.index_select(seq_dim % x.dim(), idx))
            assert torch.equal(s.gather_token_tensor(local, seq_dim=seq_dim, trim=True), x)

            # gradient contract + collective count: replicated loss, integer weights (exact sums)
            leaf = local.detach().requires_grad_()
            weights = torch.randint(-5, 6, padded.shape, generator=g).to(padded.dtype)
            with counting_collectives() as forward_calls:
                gathered = s.gather_token_tensor(leaf, seq_dim=seq_dim)
            loss = (gathered * weights).sum()
            with counting_collectives() as backward_calls:
                loss.backward()
            assert torch.equal(leaf.grad, cp * weights.index_select(seq_dim % x.dim(), idx))
            expect = 1 if cp > 1 else 0
            assert len(forward_calls) == expect and all(n in GATHERS for n, _ in forward_calls), forward_calls
            assert len(backward_calls) == expect and all(n in SCATTERS for n, _ in backward_calls), (
                backward_calls
            )
            for _, tensors in forward_calls + backward_calls:
                assert all(dtype == torch.float64 for dtype, _ in tensors), tensors  # never an index tensor
            if forward_calls:
                local_shape = tuple(leaf.movedim(seq_dim, 0).shape)
                assert forward_calls[0][1][1][1] == local_shape  # (output, input): the input is the shard
            stats["checked"] += 1
    stats["layouts"] = sorted(stats["layouts"])
    return stats


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gather_roundtrip_gradient_and_one_collective(cp):
    stats = run_ranks(_roundtrip_and_grad, cp)
    expected = sorted(name for name in LAYOUTS if cp == 1 or name != "identity")
    for s in stats:
        assert s["layouts"] == expected and s["checked"] == 5 * 2 * len(expected)
        assert s["reordered"] > 0 if cp > 1 else True


def _flat_and_position_map(rank: int, cp: int) -> None:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    rows = rank_indices("thd", cp, [2 * cp, 4 * cp], 8 * cp)
    s = _sharder(mesh, rows, rank, input_row_shape=(2, 4 * cp))
    y = torch.randn(2, 4 * cp, 3, generator=torch.Generator().manual_seed(0))
    local = s.shard_token_tensor(y)
    assert torch.equal(local, y.reshape(8 * cp, 3)[torch.from_numpy(rows[rank])])
    assert torch.equal(s.gather_token_tensor(local, seq_dim=0, trim=True), y)

    padded_len = 4 * cp
    positions = torch.tensor([[0, 2, -1, 3], [padded_len - 1, -1, 1, 0]])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    rr = rank_indices("round_robin", cp, (), padded_len)
    s = _sharder(mesh, rr, rank, input_token_stream_positions=positions)
    out = s.gather_token_tensor(s.shard_token_tensor(x, fill=0.0), trim=True, fill=-1.0)
    assert out.tolist() == [[1.0, 2.0, -1.0, 4.0], [5.0, -1.0, 7.0, 8.0]]


@pytest.mark.parametrize("cp", [2, 4])
def test_flat_stream_and_position_map_round_trip(cp):
    run_ranks(_flat_and_position_map, cp)


def _raw_vs_presharded(rank: int, cp: int) -> int:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(7)
    compared = 0
    for fmt, seq_len in (("bshd", 8 * cp), ("bshd", 8 * cp - 3), ("thd", 12 * cp)):
        ids = torch.randint(1, 100, (1, seq_len), generator=g)
        full = {
            "input_ids": ids,
            "labels": torch.roll(ids, -1, 1),
            "position_ids": torch.arange(seq_len)[None],
            "padding_mask": torch.zeros(1, seq_len, dtype=torch.bool),
            "document_ids": torch.zeros(1, seq_len, dtype=torch.long),
            "weights": torch.randn(1, seq_len, 2, generator=g),
        }
        if fmt == "thd":
            slots = [4 * cp, 2 * cp, 6 * cp]
            full = {k: v.flatten(0, 1) for k, v in full.items()}
            full["seq_lens"] = full["seq_lens_padded"] = torch.tensor(slots, dtype=torch.int32)
            full["qkv_format"] = "thd"
            rows = rank_indices("thd", cp, slots, seq_len)
            extra = {"weights": 0}
        else:
            rows = rank_indices("round_robin", cp, (), seq_len + (-seq_len) % (2 * cp))
            extra = {"weights": 1}
        raw_sharder = ContextParallelSharder(None, mesh, full, extra_seq_buffers=extra)
        _, raw = raw_sharder.shard(dict(full))
        padded = rows.size
        idx = torch.from_numpy(rows[rank])
        # the worker's shard: the padded full pack indexed by this rank's row, plus its layout
        layout = ShardLayout(
            local_token_global_indices=idx,
            original_seq_len=seq_len if fmt == "bshd" else None,
            padded_seq_len=padded,
            input_row_shape=(seq_len,) if fmt == "thd" else None,
            gather_index=torch.from_numpy(inverse_indices(rows)),
            cp_size=cp,
            cp_rank=rank,
        )
        worker = {}
        for key, value in full.items():
            if not isinstance(value, torch.Tensor) or key in ("seq_lens", "seq_lens_padded"):
                continue
            seq_dim = extra.get(key, value.dim() - 1)
            worker[key] = value.index_select(seq_dim, idx) if padded == seq_len else None
        if padded == seq_len:
            pre_sharder = ContextParallelSharder(None, mesh, _Presharded(worker, layout))
            _, pre = pre_sharder.shard(_Presharded(worker, layout))
            for key, value in worker.items():
                assert raw[key].dtype == pre[key].dtype and torch.equal(raw[key], pre[key]), key
                seq_dim = extra.get(key, value.dim() - 1)
                assert torch.equal(raw_sharder.shard_token_tensor(full[key], seq_dim=seq_dim), value), key
                a = raw_sharder.gather_token_tensor(raw[key].double(), seq_dim=seq_dim, trim=True)
                b = pre_sharder.gather_token_tensor(pre[key].double(), seq_dim=seq_dim, trim=True)
                assert torch.equal(a, b) and torch.equal(a, full[key].double()), key
                compared += 1
        else:  # padded on device: the gather trims the pad away and returns the caller's batch
            for key in ("input_ids", "labels", "weights"):
                seq_dim = extra.get(key, full[key].dim() - 1)
                back = raw_sharder.gather_token_tensor(raw[key], seq_dim=seq_dim, trim=True)
                assert torch.equal(back, full[key]), key
            tail = raw_sharder.gather_token_tensor(raw["labels"])[:, seq_len:]
            assert tail.numel() and bool((tail == -100).all())
            compared += 1
    return compared


class _Presharded(dict):
    def __init__(self, tensors, layout):
        super().__init__(tensors)
        self.layout = layout


@pytest.mark.parametrize("cp", [2, 4])
def test_raw_full_batch_equals_presharded_batch(cp):
    assert run_ranks(_raw_vs_presharded, cp) == [6 + 6 + 1] * cp


def _wrong_layouts(rank: int, cp: int) -> list[str]:
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    messages = []
    rows = rank_indices("contiguous", cp, (), 4 * cp)
    bigger = rank_indices("contiguous", 2 * cp, (), 8 * cp)
    other = (rank + 1) % cp
    for layout_rows, layout_rank in ((bigger, rank), (rows, other)):
        layout = ShardLayout(
            local_token_global_indices=torch.from_numpy(layout_rows[layout_rank]),
            gather_index=torch.from_numpy(inverse_indices(layout_rows)),
            padded_seq_len=layout_rows.size,
            cp_size=layout_rows.shape[0],
            cp_rank=layout_rank,
        )
        batch = _Presharded({"input_ids": torch.zeros(1, 4)}, layout)
        with pytest.raises(ValueError) as err:
            ContextParallelSharder(None, mesh, batch).shard(batch)
        messages.append(str(err.value))
        direct = ContextParallelSharder(device_mesh=mesh, shard_batch=_no_shard, shard_layout=layout)
        with pytest.raises(ValueError, match="shard layout was built for"):
            direct.gather_token_tensor(torch.zeros(1, 4))
    return messages


def test_layout_for_another_cp_size_or_rank_is_refused():
    for rank, (size_msg, rank_msg) in enumerate(run_ranks(_wrong_layouts, 2)):
        assert "cp_size=4 but the CP mesh has cp_size=2" in size_msg
        assert f"tokens of cp_rank={1 - rank} but this process is cp_rank={rank}" in rank_msg


def _overlapping_maps(rank: int, cp: int) -> str:
    from cpdata.gather import ensure_gather_index

    own = torch.tensor([rank, rank + 1])  # rank 0 holds [0, 1], rank 1 [1, 2]: 1 twice, 3 nowhere
    with pytest.raises(ValueError) as err:
        ensure_gather_index(ShardLayout(local_token_global_indices=own))
    return str(err.value)


def test_index_maps_that_are_not_a_permutation_are_refused():
    """``ensure_gather_index`` inverts the ranks' maps only when they hold every global position once: a
    position held twice (so another held nowhere) would gather one token twice and lose the other."""
    from cpdata.gather import ensure_gather_index

    good = ShardLayout(local_token_global_indices=torch.tensor([2, 0, 3, 1]))
    inverted = ensure_gather_index(good)  # no process group: one rank holds the whole pack
    assert torch.equal(good.local_token_global_indices[inverted.gather_index], torch.arange(4))
    with pytest.raises(ValueError, match=r"\(1 x 4\) are not a permutation of range\(4\)"):
        ensure_gather_index(ShardLayout(local_token_global_indices=torch.tensor([2, 0, 2, 1])))
    for message in run_ranks(_overlapping_maps, 2):
        assert "(2 x 2) are not a permutation of range(4)" in message
