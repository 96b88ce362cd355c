"""The varlen kernel path of the "cpdata" attention on CPU: its reference, its segments, its tile count, its choice.

torch's ``varlen_attn`` has no CPU kernel, so the path is checked in layers:
the reference (:func:`cpdata.device.varlen.reference_varlen_attn`) against a brute-force
masked attention; the plan's segments, ``cu_seq_q`` / ``cu_seq_k`` and key
gather against the dense document-causal mask on every layout (exchanged and
all-gathered keys, windows); the per-segment tile counter against a brute-force
count; and the model zoo at cp 1 through the reference swapped in for torch's
kernel against each document alone (cp 2 and 4: tests/test_varlen_dist.py).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.attention.varlen as torch_varlen

from cpdata.adapters import hf_model_kwargs, register_hf_attention
from cpdata.device import varlen
from cpdata.device.attention_masks import dense_mask, document_slots
from cpdata.device.kv_exchange import exchanged_key_positions
from cpdata.device.varlen import reference_varlen_attn, segment_mask
from cpdata.layout.maps import layout_runs
from cpdata.layout.tiles import query_runs, segment_tiles, varlen_live_tiles
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests import hf_zoo
from tests.hf_zoo import FAMILIES, alone_reference, build, grads, max_rel_error

LAYOUTS = ("contiguous", "round_robin", "thd", "balanced", "tiled")
FALLBACK = {"gemma2": "softcap", "gpt_oss": "sinks"}  # families whose every layer the varlen API cannot compute


def _brute(q, k, v, cu_q, cu_k, scale, window_size):
    """Attention of every query over every key with a dense [Tq, Tk] mask written pair by pair."""
    left, right = window_size
    keep = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        sq, sk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(sq):
            for j in range(sk):
                ok = (right < 0 or j <= i + sk - sq + right) and (left < 0 or j >= i + sk - sq - left)
                keep[cu_q[s] + i, cu_k[s] + j] = ok
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhe,khe->hqk", q, k) * scale
    p = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khe->qhe", p, v), int(keep.sum())


@pytest.mark.parametrize("window_size", [(-1, 0), (3, 0), (0, 0), (-1, -1), (2, 1)])
def test_reference_equals_brute_force_masked_attention(window_size):
    g = torch.Generator().manual_seed(1)
    sq, extra = [5, 1, 17, 8, 3], [0, 6, 2, 30, 0]
    cu_q = np.concatenate([[0], np.cumsum(sq)]).tolist()
    cu_k = np.concatenate([[0], np.cumsum(np.add(sq, extra))]).tolist()
    q = torch.randn(cu_q[-1], 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(cu_k[-1], 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(cu_k[-1], 2, 6, generator=g, dtype=torch.float64)
    out = reference_varlen_attn(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), max(sq), max(np.add(sq, extra)),
                                scale=0.3, window_size=window_size, enable_gqa=True)  # fmt: skip
    ref, live = _brute(q, k, v, cu_q, cu_k, 0.3, window_size)
    assert live > 0 and out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), (out - ref).abs().max()
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_varlen_attn(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), 99, 99)


def _brute_tiles(q_len: int, k_len: int, tile: int, window: int | None) -> int:
    keep = segment_mask(q_len, k_len, (-1 if window is None else window - 1, 0)).numpy()
    nq, nk = -(-q_len // tile), -(-k_len // tile)
    padded = np.zeros((nq * tile, nk * tile), dtype=bool)
    padded[:q_len, :k_len] = keep
    return int(padded.reshape(nq, tile, nk, tile).any(axis=(1, 3)).sum())


@pytest.mark.parametrize("window", [None, 5, 40])
def test_segment_tiles_equal_a_brute_force_count(window):
    rng = np.random.default_rng(0)
    q_len = rng.integers(1, 90, 60)
    k_len = q_len + rng.integers(0, 70, 60) * (rng.random(60) < 0.6)
    for tile in (8, 16):
        got = segment_tiles(q_len, k_len, tile, window)
        want = [_brute_tiles(int(a), int(b), tile, window) for a, b in zip(q_len, k_len, strict=True)]
        assert got.tolist() == want
    # a whole document of n tokens: its own causal triangle of ceil(n / tile) blocks
    n = np.array([1, 16, 17, 200])
    assert segment_tiles(n, n, 16).tolist() == [(b * (b + 1)) // 2 for b in -(-n // 16)]
    for tile, window, message in ((0, None, r"^tile must be an int >= 1, got 0$"),
                                  (16.0, None, r"^tile must be an int >= 1, got float 16.0$"),
                                  (16, 0, r"^window must be an int >= 1 or None, got 0 \(None: no window\)$")):
        with pytest.raises(ValueError, match=message):
            segment_tiles(n, n, tile, window)


def _segments_brute(pos, start):
    """Runs cut token by token: a new run where the position is not the previous + 1 or the document changes."""
    out = []
    for i, (p, s) in enumerate(zip(pos.tolist(), start.tolist(), strict=True)):
        if i and p == pos[i - 1] + 1 and s == start[i - 1]:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_live_tiles_sum_each_ranks_runs(layout):
    rng = np.random.default_rng(2)
    pack, cp, tile = 512, 4, 16
    spec = "tiled:64" if layout == "tiled" else layout
    for _ in range(4):
        lens = rng.integers(1, 120, 12)
        lens = -(-lens // (2 * cp)) * (2 * cp) if layout == "thd" else lens  # thd: slots of 2*cp multiples
        lens = lens[np.cumsum(lens) <= pack - 40]
        rows = layout_runs(spec, cp, lens, pack).rows()
        whole = np.append(lens[:-1], pack - lens[:-1].sum())  # the tail padding joins the last slot
        doc_start = np.repeat(np.cumsum(whole) - whole, whole)  # each position's slot start
        want = []
        for row in rows:
            start = doc_start[row]
            runs = _segments_brute(row, start)
            assert [list(r) for r in zip(*query_runs(row, start), strict=True)] == runs
            want.append(sum(_brute_tiles(n, int(row[i + n - 1] - start[i] + 1), tile, None) for i, n in runs))
        assert varlen_live_tiles(rows, lens, pack, tile).tolist() == want
        one = varlen_live_tiles(np.arange(pack)[None], lens, pack, tile)[0]
        assert one == sum((b * (b + 1)) // 2 for b in -(-whole // tile)) and sum(want) >= one


@pytest.mark.parametrize("tile", [32, 128, 512])
def test_pad_free_counts_the_tiles_of_the_kernels_own_segments(tile):
    """varlen_live_tiles(pad_free=True) against the segments varlen_plan hands the kernel, each segment's tiles
    counted by segment_tiles: world step packs (owners from the packer, pad last on each rank) with runs of
    pad both shorter and longer than PAD_CHUNK, at tiles under, equal to and over it."""
    from cpdata.bench.world import step_packs
    from cpdata.layout.world_step import owned_runs

    world, local = 8, 2048
    packs, _ = step_packs("sft", world, local, 3)
    pad_runs = []
    for lens, owners in packs:
        starts, lengths, ranks = owned_runs(lens, owners, world * local, world)
        real_end = int(lens.sum())
        slot_start, slot_end = np.repeat(np.cumsum(lens) - lens, lens), np.repeat(np.cumsum(lens), lens)
        rows = []
        for r in range(world):
            row = np.concatenate([np.arange(a, a + n) for a, n, o in zip(starts, lengths, ranks, strict=True)
                                  if o == r])  # fmt: skip
            rows.append(row)
            real = row < real_end
            inside = np.minimum(row, real_end - 1)
            start = np.where(real, slot_start[inside], real_end)  # pads: a run of their own from the real end
            end = np.where(real, slot_end[inside], real_end)
            pad_runs.append(int((~real).sum()))
            everything = torch.arange(world * local)
            plan = varlen.varlen_plan(torch.as_tensor(start)[None], torch.as_tensor(row), everything, window=None,
                                      device=torch.device("cpu"), end=torch.as_tensor(end)[None])  # fmt: skip
            q_len, k_len = np.diff(plan.cu_seq_q.numpy()), np.diff(plan.cu_seq_k.numpy())
            paid = int(segment_tiles(q_len, k_len, tile).sum())
            assert varlen_live_tiles(row[None], lens, world * local, tile, pad_free=True)[0] == paid, (r, tile)
        assert varlen_live_tiles(np.stack(rows), lens, world * local, tile, pad_free=True).shape == (world,)
    assert any(0 < n < varlen.PAD_CHUNK for n in pad_runs) and max(pad_runs) > 2 * varlen.PAD_CHUNK


def _batches(cp: int, layout: str, exchange: bool, pack_min_docs: int = 3) -> tuple:
    spec = "tiled:64" if layout == "tiled" else layout
    graph = shard_graph(hf_zoo.docs(), GraphOptions(capacity=64 * cp, cp_size=cp, layout=spec,
                        qkv_format="thd" if layout == "thd" else "bshd", plan=StreamPlan(overflow="split")))  # fmt: skip
    shards = ShardForRank(graph, cp_size=cp, cp_rank=0, layout=spec, all_ranks=True, kv_exchange=exchange)
    for batches in shards:
        if batches[0].info["n_documents"] >= pack_min_docs:
            return batches
    raise AssertionError("no pack with enough documents")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_segments_and_key_gather_give_the_dense_document_causal_mask(layout, monkeypatch):
    """Every (query, key position) pair the plan's segments attend is one the dense mask keeps, and no other
    (balanced's one-query segments included: the copy limit is lifted); every key gathered is attended."""
    monkeypatch.setattr(varlen, "MAX_KEY_COPIES", 10**9)
    checked = pads_seen = 0
    for cp in (2, 4):
        for exchange in (False, True):
            for batch in _batches(cp, layout, exchange):
                slots = document_slots(batch.layout, batch["document_ids"].reshape(1, -1),
                                       batch["cu_seqlens_padded"], batch["cu_seqlens"])  # fmt: skip
                start, pos, row_len = slots.start, slots.pos, slots.row_len
                real = pos < slots.end[0]
                keys = exchanged_key_positions(batch.layout, "cpu") if exchange else torch.arange(row_len)
                for window in (None, 1, 6):
                    plan = varlen.varlen_plan(start, pos, keys, window=window, device=torch.device("cpu"),
                                              end=slots.end)  # fmt: skip
                    got = torch.zeros(pos.numel(), row_len, dtype=torch.bool)
                    cq, ck = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
                    assert cq[-1] == pos.numel() and ck[-1] == plan.key_index.numel()
                    for s in range(len(cq) - 1):
                        sq, sk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
                        assert sq <= plan.max_q and sk <= plan.max_k
                        kpos = keys[plan.key_index[ck[s] : ck[s + 1]]]
                        assert kpos.unique().numel() == sk  # each key once per segment
                        seen = segment_mask(sq, sk, plan.window_size)
                        assert seen.any(dim=0).all(), "a gathered key no query of its segment attends"
                        qi, kj = seen.nonzero(as_tuple=True)
                        assert not got[cq[s] + qi, kpos[kj]].any()
                        got[cq[s] + qi, kpos[kj]] = True
                    dense = dense_mask(*slots.intervals(window=window), keys)[0, 0]
                    want = torch.zeros_like(got)
                    qi, kj = dense.nonzero(as_tuple=True)
                    want[qi, keys[kj]] = True
                    assert torch.equal(got[real], want[real]), (layout, cp, exchange, window)
                    # a pad query: its own key, and otherwise only pads of its own piece (one tile), no real key
                    qi, kg = got[~real].nonzero(as_tuple=True)
                    pad_pos = pos[~real]
                    assert got[~real][torch.arange(pad_pos.numel()), pad_pos].all()
                    assert (kg <= pad_pos[qi]).all() and (kg > pad_pos[qi] - varlen.PAD_CHUNK).all()
                    assert not got[~real][:, pos[real]].any()
                    pads_seen += int((~real).sum())
                    checked += int(plan.cu_seq_q.numel() > 2)
    assert checked > 0 and pads_seen > 0


def test_plan_refuses_keys_the_rank_does_not_hold():
    start, pos = torch.tensor([[0, 0, 0]]), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="not among"):
        varlen.varlen_plan(start, pos, torch.tensor([0, 2]), window=None, device=torch.device("cpu"))



