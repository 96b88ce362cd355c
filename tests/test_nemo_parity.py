"""NeMo Automodel's public sharder path, behind cpdata's ``ContextParallelSharder`` (one process, fake meshes).

Expected values are NeMo's documented behaviour (its ``process_input_for_thd``
/ ``split_batch_into_thd_chunks`` docstrings and unit tests, the TE THD
partition, the round-robin path's position rules); nothing here imports NeMo.
Multi-rank behaviour (the attention ctx, the lazily built inverse) is in
tests/test_cp_attention_dist.py and tests/test_nemo_parity_dist.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from test_sharder import FakeMesh, direct

from cpdata.device.batch_context import AttentionContextFactory
from cpdata.layout.shard_layout import ShardLayout
from cpdata.nemo.sharder import ContextParallelSharder

TE = SimpleNamespace(backend=SimpleNamespace(attn="te"))
SDPA_MODEL = SimpleNamespace(backend=SimpleNamespace(attn="sdpa"))
I32 = torch.int32


def thd_batch(seq_lens, seq_lens_padded, rows: int, row_len: int, **extra) -> dict:
    ids = torch.arange(1, rows * row_len + 1).view(rows, row_len)
    return {
        "input_ids": ids,
        "labels": ids + 100,
        "position_ids": torch.arange(row_len).repeat(rows, 1),
        "seq_lens": torch.tensor(seq_lens),
        "seq_lens_padded": torch.tensor(seq_lens_padded),
        "qkv_format": "thd",
        **extra,
    }


def shard(batch, cp=1, rank=0, model=TE, **kw):
    s = ContextParallelSharder(model, FakeMesh(cp, rank), batch, **kw)
    ctx, out = s.shard(batch)
    return s, ctx, out


# -- item 3: THD metadata, cp = 1 --------------------------------------------------------------


def test_thd_cp1_key_set_and_values_with_padding_between_documents():
    batch = thd_batch([[3, 2], [2, 3]], [[4, 2], [3, 3]], 2, 6)
    _, ctx, out = shard(batch)
    assert ctx is contextlib.nullcontext
    assert set(out) == {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen",
                        "padding_mask", "qkv_format", "_thd_local_indices"}  # fmt: skip (NeMo 0.7.0 adds the map)
    assert out["_thd_local_indices"].tolist() == list(range(12)) and out["_thd_local_indices"].dtype == torch.long
    assert out["input_ids"].tolist() == list(range(1, 13)) and out["input_ids"].shape == (12,)
    assert out["cu_seqlens"].dtype == I32 and out["cu_seqlens"].tolist() == [0, 3, 5, 7, 10]
    assert out["cu_seqlens_padded"].dtype == I32 and out["cu_seqlens_padded"].tolist() == [0, 4, 6, 9, 12]
    assert out["max_seqlen"].dtype == I32 and out["max_seqlen"].dim() == 0 and out["max_seqlen"].item() == 3
    assert out["padding_mask"].dtype == torch.bool
    assert out["padding_mask"].tolist() == [False] * 3 + [True] + [False] * 4 + [True] + [False] * 3


def test_thd_cp1_sentinels_and_equal_lengths():
    out = shard(thd_batch([[3, 2], [6, -1000]], [[4, 2], [6, -1000]], 2, 6))[2]
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11] and out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    out = shard(thd_batch([[6], [6]], [[6], [6]], 2, 6))[2]
    assert out["cu_seqlens"].tolist() == [0, 6, 12] and "cu_seqlens_padded" not in out
    assert out["max_seqlen"].item() == 6 and not out["padding_mask"].any()



@pytest.mark.parametrize(
    ("seq_lens", "seq_lens_padded", "message"),
    [
        ([[5, 2]], [[4, 4]], r"row 0: seq_lens \[5, 2\] must be >= 0 and <= seq_lens_padded \[4, 4\]"),
        ([[3, -1]], [[4, 4]], r"must be >= 0 and <= seq_lens_padded"),
        ([[3, 3]], [[4, 5]], r"seq_lens_padded \[4, 5\] sum to 9 > the row's 8 tokens"),
        ([[3, -1000]], [[4, 4]], r"mark different entries with the sentinel -1000"),
    ],
)
def test_thd_lengths_that_do_not_fit_their_slots_or_the_row_are_refused(seq_lens, seq_lens_padded, message):
    """A document longer than its slot would spill into the next one, slots past the row into the next row,
    unmatched sentinels would pair lengths with other documents' slots: each refused, naming the row."""
    with pytest.raises(ValueError, match=message):
        shard(thd_batch(seq_lens, seq_lens_padded, 1, 8))
    shard(thd_batch([[3, 4]], [[4, 4]], 1, 8))  # the same row with lengths that fit

