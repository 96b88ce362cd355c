"""Documents in, CP shards out, for any input: every token once (or counted), labels and positions exact.

One hypothesis case is a random corpus (lengths including 0 and longer than
the capacity, token ids from a tiny vocabulary so content often equals the
padding id), a capacity valid for the layout and CP size (every one of the 33
(layout, cp) pairs is a parametrized test that runs every time), an
overflow policy, a packing algorithm, a window, a DP shard, a batch size and
a qkv format. The pipeline is the library's own (``shard_graph`` +
``ShardForRank(all_ranks=True)``, one process). Every token carries its
provenance in an extra per-token array (``tag`` = document * TAG + position + 1;
extras pad with 0), and the checks compare against the input documents, not
against the packer's bookkeeping:

- each rank's shard is the full pack (``CollatedPack.tensors()``, the scatter
  path) at ``layout.local_token_global_indices``; concatenating the shards and
  indexing with ``layout.gather_index`` gives the full pack back (gather∘shard
  is the identity);
- real tokens are exactly the non-padding positions, equal the document's
  tokens, and their ``position_ids`` are their position in the document (so
  they restart per document and continue across split pieces); padding has
  the pad id, label -100, tag 0, and continues the slot's positions;
- labels are the next token of the same document piece, the document's next
  token at the end of a piece that continues, -100 at a document's (or a
  truncated document's) end, or the document's own labels where given;
- reconciliation with the input: every kept token appears exactly once over
  all packs and ranks; empty documents are skipped, overlong ones split,
  truncated, dropped or refused per policy, and the packer's counters match.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from dist_utils import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.nodes import BaseNode

from cpdata.device.consistency import verify_layout_consistency
from cpdata.gather import gather_token_tensor
from cpdata.layout.maps import LAYOUTS, alignment
from cpdata.nodes.loader import GraphOptions, build_node, shard_graph
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.shard import ShardForRank, layout_depends_on_documents
from cpdata.packing import ALGORITHMS, OVERFLOW_POLICIES
from cpdata.worker.keys import METADATA_KEYS
from tests.flat_options import graph_options, records

TAG = 1 << 16
TOKEN_KEYS = ("input_ids", "labels", "position_ids", "padding_mask", "document_ids", "tag")


class Tap(BaseNode):
    """Pass items through, keeping each (here: the ``CollatedPack`` a ``ShardForRank`` consumes)."""

    def __init__(self, source: BaseNode, sink: list) -> None:
        super().__init__()
        self.source, self.sink = source, sink

    def reset(self, initial_state=None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self):
        item = next(self.source)
        self.sink.append(item)
        return item

    def get_state(self):
        return self.source.state_dict()


PAIRS = [(layout, cp) for cp in range(1, 9) for layout in sorted(LAYOUTS) if cp == 1 or layout != "identity"]
"""Every (layout, cp) pair the API allows: 5 at cp 1, 4 at each cp 2..8 (33); each runs every time."""


@st.composite
def cases(draw, layout: str | None = None, cp: int | None = None) -> dict:
    """A random case; ``layout``/``cp`` fixed by the parametrization (drawn when None)."""
    if cp is None:
        cp = draw(st.integers(1, 8))
    if layout is None:
        layout = draw(st.sampled_from([name for name in LAYOUTS if cp == 1 or name != "identity"]))
    doc_multiple, pack_multiple = alignment(layout, cp)
    capacity = pack_multiple * draw(st.integers(1, max(2, 64 // pack_multiple)))
    batch_size = draw(st.integers(1, 3))
    fixed_map = not layout_depends_on_documents(layout, cp)
    qkv_format = draw(st.sampled_from(["bshd", "thd"])) if fixed_map or batch_size == 1 else "thd"
    short = st.integers(1, capacity)
    length = st.one_of(st.just(0), short, short, st.integers(capacity + 1, 2 * capacity + 3))
    dp_size = draw(st.integers(1, 2))
    return dict(
        cp=cp, layout=layout, capacity=capacity, batch_size=batch_size, qkv_format=qkv_format,
        algorithm=draw(st.sampled_from(ALGORITHMS)), overflow=draw(st.sampled_from(OVERFLOW_POLICIES)),
        window=draw(st.one_of(st.none(), st.integers(1, 6))),
        lengths=draw(st.lists(length, min_size=1, max_size=12)),
        padding_token_id=draw(st.sampled_from([0, 1, 3])),
        dp_size=dp_size, dp_rank=draw(st.integers(0, dp_size - 1)),
        labels=draw(st.sampled_from(["none", "some", "all"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


def make_docs(case: dict) -> list[dict]:
    rng = np.random.default_rng(case["seed"])
    docs = []
    for i, n in enumerate(case["lengths"]):
        doc = {"input_ids": rng.integers(0, 4, n), "tag": i * TAG + np.arange(n, dtype=np.int64) + 1}
        if case["labels"] == "all" or (case["labels"] == "some" and rng.random() < 0.5):
            doc["labels"] = np.where(rng.random(n) < 0.4, -100, rng.integers(0, 50, n))  # next-token targets
        docs.append(doc)
    return docs


def expected_tokens(case: dict, docs: list[dict]) -> tuple[dict[int, int], dict[str, int]]:
    """Per document of this DP shard, how many leading tokens must arrive; and the packer's counters."""
    doc_multiple = alignment(case["layout"], case["cp"])[0]
    cap = case["capacity"]
    keep: dict[int, int] = {}
    counts = dict(documents=0, skipped=0, truncated=0, dropped=0, truncated_tokens=0, dropped_tokens=0,
                  untrained=0, untrained_tokens=0)
    for i in range(case["dp_rank"], len(docs), case["dp_size"]):
        n = len(docs[i]["input_ids"])
        counts["documents"] += 1
        over = math.ceil(n / doc_multiple) * doc_multiple > cap
        truncated = over and case["overflow"] == "truncate"
        if n == 0:
            counts["skipped"] += 1
        elif over and case["overflow"] == "drop":
            counts["dropped"] += 1
            counts["dropped_tokens"] += n
        elif "labels" in docs[i] and not (docs[i]["labels"][: cap - 1 if truncated else n] != -100).any():
            counts["untrained"] += 1  # labels that train nothing (the truncated last token's target is cut off)
            counts["untrained_tokens"] += n
        elif over and case["overflow"] == "truncate":
            counts["truncated"] += 1
            counts["truncated_tokens"] += n - cap
            keep[i] = cap
        else:
            keep[i] = n
    return keep, counts