def test_a_pad_run_longer_than_a_tile_is_cut_into_tiles_of_its_own_keys():
    """A slot of 10 real tokens and 390 pads, then a 20-token document: each query in exactly one segment;
    a real query attends its slot's prefix, a pad the pads of its own ``PAD_CHUNK`` piece counted from the
    slot's first pad, up to itself (brute force over every pair)."""
    chunk = varlen.PAD_CHUNK
    n_pad = 3 * chunk + 6  # three whole pieces and a ragged one
    slot_start = torch.tensor([0] * (10 + n_pad) + [10 + n_pad] * 20)
    end = torch.tensor([10] * (10 + n_pad) + [30 + n_pad] * 20)
    n = slot_start.numel()
    pos = torch.arange(n)
    plan = varlen.varlen_plan(slot_start[None], pos, pos, window=None, device=torch.device("cpu"), end=end[None])
    got = torch.zeros(n, n, dtype=torch.int64)
    cq, ck = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
    assert cq[-1] == n
    for s in range(len(cq) - 1):
        sq, sk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        qi, kj = segment_mask(sq, sk, plan.window_size).nonzero(as_tuple=True)
        got[cq[s] + qi, plan.key_index[ck[s] : ck[s + 1]][kj]] += 1
    want = torch.zeros(n, n, dtype=torch.int64)
    for q in range(n):
        first = int(slot_start[q]) if q < end[q] else int(end[q]) + (q - int(end[q])) // chunk * chunk
        want[q, first : q + 1] = 1
    assert torch.equal(got, want)
    assert plan.max_q == chunk and len(cq) - 1 == 1 + 4 + 1  # the real run, four pad pieces, the document

