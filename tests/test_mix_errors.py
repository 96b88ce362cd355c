"""A bad document of a mix is named by its source and its index there, not by its position in the mixed stream."""

from __future__ import annotations

import json

import pytest

from cpdata import Documents, PrecomputedPacks, build_loader, closing_loader, mix, open_dataset, precompute
from cpdata.nodes.mixed import MixedDataset
from cpdata.nodes.options import DataPolicy
from tests.flat_options import precompute_records, records

KW = dict(capacity=64, cp_size=1, cp_rank=0, layout="identity", prefetch=0)
WHERE = r"document 3 of mix source 'b' \(source 1 of \['a', 'b'\], draw \d+ of epoch 0\)"


class Stream:
    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def _sources(bad):
    a = [{"input_ids": [1, 2, 3]} for _ in range(10)]
    b = [{"input_ids": [4, 5]} for _ in range(10)]
    b[3] = bad
    return a, b


def _drain(source, **kw):
    with closing_loader(build_loader(source, **records(**{**KW, **kw}))) as loader:
        return sum(1 for _ in loader)


BAD = [
    ({"input_ids": [4, -5]}, {}, r": 'input_ids' must be >= 0, got -5 at position 1; .*do not pre-pad with negative"),
    ({"input_ids": [4, 500]}, {"vocab_size": 100}, r": input_ids\[1\]=500 is >= vocab_size=100; check the tokenizer"),
    ({"text": "hi"}, {}, r" has no 'input_ids'; its keys are \['text'\]"),
    ({"input_ids": [4, 5], "labels": [4]}, {"labels_alignment": "inputs"}, r": 'labels' has 1 entries but"),
]


@pytest.mark.parametrize("bad, kw, rest", BAD)
@pytest.mark.parametrize("kind", ["list", "stream"])
def test_the_loader_names_the_source_and_its_index(bad, kw, rest, kind):
    a, b = _sources(bad)
    source_b = b if kind == "list" else Stream(b)
    with pytest.raises(ValueError, match=WHERE + rest):
        _drain(mix({"a": a, "b": source_b}, {"a": 1, "b": 1}, seed=0), **kw)
    node = Documents(mix({"a": a, "b": source_b}, {"a": 1, "b": 1}, seed=0), **kw)  # next(), one by one
    node.reset()
    with pytest.raises(ValueError, match=WHERE + rest):
        list(node)


def test_the_dp_rank_that_reads_the_document_names_it_and_a_schedule_too():
    a, b = _sources({"input_ids": [4, -5]})
    errors = []
    for dp_rank in range(2):
        try:
            _drain(mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=0), dp_rank=dp_rank, dp_size=2)
        except ValueError as exc:
            errors.append(str(exc))
    assert len(errors) == 1 and errors[0].startswith("document 3 of mix source 'b' (source 1 of ['a', 'b'], draw ")
    with pytest.raises(ValueError, match=WHERE + ": 'input_ids' must be >= 0"):
        _drain(mix({"a": a, "b": b}, {"a": 1, "b": 1}, seed=0), schedule="balanced")


def test_precompute_and_precomputed_packs_name_the_source(tmp_path):
    a, b = _sources({"input_ids": [4, 500]})
    for name, docs in (("a", a), ("b", b)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)

    def mixed():
        return mix({"a": open_dataset(tmp_path / "a.jsonl"), "b": open_dataset(tmp_path / "b.jsonl")}, {"a": 1, "b": 1})

    opts = dict(capacity=64, cp_size=1, layout="identity")
    with pytest.raises(ValueError, match=r"mix source 'b' \(source 1 of \['a', 'b'\]\): .*b.jsonl: document 3 has "
                                         r"token id 500 at position 1, >= vocab_size=100"):  # fmt: skip
        precompute(mixed(), tmp_path / "checked", **precompute_records(vocab_size=100, **opts))
    precompute(mixed(), tmp_path / "plan", **precompute_records(**opts))
    with pytest.raises(ValueError, match=WHERE + r": input_ids\[1\]=500 is >= vocab_size=100"):
        list(PrecomputedPacks(tmp_path / "plan", mixed(), data=DataPolicy(vocab_size=100)))


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("kind", ["list", "stream"])
def test_every_draw_is_placed_in_its_source_across_passes_and_dp_ranks(stop, kind):
    """describe_document(j) names the very document draw j read: the index encodes (source, index)."""
    a = [{"input_ids": [i]} for i in range(7)]
    b = [{"input_ids": [1000 + i]} for i in range(300)]
    sources = {"a": a if kind == "list" else Stream(a), "b": b}
    for dp_rank in range(2):
        m = mix(sources, {"a": 1, "b": 2}, seed=3, stop=stop)
        node = Documents(m, dp_rank=dp_rank, dp_size=2)
        node.reset()
        placed, seen = [], []
        for position, document in enumerate(node):
            j = 2 * position + dp_rank  # this rank's draws
            (token,) = document.arrays["input_ids"].tolist()
            seen.append(("b", token - 1000) if token >= 1000 else ("a", token))
            text = m.describe_document(j)
            name = text.split("mix source '")[1][0]
            placed.append((name, int(text.split()[1])))
        assert placed == seen and len(seen) > (5 if stop == "first_exhausted" else 100)
        assert stop == "first_exhausted" or any("pass 1 over it" in m.describe_document(j) for j in range(40))
    listed = MixedDataset(mix({"a": a, "b": b}, {"a": 1, "b": 2}, seed=3, stop=stop), epochs=2)
    for i in (0, 5, int(listed.epoch_starts[1]) + 2):
        text = listed.describe_document(i)
        assert text.startswith(f"document {int(listed.index[i])} of mix source {'ab'[int(listed.source_id[i])]!r}")
    assert "of epoch 1)" in listed.describe_document(int(listed.epoch_starts[1]))