def first_overlong(case: dict, docs: list[dict], *, every_rank: bool = False) -> int | None:
    """The first document longer than the capacity: of this DP rank's shard, or of the whole source."""
    doc_multiple = alignment(case["layout"], case["cp"])[0]
    first, step = (0, 1) if every_rank else (case["dp_rank"], case["dp_size"])
    for i in range(first, len(docs), step):
        n = len(docs[i]["input_ids"])
        if math.ceil(n / doc_multiple) * doc_multiple > case["capacity"]:
            return i
    return None


def run_pipeline(case: dict, docs: list[dict]):
    collated = shard_graph(
        docs, GraphOptions(capacity=case["capacity"], cp_size=case["cp"], layout=case["layout"], padding_token_id=case["padding_token_id"], batch_size=case["batch_size"], qkv_format=case["qkv_format"], plan=StreamPlan(algorithm=case["algorithm"], overflow=case["overflow"], window=case["window"]), data=DataPolicy(dp_rank=case["dp_rank"], dp_size=case["dp_size"], labels_alignment="targets")),
    )  # fmt: skip
    packs: list = []
    node = ShardForRank(Tap(collated, packs), cp_size=case["cp"], cp_rank=0, layout=case["layout"], all_ranks=True)
    return node, packs, collated.source


def check_shards_against_the_full_pack(shards, full: dict[str, np.ndarray], cp: int) -> None:
    gather = shards[0].layout.gather_index
    local = [s.layout.local_token_global_indices for s in shards]
    assert [s.layout.cp_rank for s in shards] == list(range(cp))
    assert all(s.layout.cp_size == cp and torch.equal(s.layout.gather_index, gather) for s in shards)
    assert torch.equal(torch.cat(local)[gather], torch.arange(gather.numel())), "gather_index inverts the shards"
    for key in TOKEN_KEYS:
        want = torch.from_numpy(full[key])
        for s, idx in zip(shards, local, strict=True):
            assert torch.equal(s[key], want[..., idx]), f"rank {s.layout.cp_rank} {key} != full[..., local]"
        assert torch.equal(torch.cat([s[key] for s in shards], dim=-1)[..., gather], want), f"gather∘shard {key}"
    for key in METADATA_KEYS:
        assert all(np.array_equal(s[key].numpy(), full[key]) for s in shards), key