def test_kernel_choice_and_its_logged_fallbacks(caplog, monkeypatch):
    monkeypatch.setattr(varlen, "_LOGGED", set())
    cuda, cpu, bf16, f32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    choose = varlen.choose_kernel
    with caplog.at_level(logging.WARNING, logger="cpdata.device.varlen"):
        assert choose("auto", softcap=None, sinks=None, device=cuda, dtype=bf16) == "varlen"
        assert choose("auto", softcap=None, sinks=None, device=cpu, dtype=f32) == "dense"
        assert choose("varlen", softcap=None, sinks=None, device=cpu, dtype=f32) == "varlen"
        assert choose("flex", softcap=None, sinks=None, device=cuda, dtype=bf16) == "flex"
        assert not caplog.records
        assert choose("auto", softcap=0.5, sinks=None, device=cuda, dtype=bf16) == "flex"
        assert choose("varlen", softcap=0.5, sinks=None, device=cuda, dtype=bf16) == "flex"
        assert choose("varlen", softcap=0.5, sinks=None, device=cpu, dtype=f32) == "dense"
        assert choose("varlen", softcap=None, sinks=torch.zeros(2), device=cuda, dtype=bf16) == "flex"
        assert choose("varlen", softcap=None, sinks=None, device=cuda, dtype=f32) == "flex"
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "cpdata attention: logit softcap (varlen_attn has no score modifier)",
        "cpdata attention: attention sinks (varlen_attn has no sink logits)",
        "cpdata attention: torch.float32 on CUDA (flash takes float16 / bfloat16)",
    ]
    with pytest.raises(ValueError, match="kernel='ring'"):
        choose("ring", softcap=None, sinks=None, device=cpu, dtype=f32)


