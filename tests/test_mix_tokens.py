"""cpdata.mix(..., by="tokens"): token shares at every prefix, the listed order equal to the stream, DP ranks,
exact resume, precompute, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from state_contract import run_save_load_contract
from torchdata.nodes import IterableWrapper

from cpdata import Documents, PrecomputedPacks, build_loader, closing_loader, mix, open_dataset
from cpdata import precompute as precompute_plan
from cpdata.cli import main as cli
from cpdata.nodes.mix_readers import tie_ranks
from cpdata.nodes.mixed import MixedDataset
from cpdata.nodes.pack import Pack
from tests.flat_options import precompute_records, records
from tests.test_mix import Stream, _plans, _write


class Lazy:
    """A sequence that states its lengths (as ``open_dataset`` does) and makes each document when read."""

    def __init__(self, lengths, lo=0):
        self.lengths, self.lo, self.reads = np.asarray(lengths, dtype=np.int64), lo, 0

    def __len__(self):
        return self.lengths.shape[0]

    def __getitem__(self, i):
        self.reads += 1
        return {"input_ids": np.full(int(self.lengths[i]), self.lo + i % 100, dtype=np.int64)}


def _lengths(n, mean, seed, sigma=1.0):
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(mean), sigma, n)).astype(np.int64)


def _docs(n, lo=0, seed=0, max_len=30, empty=False):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(lo, lo + 100, int(rng.integers(0 if empty else 1, max_len)))}
            for _ in range(n)]  # fmt: skip


WEIGHTS = {"web": 0.5, "chat": 0.3, "code": 0.2}


def _skewed():
    """Sources whose mean lengths differ 40x, one of them sorted by length (the order must not matter)."""
    return {"web": Lazy(_lengths(30_000, 2000, 0)), "chat": Lazy(_lengths(30_000, 50, 1)),
            "code": Lazy(np.sort(_lengths(30_000, 400, 2)))}  # fmt: skip


def test_token_shares_are_met_within_2_percent_over_20k_draws_and_one_document_at_every_draw():
    m = mix(_skewed(), WEIGHTS, seed=1, by="tokens", stop="never")
    m.reset()
    tokens = dict.fromkeys(WEIGHTS, 0)
    longest = 0
    for _ in range(20_000):
        n = next(m)["input_ids"].shape[0]
        tokens[m.names[m.last_source]] += n
        longest, total = max(longest, n), sum(tokens.values())
        assert max(abs(tokens[k] - w * total) for k, w in WEIGHTS.items()) <= longest  # at every prefix
    shares = {k: t / total for k, t in tokens.items()}
    assert all(abs(shares[k] - w) / w < 0.02 for k, w in WEIGHTS.items()), shares
    assert longest > 0.01 * total / 1000, "a long document to be within"
    assert m.counts == {n: {"documents": m.counts[n]["documents"], "tokens": t} for n, t in tokens.items()}
    assert m.clock.tokens == [tokens[n] for n in m.names]  # every rank's count: here the only one
    by_documents = mix(_skewed(), WEIGHTS, seed=1, stop="never")  # the default shares out documents ...
    by_documents.reset()
    got = dict.fromkeys(WEIGHTS, 0)
    for _ in range(20_000):
        n = next(by_documents)["input_ids"].shape[0]
        got[by_documents.names[by_documents.last_source]] += n
    assert got["chat"] / sum(got.values()) < 0.03  # ... so chat's 30 % of documents is ~1 % of the tokens


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_listed_draw_order_is_the_stream_order(stop, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2000, 3).tolist()
    weights = {n: float(w) for n, w in zip("abc", rng.uniform(0.1, 5, 3), strict=True)}
    sources = {n: [{"input_ids": [i] * int(rng.integers(0, 4))} for i in range(size)]  # empty documents tie
               for n, size in zip("abc", sizes, strict=True)}  # fmt: skip
    for n in sources:
        sources[n][0]["input_ids"] = [0, 0]
    m = mix(sources, weights, seed=seed, stop=stop, by="tokens")
    firsts = set()
    for epoch in (0, 1, 2):
        m.set_epoch(epoch)
        m.reset()
        stream = []
        for d in m:
            stream.append((m.last_source, m._recent[(m._drawn - 1) % 4096, 1].item()))
            assert d is sources[m.names[stream[-1][0]]][stream[-1][1]]
        assert stream[0][0] == int(np.argmin(tie_ranks(seed, epoch, 3)))  # all at 0 tokens: the tie order
        firsts.add(tuple(tie_ranks(seed, epoch, 3).tolist()))
        listed = MixedDataset(mix(sources, weights, seed=seed, stop=stop, by="tokens"), epoch=epoch)
        assert list(zip(listed.source_id.tolist(), listed.index.tolist(), strict=True)) == stream
        assert len(stream) > 4096 or stop == "first_exhausted"
    assert len(firsts) > 1, "each epoch draws its tie order"


class Unstated:
    """A sequence that does not state its lengths: every draw is read to count it."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


