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
from cpdata.layout.causal_tiles import segment_tiles
from cpdata.layout.maps import layout_runs
from cpdata.layout.tiles import PAD_CHUNK, query_runs, varlen_live_tiles
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


def _pad_pieces(pad: np.ndarray) -> int:
    """Brute force: the PAD_CHUNK pieces of pad positions in local order, cut where a position is not the
    previous + 1 and every PAD_CHUNK queries of a run."""
    runs = [1] if pad.size else []
    for a, b in zip(pad[:-1].tolist(), pad[1:].tolist(), strict=True):
        runs[-1:] = [runs[-1] + 1] if b == a + 1 else [runs[-1], 1]
    return sum(-(-n // PAD_CHUNK) for n in runs)


@pytest.mark.parametrize("tile", [32, 128, 512])
def test_pad_free_counts_the_tiles_of_the_kernels_own_segments(tile):
    """varlen_live_tiles(pad_free=True) against the segments varlen_plan hands the kernel, each segment's tiles
    counted by segment_tiles: world step packs (owners from the packer, pad last on each rank: left out) with
    runs of pad both shorter and longer than PAD_CHUNK, at tiles under, equal to and over it; and each row with
    its pad moved first (run: at tile 128 one diagonal tile per PAD_CHUNK piece more)."""
    from cpdata.bench.world import NODE_SIZE, step_packs
    from cpdata.layout.world_owners import owned_runs

    world, local = 8, 2048
    packs, _ = step_packs("sft", world, local, 3)
    pad_runs, everything, all_pad = [], torch.arange(world * local), 0
    for lens, owners in packs:
        starts, lengths, ranks = owned_runs(lens, owners, world * local, world, NODE_SIZE)
        real_end = int(lens.sum())
        slot_start, slot_end = np.repeat(np.cumsum(lens) - lens, lens), np.repeat(np.cumsum(lens), lens)
        rows = []
        for r in range(world):
            row = np.concatenate([np.arange(a, a + n) for a, n, o in zip(starts, lengths, ranks, strict=True)
                                  if o == r])  # fmt: skip
            rows.append(row)
            n_pad = int((row >= real_end).sum())
            pad_runs.append(n_pad)
            paid = {}
            for name, order in (("last", row), ("first", np.roll(row, n_pad))):
                real = order < real_end
                inside = np.minimum(order, real_end - 1)
                start = np.where(real, slot_start[inside], real_end)  # pads: a run of their own from the real end
                end = np.where(real, slot_end[inside], real_end)
                plan = varlen.varlen_plan(torch.as_tensor(start)[None], torch.as_tensor(order), everything,
                                          window=None, device=torch.device("cpu"),
                                          end=torch.as_tensor(end)[None])  # fmt: skip
                assert plan.queries == (row.size - n_pad if name == "last" or n_pad == row.size else row.size)
                q_len, k_len = np.diff(plan.cu_seq_q.numpy()), np.diff(plan.cu_seq_k.numpy())
                paid[name] = int(segment_tiles(q_len, k_len, tile).sum())
                assert varlen_live_tiles(order[None], lens, world * local, tile, pad_free=True)[0] == paid[name]
            moved = 0 < n_pad < row.size  # a row all pad has no pad but its trailing pad
            if tile == 128:  # a pad piece: one diagonal tile; the trailing pad: none
                assert paid["first"] - paid["last"] == moved * _pad_pieces(row[row >= real_end])
            assert paid["first"] >= paid["last"] + moved
            all_pad += n_pad == row.size
        assert varlen_live_tiles(np.stack(rows), lens, world * local, tile, pad_free=True).shape == (world,)
    assert any(0 < n < PAD_CHUNK for n in pad_runs) and max(pad_runs) > 2 * PAD_CHUNK, pad_runs
    assert sum(0 < n < local for n in pad_runs) > 8, (all_pad, pad_runs)


def test_pad_free_leaves_the_trailing_pad_out_and_counts_pad_elsewhere():
    """Two documents (100 and 60 tokens) in a pack of 1,000: the 840-token tail as a rank's last run costs nothing,
    the same run first or between the documents one diagonal tile per PAD_CHUNK piece (tile 128); pad_free=False
    counts the tail as one more document."""
    lens, pack, tile = np.array([100, 60]), 1000, 128
    doc_tiles = 1 + 1  # each document alone: one tile
    docs, pad = np.arange(160), np.arange(160, pack)
    pieces = -(-pad.size // PAD_CHUNK)
    assert pieces == 7
    for order, want in ((np.concatenate([docs, pad]), doc_tiles),
                        (np.concatenate([pad, docs]), doc_tiles + pieces),
                        (np.concatenate([docs[:100], pad, docs[100:]]), doc_tiles + pieces),
                        (np.concatenate([docs[:100], pad[:400], docs[100:], pad[400:]]), doc_tiles + 4)):  # fmt: skip
        assert varlen_live_tiles(order[None], lens, pack, tile, pad_free=True)[0] == want, order[:3]
    assert varlen_live_tiles(pad[None], lens, pack, tile, pad_free=True)[0] == 0  # a rank of pad only
    whole = -(-(60 + pad.size) // tile)  # the tail joins the last document
    assert varlen_live_tiles(np.arange(pack)[None], lens, pack, tile)[0] == 1 + whole * (whole + 1) // 2


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
    checked = pads_seen = trailing_seen = 0
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
                    kept = int(torch.nonzero(real)[-1]) + 1 if real.any() else 0  # up to the last real query
                    assert plan.queries == kept and (pos[kept:] >= slots.end[0, kept:]).all()
                    assert cq[-1] == kept and ck[-1] == plan.key_index.numel()
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
                    # a pad query before the last real one: its own key, and otherwise only pads of its own piece
                    # (one tile), no real key; the trailing pad: no segment at all
                    inner = ~real & (torch.arange(pos.numel()) < kept)
                    qi, kg = got[inner].nonzero(as_tuple=True)
                    pad_pos = pos[inner]
                    assert got[inner][torch.arange(pad_pos.numel()), pad_pos].all()
                    assert (kg <= pad_pos[qi]).all() and (kg > pad_pos[qi] - PAD_CHUNK).all()
                    assert not got[inner][:, pos[real]].any() and not got[kept:].any()
                    pads_seen += int(inner.sum())
                    trailing_seen += pos.numel() - kept
                    checked += int(plan.cu_seq_q.numel() > 2)
    # every layout leaves pad last on some rank; thd pads each document to 2cp, pad before a later document
    assert checked > 0 and trailing_seen > 0 and (pads_seen > 0) == (layout == "thd"), (pads_seen, trailing_seen)


def test_plan_refuses_keys_the_rank_does_not_hold():
    start, pos = torch.tensor([[0, 0, 0]]), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="not among"):
        varlen.varlen_plan(start, pos, torch.tensor([0, 2]), window=None, device=torch.device("cpu"))



def _attended(plan: varlen.VarlenPlan, n: int, key_pos: torch.Tensor) -> torch.Tensor:
    """int64 ``[n, max key + 1]``: how many times each local query attends each key position in the plan."""
    got = torch.zeros(n, int(key_pos.max()) + 1, dtype=torch.int64)
    cq, ck = plan.cu_seq_q.tolist(), plan.cu_seq_k.tolist()
    for s in range(len(cq) - 1):
        sq, sk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        qi, kj = segment_mask(sq, sk, plan.window_size).nonzero(as_tuple=True)
        got[cq[s] + qi, key_pos[plan.key_index[ck[s] : ck[s + 1]]][kj]] += 1
    return got


def _two_slots(n_pad: int, n_tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot start, real end)`` int64 ``[10 + n_pad + 20 + n_tail]``: a slot of 10 real tokens and ``n_pad``
    pads, then one of 20 real tokens and ``n_tail`` pads."""
    first, second = 10 + n_pad, 20 + n_tail
    return (torch.tensor([0] * first + [first] * second), torch.tensor([10] * first + [first + 20] * second))


def test_a_pad_run_longer_than_a_tile_is_cut_into_tiles_of_its_own_keys():
    """A slot of 10 real tokens and 390 pads, then a 20-token document and 150 pads: each query up to the last
    real one in exactly one segment; a real query attends its slot's prefix, a pad the pads of its own
    ``PAD_CHUNK`` piece counted from the slot's first pad, up to itself; the 150 trailing pads nothing (brute
    force over every pair). The plan is the one of the row without its trailing pad."""
    chunk, n_tail = PAD_CHUNK, 150
    n_pad = 3 * chunk + 6  # three whole pieces and a ragged one
    slot_start, end = _two_slots(n_pad, n_tail)
    n = slot_start.numel()
    pos = torch.arange(n)
    plan = varlen.varlen_plan(slot_start[None], pos, pos, window=None, device=torch.device("cpu"), end=end[None])
    want = torch.zeros(n, n, dtype=torch.int64)
    for q in range(n - n_tail):
        first = int(slot_start[q]) if q < end[q] else int(end[q]) + (q - int(end[q])) // chunk * chunk
        want[q, first : q + 1] = 1
    assert torch.equal(_attended(plan, n, pos), want) and want[n - n_tail - 1].sum() == 20
    assert plan.queries == n - n_tail == plan.cu_seq_q[-1]
    assert plan.max_q == chunk and plan.cu_seq_q.numel() - 1 == 1 + 4 + 1  # the real run, four pad pieces, the doc
    kept = n - n_tail
    cut = varlen.varlen_plan(slot_start[None, :kept], pos[:kept], pos, window=None, device=torch.device("cpu"),
                             end=end[None, :kept])  # fmt: skip
    assert cut.queries == kept and (cut.max_q, cut.max_k) == (plan.max_q, plan.max_k)
    for field in ("cu_seq_q", "cu_seq_k", "key_index"):
        assert torch.equal(getattr(plan, field), getattr(cut, field)), field
    # without ``end`` no query is pad: the pads attend their slot, every query is run
    whole = varlen.varlen_plan(slot_start[None], pos, pos, window=None, device=torch.device("cpu"))
    assert whole.queries == n == whole.cu_seq_q[-1] and whole.cu_seq_q.numel() == 3


def test_pad_between_real_queries_is_run_and_a_row_all_pad_runs_nothing():
    """Local order: the second slot's 150 pads, the first slot's 10 real tokens and 6 pads, the 20-token document:
    no pad is trailing, every query is run (each pad over its own piece). A row of the pads alone: queries 0, no
    segment, no key gathered."""
    slot_start, end = _two_slots(6, 150)
    n = slot_start.numel()
    order = torch.cat([torch.arange(36, n), torch.arange(36)])
    plan = varlen.varlen_plan(slot_start[None, order], order, torch.arange(n), window=None,
                              device=torch.device("cpu"), end=end[None, order])  # fmt: skip
    assert plan.queries == n == plan.cu_seq_q[-1]
    got = _attended(plan, n, torch.arange(n))
    for i, q in enumerate(order.tolist()):
        first = int(slot_start[q])  # a real query: its slot's prefix
        if q >= end[q]:  # a pad: its piece of PAD_CHUNK counted from its slot's first pad
            first = int(end[q]) + (q - int(end[q])) // PAD_CHUNK * PAD_CHUNK
        assert got[i].tolist() == [int(first <= k <= q) for k in range(n)], (i, q)
    pads = torch.cat([torch.arange(10, 16), torch.arange(36, n)])
    for window in (None, 4):
        none = varlen.varlen_plan(slot_start[None, pads], pads, torch.arange(n), window=window,
                                  device=torch.device("cpu"), end=end[None, pads])  # fmt: skip
        assert none.queries == 0 and none.cu_seq_q.tolist() == [0] == none.cu_seq_k.tolist()
        assert (none.max_q, none.max_k, none.key_index.numel()) == (0, 0, 0)


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


@pytest.mark.parametrize("window", [None, 5])
def test_varlen_attention_zeroes_the_trailing_pad_without_running_it(monkeypatch, window):
    """Through the reference kernel, float64: a row with pad between real queries and a trailing pad, keys held
    in shuffled order. Every row equals a brute-force masked attention (a real query over its slot's prefix, a
    pad before the last real query over its PAD_CHUNK piece, a trailing pad over no key: zeros, exactly); the
    gradients of q / k / v equal the brute force's, the loss over the real rows and over every row; the
    trailing pad's q gets none. A row all pad: zeros, the kernel not called, the zeros still on q / k / v's
    graph (so a rank of pad runs the K/V gather's backward collective like the others)."""
    kernel = CountingReference()
    monkeypatch.setattr(torch_varlen, "varlen_attn", kernel)
    slot_start, end = _two_slots(140, 150)  # slots [0, 150) real to 10, [150, 320) real to 170
    n, g = slot_start.numel(), torch.Generator().manual_seed(3)
    order = torch.cat([torch.arange(150, 170), torch.arange(10, 150), torch.arange(10), torch.arange(170, n)])
    key_pos = torch.randperm(n, generator=g)
    real, kept = order < end[order], 170
    assert not real[kept:].any() and real[kept - 1] and (~real[:kept]).sum() == 140
    plan = varlen.varlen_plan(slot_start[None, order], order, key_pos, window=window, device=torch.device("cpu"),
                              end=end[None, order])  # fmt: skip
    assert plan.queries == kept
    first = torch.where(order < end[order], slot_start[order],
                        end[order] + (order - end[order]) // PAD_CHUNK * PAD_CHUNK)  # fmt: skip
    if window is not None:
        first = torch.maximum(first, order - (window - 1))
    keep = (key_pos[None] >= first[:, None]) & (key_pos[None] <= order[:, None])
    keep[kept:] = False  # the trailing pad attends nothing

    def brute(q, k, v):
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = (q @ k.transpose(-1, -2)) * 0.25
        return scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0) @ v

    q = torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, n, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(1, 4, n, 6, generator=g, dtype=torch.float64)
    for rows in (real, torch.ones_like(real)):
        got_in, want_in = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
        calls = kernel.calls
        out = varlen.varlen_attention(*got_in, plan, scale=0.25)
        want = brute(*want_in)
        assert kernel.calls == calls + 1 and out.shape == want.shape == (1, 4, n, 6)
        assert torch.allclose(out, want, rtol=0, atol=1e-12), (out - want).abs().max()
        assert torch.equal(out[:, :, kept:], torch.zeros_like(out[:, :, kept:])) and out[:, :, :kept].abs().min() > 0
        (out * weight)[:, :, rows].sum().backward()
        (want * weight)[:, :, rows].sum().backward()
        for a, b in zip(got_in, want_in, strict=True):
            assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-12), (a.grad - b.grad).abs().max()
        assert not got_in[0].grad[:, :, kept:].any() and got_in[0].grad[:, :, real].any()
        assert not got_in[2].grad[:, :, key_pos >= 170].any()  # no query attends the trailing pad's keys
    pads = order[~real]
    none = varlen.varlen_plan(slot_start[None, pads], pads, key_pos, window=window, device=torch.device("cpu"),
                              end=end[None, pads])  # fmt: skip
    calls = kernel.calls
    inputs = [t.clone().requires_grad_() for t in (q[:, :, : pads.numel()], k, v)]
    out = varlen.varlen_attention(*inputs, none, scale=0.25)
    assert none.queries == 0 and kernel.calls == calls
    assert out.dtype == q.dtype and torch.equal(out, torch.zeros(1, 4, pads.numel(), 6, dtype=q.dtype))
    # still on the graph: backward reaches q, k and v (zeros), as it reaches the K/V gather's collective
    (out * weight[:, :, : pads.numel()]).sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in inputs)


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