@pytest.mark.parametrize(
    ("real", "slots", "cu", "max_seqlen"),
    [
        ([112] * 5, [112] * 4 + [112 + 464], [0, 112, 224, 336, 448, 1024], 576),  # short micro-batch
        ([112] * 9, [112] * 8 + [128], [0, 112, 224, 336, 448, 560, 672, 784, 896, 1024], 128),  # full pack
    ],
)
def test_thd_trailing_pad_absorption_bumps_max_seqlen(real, slots, cu, max_seqlen):
    batch = thd_batch([real], [slots], 1, 1024)
    batch["input_ids"] = torch.zeros(1, 1024, dtype=torch.long)  # pad id 0 is also content: never consulted
    out = shard(batch)[2]
    assert out["cu_seqlens"].tolist() == cu and "cu_seqlens_padded" not in out
    assert out["max_seqlen"].item() == max_seqlen
    assert out["padding_mask"].sum().item() == 1024 - sum(real)  # absorption does not make pads real
    assert out["padding_mask"][: sum(real)].logical_not().all()


def test_thd_shapes_mrope_hidden_states_and_passthrough():
    b, s = 2, 4
    pixels = torch.randn(1, 3, 8, 8)
    batch = thd_batch([[4], [4]], [[4], [4]], b, s, pixel_values=pixels,
                      _global_vision_mask=torch.zeros(b, s, dtype=torch.bool), metadata={"id": 1})  # fmt: skip
    batch["position_ids"] = torch.arange(s).view(1, 1, s).expand(3, b, s)
    out = shard(batch)[2]
    assert out["position_ids"].shape == (3, 1, b * s) and out["position_ids"][0, 0].tolist() == [0, 1, 2, 3] * 2
    assert out["pixel_values"] is pixels and out["_global_vision_mask"] is batch["_global_vision_mask"]
    assert out["metadata"] == {"id": 1} and "seq_lens" not in out and "seq_lens_padded" not in out
    hidden = thd_batch([[4], [4]], [[4], [4]], b, s)
    hidden["input_ids"] = torch.randn(b, s, 16)  # a pipeline stage after the first
    assert shard(hidden)[2]["input_ids"].shape == (b * s, 16)


def test_thd_without_seq_lens_raises_keyerror_that_is_also_a_valueerror():
    batch = thd_batch([[4]], [[4]], 1, 4)
    del batch["seq_lens"]
    for error in (KeyError, ValueError):
        with pytest.raises(error, match="seq_lens"):
            shard(dict(batch))


# -- item 3: THD at cp > 1 ------------------------------------------------------------------------


def test_thd_cp2_example_rank0_and_rank1():
    batch = thd_batch([[3, 5]], [[4, 8]], 1, 12)
    expect = {0: ([0, 3, 4, 5, 10, 11], [False, True, False, False, True, True]),
              1: ([1, 2, 6, 7, 8, 9], [False, False, False, False, False, True])}  # fmt: skip
    for rank, (partition, padding) in expect.items():
        s, ctx, out = shard(dict(batch), cp=2, rank=rank)
        assert set(out) == {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "qkv_format",
                            "padding_mask", "cp_size", "cp_rank", "_thd_local_indices"}  # fmt: skip
        assert out["_thd_local_indices"].tolist() == partition
        assert out["input_ids"].tolist() == [p + 1 for p in partition]
        assert out["labels"].tolist() == [p + 101 for p in partition]
        assert out["position_ids"].tolist() == partition  # the row's positions at those stream slots
        assert out["cu_seqlens"].dtype == I32 and out["cu_seqlens"].tolist() == [0, 4, 12]
        assert out["max_seqlen"].dtype == I32 and out["max_seqlen"].item() == 8
        assert out["padding_mask"].tolist() == padding
        assert (out["cp_size"], out["cp_rank"], out["qkv_format"]) == (2, rank, "thd")
        assert out["input_ids"].dtype == out["labels"].dtype == out["position_ids"].dtype == torch.int64
        assert s.shard_layout.local_token_global_indices.tolist() == partition
        assert s.shard_layout.input_row_shape == (1, 12) and s.shard_layout.padded_seq_len == 12
        assert isinstance(ctx, AttentionContextFactory) and ctx.document_ids.tolist() == [
            0 if p < 4 else 1 for p in partition
        ]
        rows = torch.arange(12.0).view(1, 12)  # token verbs in the caller's [B, S] coordinates
        assert s.shard_token_tensor(rows).tolist() == [float(p) for p in partition]