def test_a_layout_cutting_documents_token_by_token_falls_back(caplog, monkeypatch):
    """balanced makes one segment per query, each re-reading its document's prefix: past MAX_KEY_COPIES times
    the keys held the plan is refused and the call falls back (logged); tiled's plan of the pack stays varlen."""
    monkeypatch.setattr(varlen, "_LOGGED", set())
    # these 64-token shards cut documents into short runs (1.4-1.8x the keys held: pads re-read nothing); a
    # limit of 1.25x stands in for the default 4x that 32K packs of short documents under balanced exceed
    monkeypatch.setattr(varlen, "MAX_KEY_COPIES", 1.25)
    chosen, copies = {}, {}
    for layout in ("balanced", "tiled"):
        batch = _batches(4, layout, True)[1]
        slots = document_slots(batch.layout, batch["document_ids"].reshape(1, -1), batch["cu_seqlens_padded"],
                               batch["cu_seqlens"])  # fmt: skip
        keys = exchanged_key_positions(batch.layout, "cpu")

        def plan(slots=slots, keys=keys):
            return varlen.varlen_plan(slots.start, slots.pos, keys, window=None, device=torch.device("cpu"),
                                      end=slots.end)  # fmt: skip

        with caplog.at_level(logging.WARNING, logger="cpdata.device.varlen"):
            chosen[layout] = varlen.choose_kernel("varlen", softcap=None, sinks=None, device=torch.device("cpu"),
                                                  dtype=torch.float64, plan=plan)  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(varlen, "MAX_KEY_COPIES", 10**9)
            copies[layout] = plan().key_index.numel() / keys.numel()
    assert copies["balanced"] > varlen.MAX_KEY_COPIES and copies["tiled"] <= 1.25, copies
    assert chosen == {"balanced": "dense", "tiled": "varlen"}
    assert len(caplog.records) == 1 and "runs on this rank" in caplog.records[0].getMessage()


