"""The source protocol (cpdata.sources.protocol): asked for by isinstance only, and kept by every source kind.

Two guarantees:
- no module of cpdata probes a source for a protocol member by name (``getattr(x, "lengths", None)``,
  ``hasattr(x, "fingerprint")``): an AST scan of the package, checked on a snippet that has one;
- every kind of source ``as_source`` accepts (list, tuple, JSONL, ``.npy`` folder, token store, Megatron,
  ``datasets.Dataset``, a concatenation, a slice, a mix and its listing) answers the members it offers
  as the brute-force reference says: lengths equal the tokens read, the fingerprint is the same for the
  same data and differs for other data, the unchanged-check passes on untouched data, and a mix's
  listing holds the documents the mix node streams.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

import cpdata
from cpdata.nodes.source import Documents
from cpdata.sources.fingerprint import check_source_unchanged, source_fingerprint
from cpdata.sources.open import as_source, open_dataset
from cpdata.sources.protocol import (
    SOURCE_MEMBERS,
    Described,
    Identified,
    Indexed,
    Labelled,
    Listable,
    Listed,
    Mixture,
    StatedLengths,
    Watched,
    declared_labels,
    stated_lengths,
)

PACKAGE = Path(cpdata.__file__).parent
NODE_MEMBERS = frozenset({"next_window", "seekable", "source_counts", "fetch"})
"""What the Documents node offers the packer (asked with isinstance(source, Documents), never by name)."""
PROBED = SOURCE_MEMBERS | NODE_MEMBERS


def _member_probes(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, member)`` of every ``getattr(x, "m", ...)`` / ``hasattr(x, "m")`` naming a source or source-node
    member."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in PROBED):  # fmt: skip
            found.append((node.lineno, node.args[1].value))
    return found


def test_the_protocol_lists_the_members_a_source_may_offer():
    assert SOURCE_MEMBERS >= {"lengths", "fingerprint", "check_unchanged", "labels_alignment", "describe_document",
                              "document_sources"}  # fmt: skip


def test_the_scan_finds_a_probe():
    snippet = 'def f(source):\n    return getattr(source, "lengths", None), hasattr(source, "seekable"), getattr(x, "y")\n'
    assert _member_probes(ast.parse(snippet)) == [(2, "lengths"), (2, "seekable")]


def test_no_module_probes_a_source_for_a_protocol_member_by_name():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100  # the whole package is scanned
    probes = [f"{p.relative_to(PACKAGE.parent)}:{line}: {member}"
              for p in files for line, member in _member_probes(ast.parse(p.read_text(encoding="utf-8")))]  # fmt: skip
    assert not probes, f"ask for a source member with isinstance on cpdata.sources.protocol: {probes}"


DOCS = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 1, 7, 2, 4)]


def _tokens_read(source) -> list[int]:
    return [len(source[i]["input_ids"]) for i in range(len(source))]


def _kinds(tmp: Path, docs: list[dict]) -> dict:
    """Every kind of source over ``docs``, made in ``tmp`` (created)."""
    import datasets

    tmp.mkdir(exist_ok=True)
    jsonl = tmp / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(d) + "\n" for d in docs))
    folder = tmp / "npy"
    folder.mkdir()
    for i, d in enumerate(docs):
        np.save(folder / f"{i:03d}.npy", np.asarray(d["input_ids"], dtype=np.int32))
    store = cpdata.sources.write_token_store(docs, tmp / "store")
    megatron = cpdata.sources.write_megatron(docs, tmp / "mega")
    half = len(docs) // 2
    (tmp / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:half]))
    (tmp / "b.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[half:]))
    return {
        "list": list(docs),
        "tuple": tuple(docs),
        "jsonl": open_dataset(jsonl),
        "npy_folder": open_dataset(folder),
        "token_store": store,
        "megatron": megatron,
        "hf_dataset": datasets.Dataset.from_dict({"input_ids": [d["input_ids"] for d in docs]}),
        "concat": open_dataset([tmp / "a.jsonl", tmp / "b.jsonl"]),
        "slice": open_dataset(jsonl)[0 : len(docs)],
    }


@pytest.fixture
def kinds(tmp_path):
    return _kinds(tmp_path, DOCS)


def test_every_indexed_kind_states_the_lengths_it_serves(kinds):
    reference = [len(d["input_ids"]) for d in DOCS]
    for name, raw in kinds.items():
        source = as_source(raw)
        assert isinstance(source, Indexed), name
        assert len(source) == len(DOCS), name
        lengths = stated_lengths(source)
        assert lengths is not None and lengths.dtype == np.int64, name
        assert lengths.tolist() == reference == _tokens_read(source), name
        assert [np.asarray(source[i]["input_ids"]).tolist() for i in range(len(source))] == \
            [d["input_ids"] for d in DOCS], name  # fmt: skip
        if name not in ("list", "tuple"):
            assert isinstance(source, StatedLengths), name


def test_a_list_with_a_malformed_item_states_no_lengths():
    assert stated_lengths([*DOCS, {"text": "no ids"}]) is None
    assert stated_lengths(iter(DOCS)) is None  # a stream states none


def test_identity_is_the_same_for_the_same_data_and_differs_for_other_data(tmp_path, kinds):
    other = _kinds(tmp_path / "other", [{"input_ids": [*d["input_ids"], 9]} for d in DOCS])
    again = _kinds(tmp_path / "again", DOCS)
    for name in kinds:
        source, same, changed = as_source(kinds[name]), as_source(again[name]), as_source(other[name])
        fp = source_fingerprint(source)
        assert isinstance(fp, str) and fp, name
        assert fp == source_fingerprint(same), name
        assert fp != source_fingerprint(changed), name
        if name not in ("list", "tuple"):
            assert isinstance(source, Identified) and isinstance(source, Watched), name
        check_source_unchanged(source, fp)  # untouched data passes


def test_an_edited_list_is_refused_as_changed():
    docs = [dict(d) for d in DOCS]
    fp = source_fingerprint(docs)
    docs[0] = {"input_ids": [42, 43, 44]}
    with pytest.raises(ValueError, match="changed since it was first read"):
        check_source_unchanged(docs, fp)


def test_labels_convention_is_declared_or_none(tmp_path):
    labelled = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    store = cpdata.sources.write_token_store(labelled, tmp_path / "s", labels_alignment="inputs")
    assert isinstance(store, Labelled) and declared_labels(store) == "inputs"
    assert declared_labels(store[0:1]) == "inputs"  # a slice keeps its parent's
    assert declared_labels(labelled) is None
    with pytest.raises(ValueError, match="declares labels_alignment='inputs'"):
        Documents(store, labels_alignment="targets")


def test_described_documents_name_where_they_came_from(kinds):
    concat, piece = kinds["concat"], kinds["slice"]
    assert isinstance(concat, Described) and concat.describe_document(len(DOCS) - 1).startswith("document 2 of part 1")
    assert concat.describe_document(len(DOCS)) is None
    assert isinstance(piece, Described) and "document 0 of the slice" in piece.describe_document(0)


def _mix(docs_a, docs_b, stop="first_exhausted"):
    return cpdata.mix({"a": docs_a, "b": docs_b}, {"a": 2, "b": 1}, seed=3, stop=stop)


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_mix_listed_as_a_source_holds_the_documents_its_node_streams(stop):
    a = [{"input_ids": [1] * n} for n in (2, 3, 4, 5, 6)]
    b = [{"input_ids": [2] * n} for n in (7, 8, 9)]
    node = _mix(a, b, stop)
    assert isinstance(node, Mixture) and isinstance(node, Listable)
    assert as_source(node) is node  # streamed: the node itself
    node.reset()
    streamed = [np.asarray(item["input_ids"]).tolist() for item in node]
    listed = as_source(_mix(a, b, stop), indexed=True)
    assert isinstance(listed, Listed) and isinstance(listed, StatedLengths) and isinstance(listed, Identified)
    assert len(streamed) > len(b) and [np.asarray(listed[i]["input_ids"]).tolist() for i in range(len(listed))] \
        == streamed  # fmt: skip
    assert stated_lengths(listed).tolist() == [len(x) for x in streamed]
    assert listed.epoch_starts.tolist() == [0, len(streamed)]
    assert listed.describe_document(0).startswith("document 0 of mix source")
    check_source_unchanged(listed, source_fingerprint(listed))


def test_an_indexed_reader_refuses_a_stream_it_cannot_index():
    import datasets

    stream = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).to_iterable_dataset()
    assert as_source(stream) is stream  # streamed: read as a re-iterable
    with pytest.raises((TypeError, ValueError), match="(?i)stream|iterable"):
        as_source(stream, indexed=True)
