"""One oracle over every path: each token's (document, position) rebuilt from the batch alone.

For every batch of every path (live bfd, precomputed, ``schedule="balanced"`` / ``"in_order"`` live and
precomputed, a mix live and scheduled, ``Tokenize``, ``schedule_window``), every layout, cp 1/2/4, thd and
bshd, with ``overflow="split"`` cutting documents longer than a pack: each CP rank's local tokens are placed
in the stream by ``layout.local_token_global_indices``, in a slot by ``cu_seqlens_padded``, in a document by
``info["doc_index"]`` / ``info["doc_start"]`` (``info["doc_source"]`` in a mix), and checked against the
document itself, never against another run of the library:

- ``input_ids == document[position]``, ``position_ids == position`` (positions continue across cuts);
- ``labels == document[position + 1]``, ``-100`` after the document's last token and on pads;
- ``padding_mask`` exactly on the pads; every document token served once (all of them where nothing is
  left out);
- ``info["n_targets"]`` is the targets of all ranks' tokens (what the loss's all-reduce would count).

Guards against a vacuous pass: every path cuts documents (pieces with ``doc_start > 0``) and checks the
labels of cut pieces' last tokens (the next piece's first token).
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import cpdata
from cpdata.nodes.collate import Collate
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.nodes.shard import ShardForRank, layout_depends_on_documents
from cpdata.offline import precompute
from cpdata.offline.reader import PrecomputedPacks
from cpdata.sources.open import open_dataset
from cpdata.worker.keys import IGNORE_INDEX
from tests.flat_options import graph_options, precompute_records

CAPACITY = 64
RNG = np.random.default_rng(2812)
LENGTHS = np.concatenate([RNG.integers(1, 40, 30), RNG.integers(65, 170, 6)])  # 6 longer than a pack
RNG.shuffle(LENGTHS)
DOCS = [{"input_ids": RNG.integers(1, 30_000, int(n))} for n in LENGTHS]
TEXTS = [" ".join(f"w{int(x)}" for x in RNG.integers(0, 50, int(n))) for n in RNG.integers(2, 60, 24)]

LAYOUT_CP = [("identity", 1)] + [(lay, cp) for cp in (2, 4) for lay in ("contiguous", "round_robin", "thd",
                                                                      "balanced")]  # fmt: skip
PATHS = ["live", "balanced", "in_order", "windowed", "mix", "mix_balanced", "mix_tokens_balanced", "tokenize",
         "precomputed", "precomputed_balanced"]  # fmt: skip


def _flat(docs: list[dict]) -> list[np.ndarray]:
    return [np.asarray(d["input_ids"], dtype=np.int64) for d in docs]


class Oracle:
    """The documents by ``(source name or None, index)``, and what the batches served of them."""

    def __init__(self, sources: dict[str | None, list[np.ndarray]]) -> None:
        self.sources = sources
        self.served: Counter = Counter()
        self.cut_pieces = 0  # pieces starting inside their document
        self.cut_targets = 0  # last tokens of pieces whose document goes on: a target across a cut

    def check(self, ranks: tuple, qkv_format: str) -> None:
        info = ranks[0].info
        for b in ranks[1:]:
            assert b.info == info, "CP ranks of one batch disagree on its info"
        cu = ranks[0]["cu_seqlens_padded"].numpy().astype(np.int64)
        seq = ranks[0]["seq_lens"].numpy().astype(np.int64)
        doc_index, doc_start = info["doc_index"], info["doc_start"]
        names = info.get("doc_source", [None] * len(doc_index))
        assert len(doc_index) == len(doc_start) == len(names) == seq.shape[0] == cu.shape[0] - 1
        assert all(type(x) is int for x in doc_index + doc_start), "host ints, no tensors"
        covered = np.zeros(int(cu[-1]), dtype=np.int64)
        trained = sum(int((b["labels"].numpy() != IGNORE_INDEX).sum()) for b in ranks)
        assert type(info["n_targets"]) is int and info["n_targets"] == trained, "n_targets is not the pack's count"
        for b in ranks:
            g = b.layout.local_token_global_indices.numpy()
            ids, labels = b["input_ids"].numpy(), b["labels"].numpy()
            pos, pad = b["position_ids"].numpy(), b["padding_mask"].numpy()
            if qkv_format == "bshd":  # rows share the map: row r's column g is stream position r * S + g
                rows, width = ids.shape
                stream = (np.arange(rows)[:, None] * (int(cu[-1]) // rows) + g[None, :]).reshape(-1)
                ids, labels, pos, pad = (a.reshape(-1) for a in (ids, labels, pos, pad))
            else:
                stream = g
            np.add.at(covered, stream, 1)
            slot = np.searchsorted(cu, stream, side="right") - 1
            offset = stream - cu[slot]
            real = offset < seq[slot]
            assert np.array_equal(pad, ~real), "padding_mask is not exactly the pads"
            assert (labels[~real] == IGNORE_INDEX).all(), "a pad has a target"
            for s in np.unique(slot[real]).tolist():
                at = np.flatnonzero(real & (slot == s))
                doc = self.sources[names[s]][doc_index[s]]
                p = doc_start[s] + offset[at]
                assert np.array_equal(ids[at], doc[p]), f"slot {s}: input_ids are not document {doc_index[s]}"
                assert np.array_equal(pos[at], p), f"slot {s}: position_ids do not continue from {doc_start[s]}"
                want = np.where(p + 1 < doc.shape[0], doc[np.minimum(p + 1, doc.shape[0] - 1)], IGNORE_INDEX)
                assert np.array_equal(labels[at], want), (
                    f"slot {s} (document {doc_index[s]} from {doc_start[s]}): labels are not the next tokens")
                self.served.update((names[s], doc_index[s], q) for q in p.tolist())
        assert (covered == 1).all(), "the ranks do not hold every stream position once"
        for s in range(len(doc_index)):
            if doc_index[s] < 0:
                continue
            self.cut_pieces += doc_start[s] > 0
            n = self.sources[names[s]][doc_index[s]].shape[0]
            self.cut_targets += doc_start[s] + int(seq[s]) < n

    def finish(self, every: bool) -> None:
        assert self.served, "nothing served"
        assert max(self.served.values()) == 1, "a token was served twice"
        assert self.cut_pieces > 0 and self.cut_targets > 0, "no document was cut: the split path is untested"
        if every:
            want = {(name, d, q) for name, docs in self.sources.items() for d, doc in enumerate(docs)
                    for q in range(doc.shape[0])}  # fmt: skip
            assert set(self.served) == want, f"{len(want - set(self.served))} document tokens never served"


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("oracle") / "docs.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d["input_ids"].tolist()}) + "\n" for d in DOCS))
    return path


@functools.lru_cache(maxsize=1)
def _tokenized() -> tuple[list[np.ndarray], object]:
    from tests.tokenizer_fixture import chat_tokenizer

    tok = chat_tokenizer()
    return [np.asarray(tok(t)["input_ids"] + [1], dtype=np.int64) for t in TEXTS], tok


def _graphs(path: str, layout: str, cp: int, qkv: str, batch: int, tmp: Path, jsonl: Path):
    """``[(collate node, sources), ...]``: one per DP rank of the path, and whether every token is served."""
    common = dict(capacity=CAPACITY, cp_size=cp, layout=layout, overflow="split", batch_size=batch, qkv_format=qkv)
    lengths = LENGTHS.tolist()
    docs = {None: _flat(DOCS)}
    if path == "live":
        return [(shard_graph(DOCS, graph_options(**common)), docs)], True
    if path in ("balanced", "in_order"):
        return [(shard_graph(DOCS, graph_options(schedule=path, lengths=lengths, dp_size=2, dp_rank=r, micro_batches=2, **common)),
                 docs) for r in range(2)], True  # fmt: skip
    if path == "windowed":
        return [(shard_graph(iter_docs(), graph_options(schedule="balanced", schedule_window=12, dp_size=2, dp_rank=r, **common)),
                 docs) for r in range(2)], True  # fmt: skip
    if path in ("mix", "mix_balanced", "mix_tokens_balanced"):
        parts = {"a": DOCS[:18], "b": DOCS[18:]}
        mixed = {k: _flat(v) for k, v in parts.items()}
        kw = {} if path == "mix" else {"schedule": "balanced", "dp_size": 2, "dp_rank": 0}
        ranks = [0] if path == "mix" else [0, 1]
        by = {"by": "tokens"} if path == "mix_tokens_balanced" else {}
        return [(shard_graph(cpdata.mix(parts, {"a": 1, "b": 2}, seed=3, **by),
                             graph_options(**{**kw, "dp_rank": r} if kw else {}, **common)), mixed) for r in ranks], False  # fmt: skip
    if path == "tokenize":
        want, tok = _tokenized()
        rows = cpdata.Tokenize([{"text": t} for t in TEXTS], tok, append_eos=True, eos_token_id=1)
        return [(shard_graph(rows, graph_options(**common)), {None: want})], True
    sched = {} if path == "precomputed" else {"dp_size": 2, "micro_batches": 2}
    plan = tmp / f"{path}-{layout}-{cp}"
    if not plan.exists():
        precompute(open_dataset(jsonl), plan, **precompute_records(capacity=CAPACITY, cp_size=cp, layout=layout, overflow="split", **sched))  # fmt: skip
    dp = sched.get("dp_size", 1)
    return [(Collate(PrecomputedPacks(plan, open_dataset(jsonl), data=DataPolicy(dp_rank=r, dp_size=dp)), batch_size=batch,
                     qkv_format=qkv), docs) for r in range(dp)], dp > 1  # fmt: skip


class iter_docs:  # noqa: N801  (a re-iterable stream of the documents, no lengths)
    def __iter__(self):
        return iter(DOCS)


def run_oracle(path: str, layout: str, cp: int, qkv: str, tmp: Path, jsonl: Path) -> Oracle:
    batch = 2 if qkv == "thd" or not layout_depends_on_documents(layout, cp) else 1
    graphs, every = _graphs(path, layout, cp, qkv, batch, tmp, jsonl)
    oracle = None
    for collated, sources in graphs:
        oracle = oracle or Oracle(sources)
        node = ShardForRank(collated, cp_size=cp, cp_rank=0, layout=layout, all_ranks=True)
        node.reset()
        for ranks in node:
            oracle.check(ranks, qkv)
    oracle.finish(every)
    return oracle


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plans")


@pytest.mark.parametrize("layout,cp", LAYOUT_CP, ids=[f"{lay}-cp{cp}" for lay, cp in LAYOUT_CP])
@pytest.mark.parametrize("path", PATHS)
def test_every_token_is_its_documents_token_with_the_next_as_target(path, layout, cp, plans, jsonl):
    run_oracle(path, layout, cp, "thd", plans, jsonl)


@pytest.mark.parametrize("layout,cp", [("contiguous", 2), ("round_robin", 4), ("thd", 2)])
@pytest.mark.parametrize("path", ["live", "balanced", "precomputed_balanced"])
def test_bshd_rows_hold_their_documents_tokens_too(path, layout, cp, plans, jsonl):
    run_oracle(path, layout, cp, "bshd", plans, jsonl)


def test_pack_indices_are_the_plans_own_and_ranks_do_not_share_them(plans, jsonl):
    """Two DP ranks of a schedule report the schedule's pack ids ((step * R + rank) * M + mb), not each an
    ordinal 0, 1, ...; a precomputed schedule reports the same ids for the same packs."""
    seen = {}
    for name in ("balanced", "precomputed_balanced"):
        graphs, _ = _graphs(name, "thd", 2, "thd", 1, plans, jsonl)
        ids = []
        for r, (collated, _) in enumerate(graphs):
            node = ShardForRank(collated, cp_size=2, cp_rank=0, layout="thd")
            node.reset()
            got = [(b.info["pack_indices"][0], b.info["doc_index"], b.info["doc_start"]) for b in node]
            assert [p for p, *_ in got] == [(s * 2 + r) * 2 + m for s in range(len(got) // 2) for m in range(2)]
            ids += got
        seen[name] = sorted(ids)
    assert seen["balanced"] == seen["precomputed_balanced"]


def test_a_live_mix_names_each_draw_as_the_draw_by_draw_count_does():
    """``Mix.document_sources`` (the batches' ``doc_source`` / ``doc_index`` on the live path) equals the
    brute-force count of every draw, across blocks of draws and passes over a source that ran out."""
    sizes = {"a": 7, "b": 3000, "c": 5}
    mixed = cpdata.mix({n: [{"input_ids": np.ones(2, np.int64)}] * k for n, k in sizes.items()},
                       {"a": 1, "b": 5, "c": 1}, seed=9, stop="all_exhausted")  # fmt: skip
    mixed.reset()
    draws = mixed.draws
    n = 9000  # over two blocks of 4096
    picks = np.array([draws(0, j) for j in range(n)])
    seen = {k: 0 for k in range(3)}
    want_name, want_index = [], []
    for k in picks.tolist():
        want_name.append(mixed.names[k])
        want_index.append(seen[k] % sizes[mixed.names[k]])
        seen[k] += 1
    js = np.concatenate([RNG.integers(0, n, 200), [0, n - 1, 4095, 4096]])
    names, index = mixed.document_sources(js)
    assert names == [want_name[j] for j in js.tolist()]
    assert index.tolist() == [want_index[j] for j in js.tolist()]
    names, index = mixed.document_sources(np.arange(4100, 4130))  # one block: the fast path
    assert index.tolist() == want_index[4100:4130] and names == want_name[4100:4130]


def test_a_live_mix_over_several_epochs_per_iter_names_no_source_rather_than_a_wrong_one():
    """Packs of ``num_epochs=2`` can join draws of two epochs, whose stream positions repeat: no source is named
    (one epoch per ``iter()``, the default, names them, as the oracle above checks); nor live by tokens."""
    mixed = cpdata.mix({"a": DOCS[:18], "b": DOCS[18:]}, {"a": 1, "b": 2}, seed=3)
    node = ShardForRank(shard_graph(mixed, GraphOptions(capacity=CAPACITY, cp_size=2, layout="thd", plan=StreamPlan(overflow="split"), data=DataPolicy(epochs=2))), cp_size=2, cp_rank=0, layout="thd")  # fmt: skip
    node.reset()
    infos = [b.info for b in node]
    assert len(infos) > 2 and not any("doc_source" in i for i in infos)
    by_tokens = cpdata.mix({"a": DOCS[:18], "b": DOCS[18:]}, {"a": 1, "b": 2}, seed=3, by="tokens")
    node = ShardForRank(shard_graph(by_tokens, GraphOptions(capacity=CAPACITY, cp_size=2, layout="thd", plan=StreamPlan(overflow="split"))),
                        cp_size=2, cp_rank=0, layout="thd")  # fmt: skip
    node.reset()
    infos = [b.info for b in node]  # live by tokens: each draw follows the tokens read, named by a schedule only
    assert len(infos) > 2 and not any("doc_source" in i for i in infos)