def test_thd_cp2_hidden_states_of_later_pipeline_stages():
    batch = thd_batch([[3, 5]], [[4, 8]], 1, 12)
    hidden = torch.randn(1, 12, 6, requires_grad=True)
    batch["input_ids"] = hidden
    out = shard(batch, cp=2, rank=0)[2]
    assert out["input_ids"].dtype == hidden.dtype and out["input_ids"].shape == (6, 6)  # never cast to int64
    assert torch.equal(out["input_ids"], hidden[0, [0, 3, 4, 5, 10, 11]])
    out["input_ids"].sum().backward()
    assert hidden.grad[0, [0, 3, 4, 5, 10, 11]].eq(1).all() and hidden.grad.sum() == 6 * 6


def test_thd_cp2_mrope_keeps_its_leading_dim():
    batch = thd_batch([[4, 4]], [[4, 4]], 1, 8)
    batch["position_ids"] = torch.arange(8).view(1, 1, 8).expand(3, 1, 8)
    out = shard(batch, cp=2, rank=0)[2]
    assert out["position_ids"].shape == (3, 1, 4) and out["position_ids"][1, 0].tolist() == [0, 3, 4, 7]


# -- item 4: pipeline chunks ---------------------------------------------------------------------


def test_pp_chunks_at_cp1_stack_nemo_style():
    batch = thd_batch([[3, 2], [2, 3], [3, 2], [2, 3]], [[4, 2], [3, 3], [4, 2], [3, 3]], 4, 6, meta="x")
    s, ctx, out = shard(batch, num_chunks=2)
    assert out["input_ids"].shape == (2, 12) and out["labels"].shape == (2, 12) and out["padding_mask"].shape == (2, 12)
    assert out["cu_seqlens"].tolist() == [[0, 3, 5, 7, 10]] * 2
    assert out["cu_seqlens_padded"].tolist() == [[0, 4, 6, 9, 12]] * 2
    assert out["max_seqlen"].tolist() == [3, 3] and out["qkv_format"] == "thd" and out["meta"] == "x"
    assert s.shard_layout is None and ctx is contextlib.nullcontext  # each chunk is its own token space
    with pytest.raises(NotImplementedError, match="before the first shard"):
        s.shard_token_tensor(torch.zeros(2, 12))


def test_pp_chunks_mixed_absorption_and_sentinel_padding():
    sub, packed = 112, 1024
    real = [[sub] * 9, [sub] * 5 + [-1000] * 4]
    slots = [[sub] * 8 + [sub + 16], [sub] * 4 + [sub + packed - 5 * sub] + [-1000] * 4]
    batch = thd_batch(real, slots, 2, packed)
    out = shard(batch, num_chunks=2)[2]
    assert "cu_seqlens_padded" not in out and out["max_seqlen"].tolist() == [128, 576]
    assert out["cu_seqlens"][1].tolist() == [0, 112, 224, 336, 448, 1024] + [-1000] * 4