def test_dp_ranks_split_the_one_stream_and_read_only_their_own():
    sources = {"a": Lazy(_lengths(300, 40, 3)), "b": _docs(200, lo=100), "s": Stream(_docs(150, lo=200, seed=5)),
               "u": Unstated(_docs(100, lo=300, seed=6))}  # fmt: skip
    weights = {"a": 2, "b": 1, "s": 1, "u": 1}
    whole = Documents(mix(sources, weights, by="tokens", stop="all_exhausted"))
    whole.reset()
    stream = [d.arrays["input_ids"].tolist() for d in whole]
    totals = whole.source_counts
    counts = []
    for r in range(3):
        lazy = Lazy(_lengths(300, 40, 3))
        node = Documents(mix({**sources, "a": lazy}, weights, by="tokens", stop="all_exhausted"), dp_rank=r,
                         dp_size=3)  # fmt: skip
        node.reset()
        mine = [d for d in node]
        assert [d.arrays["input_ids"].tolist() for d in mine] == stream[r::3]
        assert lazy.reads == node.source_counts["a"]["documents"], "another rank's documents are not read"
        counts.append(node.source_counts)
    for name in sources:  # each rank counts its own draws only, the unstated source's too
        for key in ("documents", "tokens"):
            assert sum(c[name][key] for c in counts) == totals[name][key] > 0, (name, key)


def _sources():
    return {"list": _docs(70, empty=True), "lazy": Lazy(_lengths(50, 20, 4), lo=300),
            "stream": Stream(_docs(40, lo=100, seed=1)), "node": IterableWrapper(Stream(_docs(30, lo=200, seed=2)))}  # fmt: skip


TOKEN_WEIGHTS = {"list": 3, "lazy": 2, "stream": 2, "node": 1}


def test_the_mix_and_its_documents_meet_the_save_load_contract():
    run_save_load_contract(lambda: mix(_sources(), TOKEN_WEIGHTS, seed=2, stop="all_exhausted", by="tokens"),
                           midpoints=[0, 1, 17, 60, 140], epochs=2)  # fmt: skip
    run_save_load_contract(lambda: Documents(mix(_sources(), TOKEN_WEIGHTS, seed=2, by="tokens"), dp_rank=1,
                                             dp_size=2), midpoints=[0, 5, 22], epochs=2)  # fmt: skip


def test_loader_resume_mid_epoch_is_bit_identical_and_another_by_is_refused():
    kw = dict(capacity=64, cp_size=2, cp_rank=1, layout="thd", prefetch=0, dp_rank=1, dp_size=2, overflow="split")
    sources = _sources()

    def loader(by="tokens"):
        return build_loader(mix(sources, TOKEN_WEIGHTS, seed=5, stop="all_exhausted", by=by), **records(**kw))

    with closing_loader(loader()) as first:
        it = iter(first)
        for _ in range(4):
            next(it)
        state = first.state_dict()
        tail = [{k: v.clone() for k, v in b.items()} for b in it]
    with closing_loader(loader()) as restored:
        restored.load_state_dict(state)
        again = list(restored)
    assert len(again) == len(tail) > 0
    assert all(torch.equal(a[k], b[k]) for a, b in zip(again, tail, strict=True) for k in a)
    with closing_loader(loader("documents")) as other:
        other.load_state_dict(state)
        with pytest.raises(ValueError, match="restore onto the same dataset|Mix state was saved with"):
            next(iter(other))


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_precompute_of_a_token_mix_reproduces_the_loader_packs(tmp_path, stop):
    web = _write(tmp_path / "web.jsonl", _docs(120, max_len=200))
    chat = _write(tmp_path / "chat.jsonl", _docs(150, lo=100, seed=4, max_len=20))

    def mixed():
        return mix({"web": open_dataset(web), "chat": open_dataset(chat)}, {"web": 0.7, "chat": 0.3}, seed=6,
                   stop=stop, by="tokens")  # fmt: skip

    opts = dict(capacity=256, cp_size=2, layout="thd", overflow="split")
    store = precompute_plan(mixed(), tmp_path / "plan", **precompute_records(**opts))
    online = Pack(Documents(mixed()), **opts)
    want = _plans(online)
    assert _plans(PrecomputedPacks(tmp_path / "plan", mixed())) == want and len(want) > 10
    assert store.manifest["stats"]["sources"] == online.stats.sources
    assert store.manifest["input"]["mix"]["by"] == "tokens"
    args = ["precompute", "--mix", f"web={web}:0.7", "--mix", f"chat={chat}:0.3", "--mix-seed", "6", "--mix-by",
            "tokens", "--mix-stop", stop, "--capacity", "256", "--cp-size", "2", "--layout", "thd", "--overflow",
            "split", "--out", str(tmp_path / "cli"), "--quiet"]  # fmt: skip
    assert cli(args) == 0
    assert _plans(PrecomputedPacks(tmp_path / "cli", mixed())) == want
    with pytest.raises(ValueError, match="precomputed from"):
        PrecomputedPacks(tmp_path / "plan", mix({"web": open_dataset(web), "chat": open_dataset(chat)},
                                                {"web": 0.7, "chat": 0.3}, seed=6, stop=stop))  # fmt: skip


