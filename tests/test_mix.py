"""cpdata.mix: weighted draws from (seed, epoch), stop policies, exact resume, per-source counters, mixed labels."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from state_contract import run_save_load_contract
from tokenizer_fixture import chat_tokenizer, conversations
from torchdata.nodes import IterableWrapper
from torchdata.stateful_dataloader import StatefulDataLoader

from cpdata import CPDataset, Documents, PrecomputedPacks, build_loader, closing_loader, mix, open_dataset
from cpdata import precompute as precompute_plan
from cpdata.cli import main as cli
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.nodes.pack import Pack
from tests.flat_options import precompute_records, records


def _docs(n, lo=0, seed=0, max_len=30):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(lo, lo + 100, int(rng.integers(1, max_len)))} for _ in range(n)]


class Stream:
    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def _names(m, n=None):
    """The source of every document the mix yields (one epoch, or ``n`` documents)."""
    out = []
    m.reset()
    for _ in m:
        out.append(m.names[m.last_source])
        if n is not None and len(out) == n:
            break
    return out


def test_empirical_proportions_match_the_weights():
    big = {"a": list(range(50_000)), "b": list(range(50_000)), "c": list(range(50_000))}
    sources = {k: [{"input_ids": [1]}] * 50_000 for k in big}
    n = 20_000
    drawn = _names(mix(sources, {"a": 5, "b": 3, "c": 2}, seed=1), n)
    for name, p in {"a": 0.5, "b": 0.3, "c": 0.2}.items():
        count = drawn.count(name)
        assert abs(count - n * p) < 4 * math.sqrt(n * p * (1 - p)), (name, count, n * p)


def test_draws_are_a_function_of_seed_and_epoch_only():
    a, b = _docs(40), _docs(40, lo=100)
    m = mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=3)
    first, second = _names(m), _names(m)  # reset() twice: epochs 0 and 1
    assert first != second
    again = mix({"b": b, "a": a}, {"b": 1.0, "a": 1.0}, seed=3)  # the dicts' order does not matter
    assert [_names(again), _names(again)] == [first, second]
    assert _names(mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=4)) != first
    m.set_epoch(1)
    assert _names(m) == second


def test_stop_policies():
    small, large = _docs(10), _docs(200, lo=100)
    kw = dict(seed=0)
    got = [d for d in _iter(mix({"s": small, "l": large}, {"s": 1, "l": 1}, **kw))]
    ids = [tuple(d["input_ids"].tolist()) for d in got]
    assert len(set(ids)) == len(ids), "first_exhausted repeats nothing"
    from_small = sum(any(d is x for x in small) for d in got)
    assert from_small == 10 and 0 < len(got) - 10 < 200, "ends once the small source runs out"
    m = mix({"s": small, "l": large}, {"s": 1, "l": 1}, stop="all_exhausted", **kw)
    got = list(_iter(m))
    from_large = [d for d in got if any(d is x for x in large)]
    from_small = [d for d in got if any(d is x for x in small)]
    assert len(from_large) == 200 and len(from_small) > 10, "the small source repeats until the large one is read"
    assert m.readers["s"].passes >= 10 and m.readers["l"].passes == 0
    endless = mix({"s": small, "l": large}, {"s": 1, "l": 1}, stop="never", **kw)
    endless.reset()
    assert len([next(endless) for _ in range(1000)]) == 1000
    with pytest.raises(ValueError, match=r"unknown stop policy 'cycle'; choose one of \['first_exhausted', "
                                         r"'all_exhausted', 'never'\]"):  # fmt: skip
        mix({"s": small}, {"s": 1}, stop="cycle")


def _iter(m):
    m.reset()
    return list(m)


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        ({"a": 1}, ValueError, r"exactly the keys of sources \['a', 'b'\]: missing \['b'\], unknown \[\]"),
        ({"a": 1, "b": 1, "c": 1}, ValueError, r"missing \[\], unknown \['c'\]"),
        ({"a": 1, "b": 0}, ValueError,
         r"weights\['b'\] must be finite and > 0, got 0 \(weights are relative.*leave a source out"),
        ({"a": 1, "b": -2.0}, ValueError, r"weights\['b'\] must be finite and > 0, got -2.0"),
        ({"a": 1, "b": float("nan")}, ValueError, r"weights\['b'\] must be finite and > 0, got nan"),
        ({"a": float("inf"), "b": 1}, ValueError, r"weights\['a'\] must be finite and > 0, got inf"),
        ({"a": 1, "b": True}, TypeError, r"weights\['b'\] must be a number, got bool True"),
        ({"a": 1, "b": "0.5"}, TypeError, r"weights\['b'\] must be a number, got str"),
    ],
)
def test_weights_are_checked(weights, error, match):
    with pytest.raises(error, match=match):
        mix({"a": _docs(3), "b": _docs(3)}, weights)


def test_sources_are_checked():
    with pytest.raises(ValueError, match="mix source 'e' is empty"):
        mix({"a": _docs(3), "e": []}, {"a": 1, "e": 1})
    with pytest.raises(TypeError, match="mix source 'g': source is a one-shot iterator"):
        mix({"g": (d for d in _docs(3))}, {"g": 1})
    with pytest.raises(TypeError, match="sources must be a non-empty dict"):
        mix({}, {})
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        mix({"a": _docs(3)}, {"a": 1}, seed=-1)
    empty_stream = mix({"a": _docs(3), "z": Stream([])}, {"a": 1, "z": 100}, stop="never")
    empty_stream.reset()
    with pytest.raises(ValueError, match="mix source 'z' gave no document on pass 1"):
        next(empty_stream)


def test_dp_ranks_take_every_dp_size_th_draw_without_reading_the_others():
    class Counting(list):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return list.__getitem__(self, i)

    a, b = _docs(90), _docs(60, lo=100)
    whole = Documents(mix({"a": a, "b": b}, {"a": 2, "b": 1}, stop="all_exhausted"))
    whole.reset()
    stream = [d.arrays["input_ids"].tolist() for d in whole]
    counts = []
    for r in range(3):
        Counting.reads = 0
        m = mix({"a": Counting(a), "b": Counting(b)}, {"a": 2, "b": 1}, stop="all_exhausted")
        node = Documents(m, dp_rank=r, dp_size=3)
        node.reset()
        mine = [d for d in node]
        assert [d.arrays["input_ids"].tolist() for d in mine] == stream[r::3]
        assert [d.index for d in mine] == list(range(r, len(stream), 3))
        assert Counting.reads == len(mine), "another rank's documents are not read"
        counts.append(node.source_counts)
    assert sum(c["a"]["documents"] + c["b"]["documents"] for c in counts) == len(stream)


def test_pack_stats_count_documents_and_tokens_per_source():
    a, b = _docs(50), _docs(30, lo=100)
    collated = shard_graph(mix({"a": a, "b": b}, {"a": 1, "b": 1}, stop="all_exhausted"), GraphOptions(capacity=64, cp_size=1, layout="identity"))  # fmt: skip
    collated.reset()
    batches = list(collated)
    stats = collated.source.stats
    sources = stats.sources
    assert set(sources) == {"a", "b"} and sources["b"]["documents"] > 30, "b repeats under all_exhausted"
    assert sources["a"]["documents"] + sources["b"]["documents"] == stats.documents
    assert sources["a"]["tokens"] + sources["b"]["tokens"] == sum(int(t["seq_lens"].sum()) for t in
                                                                     (x.tensors() for x in batches)) == stats.tokens
    assert shard_graph(a, GraphOptions(capacity=64, cp_size=1, layout="identity")).source.stats.sources is None


def _sources():
    return {"list": _docs(70), "stream": Stream(_docs(40, lo=100, seed=1)),
            "node": IterableWrapper(Stream(_docs(30, lo=200, seed=2)))}  # fmt: skip


WEIGHTS = {"list": 3, "stream": 2, "node": 1}


def test_mix_node_and_its_documents_meet_the_save_load_contract():
    run_save_load_contract(lambda: mix(_sources(), WEIGHTS, seed=2, stop="all_exhausted"),
                           midpoints=[0, 1, 17, 60, 140], epochs=2)  # fmt: skip
    run_save_load_contract(lambda: Documents(mix(_sources(), WEIGHTS, seed=2), dp_rank=1, dp_size=2),
                           midpoints=[0, 5, 22], epochs=2)  # fmt: skip


def _clone(batch):
    return {k: v.clone() for k, v in batch.items()}


@pytest.mark.parametrize(("epoch", "cut"), [(0, 2), (1, 5)])
def test_loader_resume_mid_epoch_is_bit_identical(epoch, cut):
    kw = dict(capacity=64, cp_size=2, cp_rank=1, layout="thd", prefetch=0, dp_rank=1, dp_size=2)
    sources = _sources()
    with closing_loader(build_loader(mix(sources, WEIGHTS, seed=5, stop="all_exhausted"), **records(**kw))) as loader:
        for _ in range(epoch):
            list(loader)
        it = iter(loader)
        for _ in range(cut):
            next(it)
        state = loader.state_dict()
        tail = [_clone(b) for b in it]
    with closing_loader(build_loader(mix(sources, WEIGHTS, seed=5, stop="all_exhausted"), **records(**kw))) as restored:
        restored.load_state_dict(state)
        again = [_clone(b) for b in restored]
    assert len(again) == len(tail) > 0
    assert all(torch.equal(a[k], b[k]) for a, b in zip(again, tail, strict=True) for k in a)
    with closing_loader(build_loader(mix(sources, {**WEIGHTS, "node": 2}, seed=5, stop="all_exhausted"), **records(**kw))) as o:
        o.load_state_dict(state)
        with pytest.raises(ValueError, match="restore onto the same dataset|Mix state was saved with"):
            next(iter(o))


def test_stateful_dataloader_workers_resume_a_shuffled_mix_exactly():
    kw = dict(capacity=64, cp_size=1, layout="identity", shuffle=True, shuffle_buffer=16, seed=1)
    sources = {"a": _docs(80), "b": Stream(_docs(50, lo=100, seed=3))}

    def loader():
        data = CPDataset(mix(sources, {"a": 1, "b": 1}, stop="all_exhausted"), **records(cp_rank=0, **kw))
        return StatefulDataLoader(data, batch_size=None, num_workers=2, multiprocessing_context="fork")

    whole = [_clone(b) for b in loader()]
    first = loader()
    it = iter(first)
    head = [_clone(next(it)) for _ in range(5)]
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    again = [_clone(b) for b in second]
    assert len(head) + len(again) == len(whole) > 8
    assert all(torch.equal(a[k], b[k]) for a, b in zip(head + again, whole, strict=True) for k in a)


def test_a_labelled_chat_source_mixes_with_plain_text_in_one_pack():
    """Chat rows (assistant_masks from a real chat template) beside plain text: the chats train exactly their
    assistant tokens, the plain documents every next token, all in the same packs."""
    tok = chat_tokenizer()
    chats = []
    for chat in conversations():
        row = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        chats.append({"input_ids": list(row["input_ids"]), "assistant_masks": list(row["assistant_masks"])})
    plain = [{"input_ids": tok(t)["input_ids"]} for t in ("the quick brown fox", "hello there, how can i help")]
    mixed = mix({"chat": chats, "text": plain}, {"chat": 1, "text": 1}, stop="all_exhausted", seed=0)
    with pytest.raises(ValueError, match="labels_alignment is not set"):
        _collect(mixed, None)
    batch = _collect(mixed, "inputs")
    ids, labels, docs = batch["input_ids"][0], batch["labels"][0], batch["document_ids"][0]
    seen = {"chat": 0, "text": 0}
    for k, n in enumerate(batch["seq_lens"].tolist()):
        span = np.flatnonzero(docs == k)[:n]
        doc_ids, doc_labels = ids[span].tolist(), labels[span]
        chat = next((c for c in chats if c["input_ids"] == doc_ids), None)
        expected = np.full(n, -100)
        if chat is not None:
            mask = np.asarray(chat["assistant_masks"])
            expected[:-1] = np.where(mask[1:] == 1, doc_ids[1:], -100)
            seen["chat"] += 1
        else:
            assert any(p["input_ids"] == doc_ids for p in plain)
            expected[:-1] = doc_ids[1:]
            seen["text"] += 1
        assert doc_labels.tolist() == expected.tolist()
        assert batch["loss_mask"][0][span].tolist() == (expected != -100).astype(int).tolist()
    assert seen["chat"] >= 3 and seen["text"] >= 2, seen


def _collect(mixed, labels_alignment):
    (batch,) = [b.tensors() for b in _run(shard_graph(mixed, GraphOptions(capacity=512, cp_size=1, layout="identity", data=DataPolicy(labels_alignment=labels_alignment))))]  # fmt: skip
    return batch


def _run(node):
    node.reset()
    return list(node)


def test_a_source_changed_under_the_run_is_refused():
    a, b = _docs(40), _docs(40, lo=100)
    kw = dict(capacity=64, cp_size=1, cp_rank=0, layout="identity", prefetch=0)
    with closing_loader(build_loader(mix({"a": a, "b": b}, {"a": 1, "b": 1}), **records(**kw))) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    edited = [dict(d) for d in b]
    edited[0] = {"input_ids": np.arange(5)}
    with closing_loader(build_loader(mix({"a": a, "b": edited}, {"a": 1, "b": 1}), **records(**kw))) as other:
        other.load_state_dict(state)
        with pytest.raises(ValueError, match="fingerprint"):
            next(iter(other))
    m = mix({"a": a, "b": b}, {"a": 1, "b": 1})
    node = Documents(m)
    node.reset()
    b[0] = {"input_ids": np.arange(5)}
    with pytest.raises(ValueError, match="mix source 'b': the source list changed"):
        node.reset()


def test_declared_alignments_must_agree():
    class Declared(list):
        def __init__(self, docs, alignment):
            super().__init__(docs)
            self.labels_alignment = alignment

    m = mix({"a": Declared(_docs(3), "inputs"), "b": Declared(_docs(3), "inputs")}, {"a": 1, "b": 1})
    assert m.labels_alignment == "inputs"
    assert not any("labels" in d for d in _docs(3))
    # a source carrying no labels takes the declared convention; none declared: the caller says
    assert mix({"a": Declared(_docs(3), "inputs"), "b": _docs(3)}, {"a": 1, "b": 1}).labels_alignment == "inputs"
    assert mix({"a": _docs(3), "b": _docs(3)}, {"a": 1, "b": 1}).labels_alignment is None
    with pytest.raises(ValueError, match="mix source 'a' declare labels_alignment='inputs'; mix source 'b' declare "
                                         "labels_alignment='targets'; one pipeline reads every label under one"):
        mix({"a": Declared(_docs(3), "inputs"), "b": Declared(_docs(3), "targets")}, {"a": 1, "b": 1})
    labelled = [{**d, "labels": d["input_ids"]} for d in _docs(3)]  # either convention: nothing says which
    with pytest.raises(ValueError, match="mix source 'b' may carry labels or loss masks but declare no "
                                         "labels_alignment, while mix source 'a' declare labels_alignment='targets'"):
        mix({"a": Declared(_docs(3), "targets"), "b": labelled}, {"a": 1, "b": 1})


def test_a_streaming_hf_dataset_states_its_columns_to_the_convention_rule():
    datasets = pytest.importorskip("datasets")

    class Declared(list):
        def __init__(self, docs, alignment):
            super().__init__(docs)
            self.labels_alignment = alignment

    ids = [np.asarray(d["input_ids"]).tolist() for d in _docs(3)]
    plain = datasets.Dataset.from_dict({"input_ids": ids}).to_iterable_dataset()
    m = mix({"a": Declared(_docs(3), "targets"), "b": plain}, {"a": 1, "b": 1})
    assert m.labels_alignment == "targets"  # its columns carry no labels: it takes the declared convention
    labelled = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).to_iterable_dataset()
    with pytest.raises(ValueError, match="mix source 'b' may carry labels or loss masks but declare no "
                                         "labels_alignment, while mix source 'a' declare labels_alignment='targets'"):
        mix({"a": Declared(_docs(3), "targets"), "b": labelled}, {"a": 1, "b": 1})


def _write(path, docs):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"input_ids": np.asarray(d["input_ids"]).tolist()}) + "\n")
    return path


def _plans(node):
    """One epoch (a fresh reset) of a node of PackPlans: every piece's index, start, tokens and slot lengths."""
    node.reset()
    return [(p.columns.tolist(), p.slot_lens.tolist(), [x.arrays["input_ids"].tolist() for x in p.pieces])
            for p in node]  # fmt: skip


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_precompute_of_a_mix_reproduces_the_loader_packs(tmp_path, stop, capsys):
    web = _write(tmp_path / "web.jsonl", _docs(120, max_len=200))
    chat = _write(tmp_path / "chat.jsonl", _docs(50, lo=100, seed=4, max_len=200))

    def mixed():
        return mix({"web": open_dataset(web), "chat": open_dataset(chat)}, {"web": 0.7, "chat": 0.3}, seed=6,
                   stop=stop)  # fmt: skip

    opts = dict(capacity=256, cp_size=2, layout="thd", overflow="split")
    store = precompute_plan(mixed(), tmp_path / "plan", **precompute_records(**opts))
    online = Pack(Documents(mixed()), **opts)
    want = _plans(online)
    assert _plans(PrecomputedPacks(tmp_path / "plan", mixed())) == want and len(want) > 10
    assert store.manifest["stats"]["sources"] == online.stats.sources
    assert store.manifest["input"]["mix"]["stop"] == stop
    # the command line: --mix NAME=PATH:WEIGHT, the same plan
    args = ["precompute", "--mix", f"web={web}:0.7", "--mix", f"chat={chat}:0.3", "--mix-seed", "6",
            "--mix-stop", stop, "--capacity", "256", "--cp-size", "2", "--layout", "thd", "--overflow", "split",
            "--out", str(tmp_path / "cli"), "--quiet"]  # fmt: skip
    assert cli(args) == 0
    assert _plans(PrecomputedPacks(tmp_path / "cli", mixed())) == want
    counts = online.stats.sources
    assert f"mix ({stop}): chat {counts['chat']['documents']} documents ({counts['chat']['tokens']} tokens), web " in (
        capsys.readouterr().out)
    with pytest.raises(ValueError, match="precomputed from"):
        PrecomputedPacks(tmp_path / "cli", mix({"web": open_dataset(web), "chat": open_dataset(chat)},
                                               {"web": 0.5, "chat": 0.5}, seed=6, stop=stop))  # fmt: skip