def test_pp_chunks_at_cp2_hold_exactly_nemos_keys():
    batch = thd_batch([[4], [4], [5], [8]], [[8], [8], [8], [8]], 4, 8)  # one document per row
    out = shard(batch, cp=2, rank=1, num_chunks=2)[2]
    assert set(out) == {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "qkv_format",
                        "padding_mask", "cp_size", "cp_rank"}  # fmt: skip
    # each chunk: slots [8, 8] -> rank 1 owns stream positions 2..5 and 10..13
    assert out["input_ids"].shape == (2, 8) and out["cu_seqlens"].tolist() == [[0, 8, 16], [0, 8, 16]]
    assert out["input_ids"][0].tolist() == [3, 4, 5, 6, 11, 12, 13, 14]
    assert out["padding_mask"][0].tolist() == [False, False, True, True, False, False, True, True]
    assert out["padding_mask"][1].tolist() == [False, False, False, True, False] + [False] * 3
    assert out["max_seqlen"].tolist() == [8, 8] and (out["cp_size"], out["cp_rank"]) == (2, 1)


def test_pp_chunks_need_divisible_rows_and_leave_bshd_alone():
    with pytest.raises(ValueError, match="num_chunks=3 must divide the batch's 4 rows"):
        shard(thd_batch([[4]] * 4, [[4]] * 4, 4, 4), num_chunks=3)
    raw = {"input_ids": torch.arange(12).view(2, 6), "labels": torch.arange(12).view(2, 6)}
    one = shard(dict(raw), cp=2, model=None)[2]
    many = shard(dict(raw), cp=2, model=None, num_chunks=4)[2]
    assert all(torch.equal(one[k], many[k]) for k in one)


# -- items 2, 8, 10: the raw [B, S] path ----------------------------------------------------------


def test_missing_positions_are_global_and_a_shared_row_expands():
    raw = {"input_ids": torch.arange(12).view(2, 6), "labels": torch.arange(12).view(2, 6)}
    for rank, expect in ((0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])):  # padded 6 -> 8, chunks of 2
        out = shard(dict(raw), cp=2, rank=rank, model=None)[2]
        assert out["position_ids"].tolist() == [expect, expect]
    shared = dict(raw, position_ids=torch.tensor([[10, 11, 12, 13, 14, 15]]))
    out = shard(shared, cp=2, rank=0, model=None)[2]
    assert out["position_ids"].tolist() == [[10, 11, 16, 17]] * 2  # [1, S] -> [B, S]; pads continue
    mrope = dict(raw, position_ids=torch.arange(6).repeat(3, 2, 1))
    out = shard(mrope, cp=2, rank=1, model=None)[2]
    assert out["position_ids"].shape == (3, 2, 4) and out["position_ids"][2, 1].tolist() == [2, 3, 4, 5]