def test_errors_name_the_source_and_refusals():
    bad = _docs(20) + [{"input_ids": [-1]}] + _docs(20)
    m = mix({"a": _docs(40, lo=100), "bad": bad}, {"a": 1, "bad": 1}, by="tokens", stop="all_exhausted")
    with pytest.raises(ValueError, match=r"^document 20 of mix source 'bad' \(source 1 of \['a', 'bad'\], draw \d+"):
        for _ in Documents(m):
            pass
    with pytest.raises(ValueError, match="by must be one of \\['documents', 'tokens'\\]"):
        mix({"a": _docs(3)}, {"a": 1}, by="token")
    with pytest.raises(ValueError, match="mix source 'e' holds no tokens"):
        mix({"a": _docs(3), "e": [{"input_ids": []}] * 3}, {"a": 1, "e": 1}, by="tokens")
    empty_stream = mix({"a": _docs(3), "e": Stream([{"input_ids": []}] * 3)}, {"a": 1, "e": 1}, by="tokens",
                       stop="never")  # fmt: skip
    with pytest.raises(ValueError, match="mix source 'e' gave no tokens on pass 1; by='tokens' would draw it forever"):
        for _ in range(100):
            next(empty_stream)
    assert mix({"a": _docs(3)}, {"a": 1}).config == {"names": ["a"], "weights": [1.0], "seed": 0,
                                                      "stop": "first_exhausted"}  # a documents mix: as before


def test_a_schedule_plans_a_token_mix_over_its_listed_draws():
    a, b = _docs(60, max_len=60), _docs(200, lo=100, max_len=8)
    kw = dict(capacity=64, cp_size=1, cp_rank=0, layout="identity", prefetch=0, schedule="balanced")
    with closing_loader(build_loader(mix({"a": a, "b": b}, {"a": 1, "b": 1}, stop="all_exhausted", by="tokens"),
                                     **records(**kw))) as loader:  # fmt: skip
        tokens = sum(int(batch["padding_mask"].logical_not().sum()) for batch in loader)
    listed = MixedDataset(mix({"a": a, "b": b}, {"a": 1, "b": 1}, stop="all_exhausted", by="tokens"))
    assert tokens == int(listed.lengths.sum())
    got = {n: c["tokens"] for n, c in listed.counts.items()}
    assert abs(got["a"] - got["b"]) <= 60 and listed.counts["b"]["documents"] > 3 * listed.counts["a"]["documents"]


def test_a_restored_mix_by_tokens_names_no_draw_it_has_not_seen_since_the_restore():
    """By tokens, draws are named from the ones read since the last start or restore: restored into the
    same node after another epoch, an earlier draw of the saved epoch is unknown, never that epoch's draw."""
    a = [{"input_ids": np.arange(1 + i % 5)} for i in range(30)]
    b = [{"input_ids": np.arange(1 + i % 7) + 1000} for i in range(40)]
    m = mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=3, by="tokens")

    def read(first: int, n: int) -> list[str]:  # draws first .. first + n - 1 of the epoch
        names = []
        for j in range(first, first + n):
            (token, *_) = next(m)["input_ids"].tolist()
            names.append("b" if token >= 1000 else "a")
            assert f"mix source {names[-1]!r}" in m.describe_document(j), "a draw just read is named by its source"
        return names

    m.reset()
    epoch0 = read(0, 20)
    state = m.state_dict()
    epoch0 += read(20, 20)
    m.reset()
    assert read(0, 20) != epoch0[:20], "epoch 1 draws other sources: a leftover would name the wrong one"
    m.reset(state)
    assert read(20, 20) == epoch0[20:]  # the saved epoch goes on as it did
    for j in range(20):
        assert "its source is known for the last" in m.describe_document(j), j