def check_stream(case: dict, docs: list[dict], full: dict[str, np.ndarray], keep: dict[int, int]) -> list:
    """Slot-by-slot checks of one full batch against the documents; returns its pieces."""
    flat = {k: full[k].reshape(-1) for k in TOKEN_KEYS}
    seq, slots = full["seq_lens"].astype(np.int64), full["seq_lens_padded"].astype(np.int64)
    starts = full["cu_seqlens_padded"][:-1].astype(np.int64)
    assert int(slots.sum()) == flat["input_ids"].size and (slots >= seq).all()
    assert np.array_equal(full["cu_seqlens"], np.concatenate([[0], np.cumsum(seq)]))
    doc_multiple = alignment(case["layout"], case["cp"])[0]
    pieces = []
    for k, (a, n, m) in enumerate(zip(starts.tolist(), seq.tolist(), slots.tolist(), strict=True)):
        tag = flat["tag"][a : a + m]
        assert (flat["document_ids"][a : a + m] == k).all()
        assert not flat["padding_mask"][a : a + n].any() and flat["padding_mask"][a + n : a + m].all()
        pad = slice(a + n, a + m)
        assert (flat["input_ids"][pad] == case["padding_token_id"]).all() and (flat["labels"][pad] == -100).all()
        assert (tag[n:] == 0).all()
        first = 0
        if n:
            doc, first = int(tag[0] - 1) // TAG, int(tag[0] - 1) % TAG
            pos = first + np.arange(n)
            assert np.array_equal(tag[:n], doc * TAG + pos + 1), "a slot holds one contiguous piece"
            ids = np.asarray(docs[doc]["input_ids"])
            assert np.array_equal(flat["input_ids"][a : a + n], ids[pos])
            if "labels" in docs[doc]:
                want = np.asarray(docs[doc]["labels"])[pos]
                if first + n == keep[doc] < len(ids):
                    want[-1] = -100  # a truncated document's last kept token: its target was cut off
            else:
                end = first + n
                nxt = ids[end] if end < keep[doc] else -100  # a target never crosses the (kept) document's end
                want = np.concatenate([ids[pos[1:]], [nxt]])
            assert np.array_equal(flat["labels"][a : a + n], want), (k, doc, first)
            pieces.append((doc, first, n))
        positions = first + np.arange(m)
        positions[n:] = np.minimum(positions[n:], case["capacity"] - 1)  # pads stay below the capacity
        assert np.array_equal(flat["position_ids"][a : a + m], positions), "positions continue the piece"
        assert m % doc_multiple == 0, f"slot {k} of {m} tokens breaks the document multiple {doc_multiple}"
    return pieces