def test_inputs_embeds_primary_is_sharded_differentiably():
    embeds = torch.randn(2, 6, 5, requires_grad=True)
    raw = {"inputs_embeds": embeds, "labels": torch.zeros(2, 6, dtype=torch.long)}
    s, _, out = shard(dict(raw), cp=2, rank=1, model=None)
    assert out["inputs_embeds"].shape == (2, 4, 5) and out["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert torch.equal(out["inputs_embeds"], embeds[:, 2:6])
    out["inputs_embeds"].sum().backward()
    assert embeds.grad[:, 2:6].eq(1).all() and embeds.grad[:, :2].eq(0).all()
    with pytest.raises(ValueError, match="exactly one of 'input_ids'"):
        shard(dict(raw, input_ids=torch.zeros(2, 6, dtype=torch.long)), cp=2, model=None)


def test_nemo_passthrough_keys_stay_unsharded():
    mm = torch.tensor([[0, 1, 1, 0, 0, 0]])
    vision = torch.tensor([[False, True, True, False, False, False]])
    pixels = torch.randn(2, 3, 4, 4)
    raw = {"input_ids": torch.arange(6).view(1, 6), "labels": torch.arange(6).view(1, 6),
           "mm_token_type_ids": mm, "_global_vision_mask": vision, "pixel_values": pixels}  # fmt: skip
    out = shard(raw, cp=2, model=None)[2]
    assert out["mm_token_type_ids"] is mm and out["_global_vision_mask"] is vision and out["pixel_values"] is pixels
    assert out["input_ids"].shape == (1, 4)


def test_identity_at_cp1_returns_the_callers_objects():
    batch = {"input_ids": torch.arange(6).view(1, 6), "labels": torch.arange(6).view(1, 6)}
    for mesh in (None, FakeMesh(1, 0)):
        s = ContextParallelSharder(SDPA_MODEL, mesh, batch)
        ctx, out = s.shard(batch)
        assert ctx is contextlib.nullcontext and out is batch and out["input_ids"] is batch["input_ids"]
        t = torch.randn(1, 6)
        assert s.gather_token_tensor(t) is t and torch.equal(s.shard_token_tensor(t), t)
        assert (s.shard_layout.original_seq_len, s.shard_layout.padded_seq_len) == (6, 6)
        assert torch.equal(s.gather_token_tensor(t, trim=True), t)


# -- items 5, 9: model hook and TE detection ------------------------------------------------------


def test_thd_batch_of_a_non_te_model_is_left_alone_at_cp1():
    batch = thd_batch([[2]], [[2]], 1, 2)
    _, ctx, out = shard(batch, model=SDPA_MODEL)
    assert out is batch and out["input_ids"].shape == (1, 2) and ctx is contextlib.nullcontext
    te_by_config = SimpleNamespace(config=SimpleNamespace(_attn_implementation="te"))
    assert shard(thd_batch([[2]], [[2]], 1, 2), model=te_by_config)[2]["input_ids"].shape == (2,)
    injected = SimpleNamespace(_te_attention_injected=True)
    assert shard(thd_batch([[2]], [[2]], 1, 2), model=injected)[2]["input_ids"].shape == (2,)


def test_thd_batch_of_a_non_te_model_goes_round_robin_at_cp2():
    batch = thd_batch([[4]], [[4]], 1, 4)
    s, _, out = shard(batch, cp=2, rank=0, model=SDPA_MODEL)
    assert out["input_ids"].tolist() == [[1, 4]] and s.shard_layout.original_seq_len == 4
    assert out["seq_lens"] is batch["seq_lens"]  # NeMo's generic path passes the THD metadata through


def test_model_hook_called_nemos_way_with_num_chunks():
    calls = []

    class Model:
        supports_thd = False

        def prepare_model_inputs_for_cp(self, batch, *, num_chunks=1):
            calls.append(num_chunks)
            own = direct(None, ShardLayout(padded_seq_len=4))
            return {"cp_sharder": own, "mm_token_type_ids": None, "image_grid_thw": torch.tensor([[1, 2, 2]])}

    batch = {"input_ids": torch.arange(4).view(1, 4), "mm_token_type_ids": torch.ones(1, 4)}
    s = ContextParallelSharder(Model(), FakeMesh(2, 0), batch, num_chunks=3)
    assert calls == [3] and "cp_sharder" not in batch and batch["mm_token_type_ids"] is None
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2]] and s.shard_layout.padded_seq_len == 4
    ContextParallelSharder(Model(), FakeMesh(1, 0), {"input_ids": torch.zeros(1, 4)})
    assert calls == [3]  # skipped at cp <= 1
    Model.supports_thd = True  # ... unless the model prepares THD itself
    ContextParallelSharder(Model(), FakeMesh(1, 0), {"input_ids": torch.zeros(1, 4), "qkv_format": "thd"})
    assert calls == [3, 1]


# -- items 6, 11: reported index maps and error types -------------------------------------------


def test_int32_row_index_map_from_a_backend_is_flattened():
    partition = torch.tensor([[0, 3, 4, 5, 10, 11]], dtype=torch.int32)  # TE's partition: int32 [1, N]

    def backend(cp_mesh, tp_mesh, batch, **kw):
        return contextlib.nullcontext, batch, ShardLayout(local_token_global_indices=partition, padded_seq_len=12)

    s = ContextParallelSharder(device_mesh=FakeMesh(2, 0), shard_batch=backend)
    s.shard({})
    assert s.shard_token_tensor(torch.arange(12.0), seq_dim=0).tolist() == [0.0, 3.0, 4.0, 5.0, 10.0, 11.0]


def test_notimplemented_compatible_errors():
    s = direct(FakeMesh(2, 0))
    for error in (NotImplementedError, ValueError):
        with pytest.raises(error, match="before the first shard"):
            s.shard_token_tensor(torch.zeros(1, 8))
        with pytest.raises(error, match="no shard layout to trim to"):
            direct(FakeMesh()).gather_token_tensor(torch.zeros(1, 4), trim=True)
