"""The worker's K/V exchange plan against a brute-force per-rank key need, and how batches carry it.

Brute force: rank ``dst`` needs every key ``k`` owned by another rank with
``slot_start(q) <= k <= q`` for some real query ``q`` on ``dst`` (in some bshd
row); a pad query (at or past its slot's real end) sees its own key only.
The plan must list exactly those keys, in increasing position per source rank,
and the sender's local indices must point at the same positions. Checked for any
permutation rows (the plan assumes nothing of the layout), every cpdata layout
through the real pipeline, and bshd rows sharing one layout.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpdata.adapters import document_causal_mask, flex_block_mask
from cpdata.device.kv_exchange import exchanged_key_positions
from cpdata.layout.exchange import RankExchange, exchange_plan, kv_recv_fraction, node_recv
from cpdata.layout.maps import rank_indices
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import StreamPlan
from cpdata.nodes.shard import ShardForRank
from tests.flat_options import records

CP_LAYOUTS = ("balanced", "contiguous", "round_robin", "thd")


def brute_need(rows: np.ndarray, slot_starts: list[int], n_rows: int, real_ends: list[int] | None = None
               ) -> dict[tuple[int, int], list[int]]:  # fmt: skip
    """``(src, dst) -> sorted global positions`` dst needs from src, one query at a time (``real_ends``:
    where each slot's real tokens end, None: all real)."""
    cp, local = rows.shape
    s = cp * local
    owner = np.empty(s, dtype=np.int64)
    owner[rows.reshape(-1)] = np.repeat(np.arange(cp), local)
    need: dict[tuple[int, int], set[int]] = {(a, b): set() for a in range(cp) for b in range(cp)}
    for b in range(n_rows):
        in_row = [i for i, x in enumerate(slot_starts) if b * s <= x < (b + 1) * s]
        starts = np.array([slot_starts[i] - b * s for i in in_row])
        ends = np.array([(slot_starts + [n_rows * s])[i + 1] if real_ends is None else real_ends[i]
                         for i in in_row]) - b * s  # fmt: skip
        for dst in range(cp):
            for q in rows[dst]:
                d = int(np.flatnonzero(starts <= q)[-1])
                if q >= ends[d]:
                    continue  # a pad query: its own key, local
                first = int(starts[d])
                for k in range(first, int(q) + 1):
                    if owner[k] != dst:
                        need[(int(owner[k]), dst)].add(k)
    return {pair: sorted(keys) for pair, keys in need.items()}


def check_against_brute(rows: np.ndarray, slot_starts: list[int], n_rows: int = 1,
                        real_ends: list[int] | None = None) -> int:  # fmt: skip
    """Assert the plan equals the brute force; return the keys it moves."""
    cp = rows.shape[0]
    plan = exchange_plan(rows, np.asarray(slot_starts), n_rows=n_rows, real_ends=real_ends)
    want = brute_need(rows, slot_starts, n_rows, real_ends)
    parts = [plan.rank(r) for r in range(cp)]
    counts = plan.recv_counts()
    moved = 0
    for dst, rx in enumerate(parts):
        got = rx.recv_positions()
        assert got.size == rx.n_recv == sum(rx.recv_counts)
        at = np.cumsum((0, *rx.recv_counts))
        for src in range(cp):
            keys = got[at[src] : at[src + 1]].tolist()
            assert keys == want[(src, dst)], (src, dst)
            assert counts[dst, src] == len(keys)
            sx = parts[src]
            sent = sx.send_index()
            so = np.cumsum((0, *sx.send_counts))
            assert rows[src][sent[so[dst] : so[dst + 1]]].tolist() == keys  # the i-th sent is the i-th received
            moved += len(keys)
        assert rx.recv_counts[dst] == 0 and rx.send_counts[dst] == 0
    return moved


@st.composite
def layouts(draw):
    cp = draw(st.integers(1, 4))
    local = draw(st.integers(1, 10))
    s = cp * local
    perm = np.array(draw(st.permutations(range(s))), dtype=np.int64).reshape(cp, local)
    rows = np.sort(perm, axis=1) if draw(st.booleans()) else perm
    n_rows = draw(st.integers(1, 3))
    starts = []
    for b in range(n_rows):
        cuts = draw(st.sets(st.integers(1, max(1, s - 1)), max_size=s - 1)) if s > 1 else set()
        starts += [b * s + c for c in sorted({0, *cuts})]
    nexts = [*starts[1:], n_rows * s]
    real_ends = [draw(st.integers(a, b)) for a, b in zip(starts, nexts, strict=True)] if draw(st.booleans()) else None
    return rows, starts, n_rows, real_ends


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_plan_equals_brute_force_for_any_permutation_rows(case):
    rows, starts, n_rows, real_ends = case
    check_against_brute(rows, starts, n_rows, real_ends)


@settings(max_examples=80, deadline=None)
@given(layouts())
def test_recv_fraction_and_node_split_count_what_each_rank_receives(case):
    """``kv_recv_fraction`` is the busiest receiver's keys over an all-gather's and ``node_recv`` splits every
    rank's received keys by the source's node, both against the brute-force needs (a rank's sends differ)."""
    rows, starts, n_rows, real_ends = case
    cp, local = rows.shape
    plan = exchange_plan(rows, np.asarray(starts), n_rows=n_rows, real_ends=real_ends)
    want = brute_need(rows, starts, n_rows, real_ends)
    recv = [sum(len(want[(src, dst)]) for src in range(cp)) for dst in range(cp)]
    assert kv_recv_fraction(plan) == (max(recv) / ((cp - 1) * local) if cp > 1 else 0.0)
    for node in (n for n in range(1, cp + 1) if cp % n == 0):
        intra, inter = node_recv(plan, node)
        near = [sum(len(want[(src, dst)]) for src in range(cp) if src // node == dst // node) for dst in range(cp)]
        assert intra.tolist() == near and (intra + inter).tolist() == recv


def test_recv_fraction_and_node_split_are_the_receivers_not_the_senders():
    """Contiguous, cp 3, 8 tokens a rank, documents [0, 6) and [6, 24): rank 1 receives 6-7 (2 keys) and rank 2
    receives 6-15 (10), while rank 0 sends 4 and rank 1 sends 8."""
    plan = exchange_plan(rank_indices("contiguous", 3, [6, 18], 24), [0, 6])
    assert kv_recv_fraction(plan) == 10 / 16
    assert [x.tolist() for x in node_recv(plan, 3)] == [[0, 2, 10], [0, 0, 0]]  # one node
    assert [x.tolist() for x in node_recv(plan, 1)] == [[0, 0, 0], [0, 2, 10]]  # a node a rank


def test_known_needs_contiguous_one_document_and_one_document_per_rank():
    rows = rank_indices("contiguous", 4, [32], 32)
    plan = exchange_plan(rows, [0])
    # one document over the pack: rank r needs everything before it, rank 0 nothing
    assert plan.recv_counts().sum(axis=1).tolist() == [0, 8, 16, 24]
    assert kv_recv_fraction(plan) == 1.0
    # four documents, one per rank: nothing moves
    plan = exchange_plan(rows, [0, 8, 16, 24])
    assert plan.recv_counts().sum() == 0 and kv_recv_fraction(plan) == 0.0
    # round_robin, one document: rank r holds chunks r and 7-r of 8; the last chunk's rank needs the rest
    rows = rank_indices("round_robin", 4, [32], 32)
    part = exchange_plan(rows, [0]).rank(0)  # rank 0 holds [0, 4) and [28, 32): needs [4, 28)
    assert part.recv_positions().tolist() == [*range(4, 8), *range(24, 28), *range(8, 12), *range(20, 24),
                                              *range(12, 20)]  # grouped by source rank 1, 2, 3
    assert part.recv_counts == (0, 8, 8, 8)


def _shards(layout: str, cp: int, qkv_format: str, batch_size: int, kv_exchange: bool = True):
    g = torch.Generator().manual_seed(cp + batch_size)
    docs = [{"input_ids": torch.randint(1, 50, (int(n),), generator=g).tolist()}
            for n in torch.randint(1, 60, (30,), generator=g)]  # fmt: skip
    graph = shard_graph(docs, GraphOptions(capacity=96, cp_size=cp, layout=layout, batch_size=batch_size, qkv_format=qkv_format, plan=StreamPlan(overflow="split")))  # fmt: skip
    return list(ShardForRank(graph, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True, kv_exchange=kv_exchange))


CASES = [(layout, cp, "thd", 1) for layout in CP_LAYOUTS for cp in (2, 3)]
CASES += [("balanced", 2, "thd", 3), ("thd", 4, "thd", 2), ("contiguous", 2, "bshd", 3), ("round_robin", 2, "bshd", 2)]


@pytest.mark.parametrize("layout,cp,qkv_format,batch_size", CASES)
def test_pipeline_plans_equal_brute_force_and_masks_cover_every_attended_key(layout, cp, qkv_format, batch_size):
    moved = 0
    for shards in _shards(layout, cp, qkv_format, batch_size)[:3]:
        rows = np.stack([s.layout.local_token_global_indices.numpy() for s in shards])
        docs = shards[0]["document_ids"]
        n_rows = docs.shape[0] if qkv_format == "bshd" else 1
        cu = shards[0]["cu_seqlens_padded"].numpy()
        real_ends = (cu[:-1] + np.diff(shards[0]["cu_seqlens"].numpy())).tolist()
        moved += check_against_brute(rows, cu[:-1].tolist(), n_rows, real_ends)
        row_of = np.searchsorted(cu[1:], np.arange(cu[-1]), side="right")  # each stream position's slot
        is_real = np.arange(cu[-1]) < np.asarray(real_ends)[row_of]
        for r, s in enumerate(shards):
            plan = s.layout.kv_exchange
            assert plan is not None and plan.cp_rank == r and plan.cp_size == cp
            full = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"], keys="global")
            mine = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
            k_pos = exchanged_key_positions(s.layout, "cpu")
            assert mine.shape[-1] == rows.shape[1] + plan.n_recv == k_pos.numel()
            assert torch.equal(mine, full[..., k_pos])  # the same predicate at the exchanged keys' positions
            # no key a real query attends is missing from the exchange (pad queries see their own key only)
            cols = rows[r] + np.arange(n_rows)[:, None] * rows.size if n_rows > 1 else rows[r][None]
            real_q = torch.from_numpy(is_real[cols])[:, None, :, None]  # [rows, 1, L, 1]
            assert int((mine & real_q).sum()) == int((full & real_q).sum())
    assert moved > 0


def test_flex_block_mask_over_exchanged_keys_matches_the_dense_mask():
    shards = _shards("balanced", 2, "thd", 2)[0]
    s = shards[1]
    dense = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
    bm = flex_block_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"], block_size=16)
    rows, _, local, keys = dense.shape
    assert keys == local + s.layout.kv_exchange.n_recv and s.layout.kv_exchange.n_recv > 0
    assert bm.shape == (rows, 1, local, keys)
    b, q, k = torch.arange(rows)[:, None, None], torch.arange(local)[None, :, None], torch.arange(keys)[None, None]
    assert torch.equal(bm.mask_mod(b, torch.zeros(()), q, k)[:, None], dense)


def test_plan_travels_with_the_batch_and_changes_nothing_else():
    with_plan = _shards("thd", 2, "thd", 1)[0]
    without = _shards("thd", 2, "thd", 1, kv_exchange=False)[0]
    for a, b in zip(with_plan, without, strict=True):
        assert b.layout.kv_exchange is None
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert a.info == b.info and a.layout.digest == b.layout.digest
        back = pickle.loads(pickle.dumps(a))  # a worker's batch: one storage, the plan by value
        assert np.array_equal(back.layout.kv_exchange.recv_runs, a.layout.kv_exchange.recv_runs)
        assert back.layout.kv_exchange.send_counts == a.layout.kv_exchange.send_counts
        assert a.to("cpu", copy=True).layout.kv_exchange is a.layout.kv_exchange


def test_runs_expand_and_bad_input():
    runs = np.array([[5, 2], [0, 0], [1, 3]])
    part = RankExchange(cp_size=2, cp_rank=0, send_counts=(0, 5), send_runs=runs, recv_counts=(0, 0),
                        recv_runs=np.zeros((0, 2), dtype=np.int64))  # fmt: skip
    assert part.send_index().tolist() == [5, 6, 1, 2, 3] and part.n_send == 5
    assert part.recv_positions().tolist() == [] and part.n_recv == 0
    rows = rank_indices("contiguous", 2, [], 8)
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        exchange_plan(rows, [1, 4])  # the row's first position starts no slot
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        exchange_plan(rows, [0, 0])
    with pytest.raises(ValueError, match="n_rows"):
        exchange_plan(rows, [0], n_rows=0)
    with pytest.raises(ValueError, match="rank must be"):
        exchange_plan(rows, [0]).rank(2)
    with pytest.raises(TypeError, match="^kv_exchange must be True or False, got str 'yes'$"):
        ShardForRank(None, cp_size=2, cp_rank=0, layout="thd", kv_exchange="yes")
    s = _shards("thd", 2, "thd", 1, kv_exchange=False)[0][0]
    with pytest.raises(ValueError, match="kv_exchange=True"):
        document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"], keys="exchange")


def test_build_loader_and_cpdataset_workers_carry_the_plan():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cpdata import CPDataset, build_loader

    docs = [{"input_ids": list(range(1, n + 1))} for n in (5, 40, 17, 33, 9, 60, 22)]
    kw = dict(capacity=64, cp_size=2, layout="balanced", overflow="split", qkv_format="thd")
    direct = list(build_loader(docs, **records(cp_rank=1, kv_exchange=True, pin_memory=False, **kw)))
    loader = StatefulDataLoader(CPDataset(docs, **records(cp_rank=1, kv_exchange=True, **kw)), batch_size=None, num_workers=1)
    served = list(loader)
    assert len(served) == len(direct) >= 2
    for a, b in zip(direct, served, strict=True):
        pa, pb = a.layout.kv_exchange, b.layout.kv_exchange
        assert pa is not None and pb is not None and pa.cp_rank == pb.cp_rank == 1
        assert pa.recv_counts == pb.recv_counts and np.array_equal(pa.recv_runs, pb.recv_runs)
        assert np.array_equal(pa.send_runs, pb.send_runs)
    assert all(b.layout.kv_exchange is None for b in build_loader(docs, **records(cp_rank=1, pin_memory=False, **kw)))


def test_hf_sdpa_kwargs_keep_the_global_key_mask_the_ctx_takes():
    from transformers import LlamaConfig

    from cpdata.adapters import hf_model_kwargs
    from cpdata.device.cp_attention import ContextParallelAttention

    s = _shards("balanced", 2, "thd", 1)[0][1]
    assert s.layout.kv_exchange is not None
    with ContextParallelAttention(s.layout, None, check_every=0, require_calls=False):  # sdpa at cp 2: inside the ctx
        kwargs = hf_model_kwargs(s, attn_implementation="sdpa", num_items_in_batch=1, config=LlamaConfig())
    mask = kwargs["attention_mask"]
    assert mask.shape[-1] == s.layout.padded_seq_len  # over all S keys, as the ctx's attn_mask path expects


def test_inverse_map_entry_checks_and_cp1():
    from cpdata.layout.exchange import exchange_plan_of_inverse

    with pytest.raises(ValueError, match="multiple of cp_size=3"):
        exchange_plan_of_inverse(np.arange(8), 3, [0])
    with pytest.raises(ValueError, match="cp_size must be"):
        exchange_plan_of_inverse(np.arange(8), 0, [0])
    with pytest.raises(ValueError, match="rows must hold positions"):
        exchange_plan(np.array([[0, 1], [2, 9]]), [0])
    (s,) = _shards("identity", 1, "thd", 1)[0]
    plan = s.layout.kv_exchange
    assert plan.n_recv == plan.n_send == 0 and plan.recv_counts == (0,)
    mask = document_causal_mask(s.layout, s["document_ids"], s["cu_seqlens_padded"])
    assert mask.shape[-1] == s["document_ids"].shape[-1]


@st.composite
def block_layouts(draw):
    """A tiled-like layout: ``tile``-token blocks dealt to ranks (equal counts), any local order of them."""
    cp, tile, per_rank = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    blocks = cp * per_rank
    owner = np.array(draw(st.permutations(np.repeat(np.arange(cp), per_rank).tolist())), dtype=np.int64)
    rows, run_local = [], np.empty(blocks, dtype=np.int64)
    for r in range(cp):
        mine = np.flatnonzero(owner == r)
        order = np.array(draw(st.permutations(range(per_rank))), dtype=np.int64)
        run_local[mine[order]] = np.arange(per_rank) * tile
        rows.append(np.concatenate([np.arange(b * tile, (b + 1) * tile) for b in mine[order]]))
    s = blocks * tile
    cuts = draw(st.sets(st.integers(1, max(1, s - 1)), max_size=s - 1)) if s > 1 else set()
    return np.stack(rows), np.arange(blocks) * tile, owner, run_local, sorted({0, *cuts})


@settings(max_examples=100, deadline=None)
@given(block_layouts())
def test_plan_of_runs_equals_the_plan_of_rows(case):
    from cpdata.layout.exchange import exchange_plan_of_runs

    rows, run_starts, owners, run_local, slots = case
    cp, local = rows.shape
    a = exchange_plan(rows, slots)
    b = exchange_plan_of_runs(run_starts, owners, run_local, cp_size=cp, local_len=local, slot_starts=slots)
    assert np.array_equal(a.recv_counts(), b.recv_counts())
    for r in range(cp):
        x, y = a.rank(r), b.rank(r)
        assert np.array_equal(x.recv_positions(), y.recv_positions()) and x.recv_counts == y.recv_counts
        assert np.array_equal(x.send_index(), y.send_index()) and x.send_counts == y.send_counts


def test_plan_of_runs_refuses_runs_that_do_not_tile_the_ranks():
    from cpdata.layout.exchange import exchange_plan_of_runs

    with pytest.raises(ValueError, match="tile its local order"):  # rank 0's two runs both start at local 0
        exchange_plan_of_runs([0, 2, 4, 6], [0, 0, 1, 1], [0, 0, 0, 2], cp_size=2, local_len=4, slot_starts=[0])
    with pytest.raises(ValueError, match="increasing global starts"):
        exchange_plan_of_runs([0, 4, 2], [0, 1, 1], [0, 0, 2], cp_size=2, local_len=4, slot_starts=[0])


def test_plan_of_runs_checked_path_equals_the_checked_one():
    from cpdata.layout.exchange import exchange_plan_of_runs

    starts, owners, local = (np.array(x, dtype=np.int64) for x in ([0, 4, 8, 12], [1, 0, 0, 1], [0, 0, 4, 4]))
    slots = np.array([0, 6, 11], dtype=np.int64)
    a = exchange_plan_of_runs(starts, owners, local, cp_size=2, local_len=8, slot_starts=slots)
    b = exchange_plan_of_runs(starts, owners, local, cp_size=2, local_len=8, slot_starts=slots, checked=True)
    assert np.array_equal(a.need, b.need) and np.array_equal(a.starts, b.starts) and a.need.sum() > 0
    with pytest.raises(ValueError, match="local_len must be"):
        exchange_plan_of_runs(starts, owners, local, cp_size=2, local_len=0, slot_starts=slots)


def test_exchange_tokens_refuses_a_tensor_of_another_length():
    """The plan's send indices address this rank's ``L`` local tokens: a tensor of ``L + 1`` (another batch, or
    the wrong ``seq_dim``) is refused before any collective, not exchanged from the wrong rows."""
    from cpdata.device.kv_exchange import exchange_tokens
    from cpdata.layout.shard_layout import ShardLayout

    rows = rank_indices("contiguous", 2, np.array([6, 2]), 8)
    layout = ShardLayout(local_token_global_indices=torch.from_numpy(rows[1]), padded_seq_len=8, cp_size=2,
                         cp_rank=1, kv_exchange=exchange_plan(rows, [0, 6]).rank(1))  # fmt: skip
    assert layout.kv_exchange.n_recv > 0  # rank 1's queries of the first document need rank 0's keys
    with pytest.raises(ValueError, match=r"tensor has 5 tokens on dim 1 but the layout holds 4 local positions"):
        exchange_tokens(torch.zeros(1, 5, 3), layout)
    with pytest.raises(ValueError, match=r"tensor has 3 tokens on dim 2"):
        exchange_tokens(torch.zeros(1, 4, 3), layout, seq_dim=2)