def test_precompute_command_line_refusals(tmp_path, capsys):
    web = _write(tmp_path / "web.jsonl", _docs(10))
    base = ["precompute", "--capacity", "64", "--cp-size", "1", "--layout", "identity", "--out", str(tmp_path / "o")]
    for extra, message in [
        (["--mix", f"web={web}"], "--mix 'web=" + str(web) + "' must be NAME=PATH:WEIGHT"),
        (["--mix", f"web={web}:1", "--mix", f"web={web}:2"], "names source 'web' twice"),
        (["--mix", f"web={web}:0"], "weights['web'] must be finite and > 0, got 0.0"),
        (["--mix", f"web={web}:1", "--mix-stop", "cycle"], "unknown stop policy 'cycle'"),
        (["--mix", f"web={web}:1", str(web)], "--mix replaces INPUT"),
        ([], "pass INPUT (a tokenized dataset) or --mix"),
        (["--mix", f"web={web}:1", "--mix-stop", "never"], "stop='never' is endless"),
    ]:
        assert cli(base + extra) == 1
        assert message in capsys.readouterr().err


def test_schedule_plans_a_mix_with_lengths_and_refuses_a_stream():
    a, b = _docs(60), _docs(40, lo=100)
    kw = dict(capacity=64, cp_size=1, cp_rank=0, layout="identity", prefetch=0, schedule="balanced")
    with closing_loader(build_loader(mix({"a": a, "b": b}, {"a": 1, "b": 1}, stop="all_exhausted"), **records(**kw))) as loader:
        tokens = sum(int(batch["padding_mask"].logical_not().sum()) for batch in loader)
    from cpdata.nodes.mixed import MixedDataset

    listed = MixedDataset(mix({"a": a, "b": b}, {"a": 1, "b": 1}, stop="all_exhausted"))
    assert tokens == int(listed.lengths.sum()) and listed.counts["b"]["documents"] > 40
    with pytest.raises(ValueError, match=r"mix sources 'b' \(iterable\) cannot be addressed by index.*plan=StreamPlan\(\)"):
        build_loader(mix({"a": a, "b": Stream(b)}, {"a": 1, "b": 1}), **records(**kw))