def check_case(case: dict) -> None:
    docs = make_docs(case)
    keep, counts = expected_tokens(case, docs)
    anywhere = first_overlong(case, docs, every_rank=True)
    try:
        node, packs, pack_node = run_pipeline(case, docs)
    except ValueError as err:  # a list states its lengths: overflow='error' refuses every rank when it is built
        assert case["overflow"] == "error" and anywhere is not None, f"unexpected error: {err}"
        n = len(docs[anywhere]["input_ids"])
        assert f"document {anywhere} has {n} tokens" in str(err) and f"capacity={case['capacity']}" in str(err)
        return
    assert case["overflow"] != "error" or anywhere is None, "an overlong document was not refused at build"
    overlong = first_overlong(case, docs)
    refused = case["overflow"] == "error" and overlong is not None
    seen: Counter = Counter()
    all_pieces: list = []
    plan_indices: list[int] = []
    try:
        for i, shards in enumerate(node):
            collated = packs[i]  # (the node pulls a block of batches ahead of the one it serves)
            full = collated.tensors()
            check_shards_against_the_full_pack(shards, full, case["cp"])
            pieces = check_stream(case, docs, full, keep)
            info = shards[0].info
            assert info["real_tokens"] == sum(n for *_, n in pieces) == int((~full["padding_mask"]).sum())
            assert info["n_documents"] == len(pieces)
            plan_indices += info["pack_indices"]
            all_pieces += pieces
            seen.update((doc, t) for doc, first, n in pieces for t in range(first, first + n))
    except ValueError as err:
        assert refused, f"unexpected error: {err}"
        n = len(docs[overlong]["input_ids"])
        assert f"document {overlong} has {n} tokens" in str(err) and f"capacity={case['capacity']}" in str(err)
        return
    assert not refused, f"document {overlong} is longer than the capacity but overflow='error' did not raise"
    assert plan_indices == list(range(len(plan_indices)))
    assert max(seen.values(), default=1) == 1, "a token arrived twice"
    assert set(seen) == {(d, t) for d, n in keep.items() for t in range(n)}, "tokens lost"
    stats = pack_node.stats
    for name, value in counts.items():
        assert getattr(stats, name) == value, (name, getattr(stats, name), value)
    split_docs = sum(1 for c in Counter(doc for doc, *_ in all_pieces).values() if c > 1)
    assert stats.split == split_docs
    assert stats.tokens == sum(seen.values()) and stats.packs == len(plan_indices)
    total = sum(len(docs[i]["input_ids"]) for i in range(case["dp_rank"], len(docs), case["dp_size"]))
    assert stats.tokens + stats.truncated_tokens + stats.dropped_tokens + stats.untrained_tokens == total


EXAMPLES = [
    # thd at cp=8: documents split across packs, with empty ones and pad-valued content
    dict(cp=8, layout="thd", capacity=32, batch_size=2, qkv_format="thd", algorithm="bfd", overflow="split",
         window=3, lengths=[0, 70, 5, 33, 0, 16, 1], padding_token_id=0, dp_size=1, dp_rank=0, labels="none", seed=1),
    # truncate and drop, balanced with an odd cp, bshd rows of a document-independent layout
    dict(cp=3, layout="balanced", capacity=18, batch_size=1, qkv_format="bshd", algorithm="next_fit",
         overflow="truncate", window=None, lengths=[40, 3, 0, 19, 7], padding_token_id=3, dp_size=1, dp_rank=0,
         labels="some", seed=2),
    dict(cp=2, layout="round_robin", capacity=12, batch_size=3, qkv_format="bshd", algorithm="ffd",
         overflow="drop", window=2, lengths=[13, 2, 9, 30, 0, 4], padding_token_id=1, dp_size=2, dp_rank=1,
         labels="all", seed=3),
    # refused: overflow='error' names the first overlong document of this DP shard
    dict(cp=4, layout="contiguous", capacity=8, batch_size=1, qkv_format="thd", algorithm="concat",
         overflow="error", window=1, lengths=[3, 9, 2, 20], padding_token_id=0, dp_size=1, dp_rank=0,
         labels="none", seed=4),
    # concat at cp=1 (identity): every cut at the capacity continues the labels into the next pack
    dict(cp=1, layout="identity", capacity=5, batch_size=2, qkv_format="thd", algorithm="concat", overflow="split",
         window=4, lengths=[7, 0, 12, 1, 3], padding_token_id=0, dp_size=1, dp_rank=0, labels="none", seed=5),
]  # fmt: skip


@pytest.mark.parametrize("example_case", EXAMPLES, ids=[f"{e['layout']}-cp{e['cp']}" for e in EXAMPLES])
def test_fixed_examples(example_case):
    check_case(example_case)