def test_a_refused_plan_is_planned_once_per_batch_and_every_layer_falls_back(monkeypatch):
    """The "cpdata" attention asks for the varlen plan at every layer; a refused one is kept with the batch's
    masks, so later layers fall back without re-planning (O(L) host work each)."""
    from cpdata.adapters import hf_attention
    from cpdata.device import cp_attention

    register_hf_attention()
    monkeypatch.setattr(varlen, "MAX_KEY_COPIES", 1.25)  # balanced's 64-token shards gather 1.4-1.8x their keys
    calls = []

    def counting_plan(*args, **kwargs):
        calls.append(1)
        return varlen.varlen_plan(*args, **kwargs)

    monkeypatch.setattr(cp_attention, "varlen_plan", counting_plan)
    batch = _batches(4, "balanced", True)[1]
    state = hf_attention.attention_state("cpdata", batch.layout, batch["document_ids"].reshape(1, -1),
                                         batch["cu_seqlens_padded"], batch["cu_seqlens"])  # fmt: skip
    for _ in range(3):  # three layers
        with pytest.raises(varlen.KeyCopiesError):
            state.mask("varlen", None, torch.device("cpu"))
    assert len(calls) == 1


class CountingReference:
    """torch's ``varlen_attn`` stand-in: the reference, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return reference_varlen_attn(*args, **kwargs)


def test_zoo_at_cp1_through_varlen_equals_each_document_alone(monkeypatch, caplog):
    kernel = CountingReference()
    monkeypatch.setattr(torch_varlen, "varlen_attn", kernel)
    monkeypatch.setattr(varlen, "_LOGGED", set())
    register_hf_attention("cpdata_varlen", kernel="varlen")
    graph = shard_graph(hf_zoo.docs(), GraphOptions(capacity=64, cp_size=1, layout="identity",
                                                plan=StreamPlan(overflow="split")))
    batches = next(b for b in ShardForRank(graph, cp_size=1, cp_rank=0, layout="identity", all_ranks=True)
                   if b[0].info["n_documents"] >= 3)  # fmt: skip
    full = {key: batches[0][key].reshape(-1) for key in ("input_ids", "position_ids", "labels", "document_ids",
                                                         "padding_mask")}  # fmt: skip
    worst = {}
    for family in FAMILIES:
        model = build(family, "cpdata_varlen")
        before = kernel.calls
        with caplog.at_level(logging.WARNING, logger="cpdata.device.varlen"):
            out = model(**hf_model_kwargs(batches[0], "cpdata_varlen"))
            out.loss.backward()
        calls = kernel.calls - before
        if family in FALLBACK:
            assert calls == 0 and any(FALLBACK[family] in r.getMessage() for r in caplog.records), family
        else:
            assert calls == model.config.num_hidden_layers, (family, calls)
        ref_loss, ref_grad, n_docs = alone_reference(build(family, "eager"), full)
        worst[family] = max_rel_error(out.loss.item(), grads(model), ref_loss, ref_grad)
        assert worst[family] < 1e-6 and n_docs >= 3, (family, worst[family])
    print("cp 1, varlen: max relative error per family: " + ", ".join(f"{f} {e:.1e}" for f, e in worst.items()))


def test_bench_attention_rows_count_varlen_tiles_per_segment():
    """The bench's varlen columns: token-level balance cuts documents into one-token segments, each paying a tile;
    tiled keeps a document's blocks together (sft, 32K at cp 4, two packs)."""
    from cpdata.bench.attention import _cell

    rows = {layout: _cell("sft", 32768, 4, layout, (128,), 2, 1)[0] for layout in ("balanced", "tiled")}
    tiled, balanced = rows["tiled"], rows["balanced"]
    assert 1.0 <= tiled["varlen_max_over_ideal"] < 1.3 < 1.5 < balanced["varlen_max_over_ideal"], rows
    assert tiled["varlen_max_over_flex_ideal"] > 0.5