def test_docs_mixing_example_runs_as_written(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "packing-and-mixing.md").read_text(encoding="utf-8")
    section = text.split("### Mixing datasets", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    _write(tmp_path / "web.jsonl", _docs(40, max_len=200))
    tok = chat_tokenizer()
    rows = [tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            for c in conversations()]  # fmt: skip
    chat_rows = [{"input_ids": list(r["input_ids"]), "assistant_masks": list(r["assistant_masks"])} for r in rows]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/packing-and-mixing.md:mixing", "exec"), {"chat_rows": chat_rows, "r": 0})  # noqa: S102
    counts = eval(capsys.readouterr().out.strip())  # noqa: S307
    assert set(counts) == {"chat", "web"} and counts["web"]["documents"] == 40, "one DP rank reads all of web"
    assert counts["chat"]["documents"] > 3, "the 3-chat source repeats under all_exhausted"


def test_every_cp_rank_of_a_dp_group_packs_the_same_mix():
    sources = {"a": _docs(60), "b": Stream(_docs(40, lo=100, seed=1))}
    digests = []
    for cp_rank in range(2):
        m = mix(sources, {"a": 1, "b": 2}, seed=4, stop="all_exhausted")
        with closing_loader(build_loader(m, capacity=64, cp_size=2, cp_rank=cp_rank, layout="balanced", plan=StreamPlan(shuffle_buffer=8), data=DataPolicy(dp_rank=1, dp_size=2, shuffle=True), delivery=Delivery(prefetch=0))) as loader:  # fmt: skip
            digests.append([b.layout.digest for b in loader])
    assert digests[0] == digests[1] and len(digests[0]) > 3


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_listed_draw_order_is_the_stream_order(stop, seed):
    from cpdata.nodes.mixed import MixedDataset

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 3000, 3).tolist()
    weights = {n: float(w) for n, w in zip("abc", rng.uniform(0.1, 5, 3), strict=True)}
    sources = {n: [{"input_ids": [i]} for i in range(size)] for n, size in zip("abc", sizes, strict=True)}
    m = mix(sources, weights, seed=seed, stop=stop)
    for epoch in (0, 1):
        m.set_epoch(epoch)
        m.reset()
        stream = [(m.last_source, int(d["input_ids"][0])) for d in m]
        listed = MixedDataset(mix(sources, weights, seed=seed, stop=stop), epoch=epoch)
        assert list(zip(listed.source_id.tolist(), listed.index.tolist(), strict=True)) == stream
        assert len(stream) > 4096 or stop == "first_exhausted"