@pytest.mark.parametrize(("layout", "cp"), PAIRS, ids=[f"{layout}-cp{cp}" for layout, cp in PAIRS])
@given(data=st.data())
@settings(max_examples=9, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
def test_documents_to_cp_shards_for_any_input(layout, cp, data):
    """Every (layout, cp) pair, each run; hypothesis draws lengths, policies, batch shapes (9 per pair, ~300 in all)."""
    check_case(data.draw(cases(layout=layout, cp=cp)))


def test_every_layout_and_cp_pair_is_parametrized():
    assert len(PAIRS) == 49 and len(set(PAIRS)) == 49
    assert {cp for _, cp in PAIRS} == set(range(1, 9)) and {layout for layout, _ in PAIRS} == set(LAYOUTS)
    assert ("balanced", 8) in PAIRS and all(("thd", cp) in PAIRS for cp in (2, 4, 5))


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "cp"), PAIRS, ids=[f"{layout}-cp{cp}" for layout, cp in PAIRS])
@given(data=st.data())
@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
def test_documents_to_cp_shards_for_any_input_long_run(layout, cp, data):
    check_case(data.draw(cases(layout=layout, cp=cp)))


def test_the_examples_reach_the_interesting_cases():
    """Guard against a vacuous pass: the fixed examples split, truncate, drop, refuse and mix pad-valued content."""
    seen = Counter()
    for ex in EXAMPLES:
        docs = make_docs(ex)
        try:
            node, packs, pack_node = run_pipeline(ex, docs)  # a list's overlong documents: refused when built
            batches = list(node)
        except ValueError:
            seen["refused"] += 1
            continue
        stats = pack_node.stats
        seen["split"] += stats.split
        seen["truncated"] += stats.truncated
        seen["dropped"] += stats.dropped
        seen["skipped"] += stats.skipped
        for collated in packs:
            full = collated.tensors()
            real = ~full["padding_mask"]
            seen["pad_valued_content"] += int((full["input_ids"][real] == ex["padding_token_id"]).sum())
            seen["padding"] += int((~real).sum())
        seen["batches"] += len(batches)
    assert all(seen[k] > 0 for k in ("refused", "split", "truncated", "dropped", "skipped", "pad_valued_content",
                                      "padding", "batches")), seen  # fmt: skip


# ----------------------------------------------------------------------------- real gloo ranks


GLOO_DOCS = [
    {"input_ids": np.random.default_rng(i).integers(0, 3, n), "tag": i * TAG + np.arange(n) + 1}
    for i, n in enumerate([0, 21, 5, 40, 9, 1, 17, 0, 33, 6, 12, 2, 27])
]


def _gather_on_ranks(rank: int, cp: int) -> int:
    """Each rank runs its own pipeline; gathering its shards with cpdata.gather rebuilds the full packs."""
    checked = 0
    for layout in ("contiguous", "round_robin", "thd", "balanced"):
        kw = dict(capacity=8 * alignment(layout, cp)[1], cp_size=cp, layout=layout, overflow="split",
                  batch_size=2, qkv_format="thd", padding_token_id=0)  # fmt: skip
        reference = shard_graph(GLOO_DOCS, graph_options(**kw))
        for batch in build_node(GLOO_DOCS, **records(cp_rank=rank, prefetch=0, pin_memory=False, **kw)):
            verify_layout_consistency(batch, None, device="cpu")
            full = next(reference).tensors()
            for key in ("input_ids", "labels", "position_ids", "padding_mask", "tag"):
                local = batch[key].to(torch.int64)
                got = gather_token_tensor(local, batch.layout, None, seq_dim=-1)
                assert torch.equal(got, torch.from_numpy(full[key]).to(torch.int64)), (layout, key)
            checked += 1
    return checked


@pytest.mark.parametrize("cp", [2, 3])
def test_gather_of_worker_shards_on_gloo_ranks_is_the_full_pack(cp):
    counts = run_ranks(_gather_on_ranks, cp, timeout=60)
    assert len(set(counts)) == 1 and counts[0] >= 8