def test_a_tokenize_node_and_a_hugging_face_dataset_mix():
    """Sources of every kind a pipeline takes: a Tokenize node (chat rows, assistant_only) and a datasets.Dataset."""
    import datasets

    from cpdata import Tokenize

    tok = chat_tokenizer()
    chats = Tokenize([{"messages": c} for c in conversations()], tok, assistant_only=True)
    texts = ["the quick brown fox", "hello there, how can i help you today?", "two plus three is five."]
    hf = datasets.Dataset.from_dict({"input_ids": [tok(t)["input_ids"] for t in texts]})
    m = mix({"chat": chats, "hf": hf}, {"chat": 1, "hf": 1}, stop="all_exhausted", seed=3)
    assert m.labels_alignment == "inputs", "the Dataset carries no labels: it takes the chat source's convention"
    plain = Tokenize([{"text": t} for t in texts], tok)  # states it carries no labels before tokenizing
    assert mix({"chat": chats, "plain": plain}, {"chat": 1, "plain": 1}).labels_alignment == "inputs"
    (batch,) = [b.tensors() for b in _run(shard_graph(m, GraphOptions(capacity=512, cp_size=1, layout="identity", data=DataPolicy(labels_alignment="inputs"))))]  # fmt: skip
    counts = m.counts
    assert counts["chat"]["documents"] >= 3 and counts["hf"]["documents"] >= 3
    assert int(batch["seq_lens"].sum()) == counts["chat"]["tokens"] + counts["hf"]["tokens"]
    masks = {tuple(r["input_ids"]): r["assistant_masks"] for r in _run(Tokenize(
        [{"messages": c} for c in conversations()], tok, assistant_only=True))}  # fmt: skip
    ids, labels, docs = batch["input_ids"][0], batch["labels"][0], batch["document_ids"][0]
    for k, n in enumerate(batch["seq_lens"].tolist()):
        span = np.flatnonzero(docs == k)[:n]
        key = tuple(ids[span].tolist())
        trained = int((labels[span] != -100).sum())
        assert trained == (int(np.asarray(masks[key])[1:].sum()) if key in masks else n - 1)


def test_documents_epochs_drive_the_mix_epochs():
    a, b = _docs(30), _docs(20, lo=100)

    def stream(epoch):
        m = mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=2)
        m.set_epoch(epoch)
        m.reset()
        return [d["input_ids"].tolist() for d in m]

    node = Documents(mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=2), num_epochs=2)
    node.reset()
    got = [d.arrays["input_ids"].tolist() for d in node]
    assert got == stream(0) + stream(1) and stream(0) != stream(1)
    node.reset()  # the next iter(): epochs 2 and 3
    assert [d.arrays["input_ids"].tolist() for d in node] == stream(2) + stream(3)
    assert node.source.epoch == 3
