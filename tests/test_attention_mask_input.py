"""A tokenizer's ``attention_mask`` in the documents: all ones is dropped, a padded row is refused.

``[tokenizer(t) for t in texts]`` gives dicts holding ``input_ids`` and an
all-ones ``attention_mask``; packing builds its own masks from the document
boundaries, so the key must neither reach the batch nor stop a mix with
sources that lack it. A row padded before packing (``padding="max_length"``)
has zeros there: its pad tokens would be packed and trained as text.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizer_fixture import CORPUS, chat_tokenizer

import cpdata
from cpdata.sources.open import open_dataset
from tests.flat_options import records

CONFIG = dict(capacity=64, cp_size=2, cp_rank=0, layout="balanced")


def _batches(source, **kw):
    return list(cpdata.build_loader(source, **records(**{**CONFIG, **kw})))


def _same(a, b) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert list(x.keys()) == list(y.keys()) and all(torch.equal(x[k], y[k]) for k in y)


def test_tokenizer_output_packs_like_its_ids_alone():
    tok = chat_tokenizer()
    encoded = [dict(tok(text)) for text in CORPUS]
    assert all("attention_mask" in e and set(e["attention_mask"]) == {1} for e in encoded)
    got = _batches(encoded)
    assert all("attention_mask" not in b for b in got)
    _same(got, _batches([{"input_ids": e["input_ids"]} for e in encoded]))


def test_tokenizer_output_mixes_with_a_source_without_the_mask():
    tok = chat_tokenizer()
    encoded = [dict(tok(text)) for text in CORPUS]
    plain = [{"input_ids": e["input_ids"]} for e in encoded]
    mixed = cpdata.mix({"enc": encoded, "plain": plain}, {"enc": 1.0, "plain": 1.0}, seed=3)
    reference = cpdata.mix({"enc": plain, "plain": plain}, {"enc": 1.0, "plain": 1.0}, seed=3)
    _same(_batches(mixed), _batches(reference))


def test_a_padded_row_is_refused_with_the_document_and_position():
    tok = chat_tokenizer()
    encoded = tok(CORPUS[:4], padding="longest")  # pads at the end of the shorter rows
    rows = [{"input_ids": ids, "attention_mask": mask} for ids, mask in zip(*encoded.values(), strict=True)]
    assert list(encoded) == ["input_ids", "attention_mask"]
    padded = next(i for i, r in enumerate(rows) if 0 in r["attention_mask"])
    first_zero = rows[padded]["attention_mask"].index(0)
    with pytest.raises(ValueError, match=rf"document {padded}: 'attention_mask' is 0 at \d+ positions "
                       rf"\(first {first_zero}\), so the row holds padding; tokenize without padding"):  # fmt: skip
        _batches(rows)


def test_a_padded_jsonl_row_is_refused(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"input_ids": [5, 6, 7, 8], "attention_mask": [1, 1, 1, 1]}, {"input_ids": [5, 6, 0], "attention_mask": [1, 1, 0]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"rows.jsonl line 2: 'attention_mask' is 0 at 1 positions \(first 2\)"):
        _batches(open_dataset(path))
    rows[1]["attention_mask"] = [1, 1, 1]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _same(_batches(open_dataset(path)), _batches([{"input_ids": r["input_ids"]} for r in rows]))


def test_pack_store_keeps_no_attention_mask_and_refuses_a_padded_row(tmp_path):
    """``cpdata pack-store`` parses rows as ``open_dataset`` does: an all-ones mask is dropped (the store
    holds no ``attention_mask`` file), a padded row is refused naming its line, and nothing is written."""
    from cpdata.offline.tokenize_files import convert_jsonl

    path = tmp_path / "rows.jsonl"
    rows = [{"input_ids": [5, 6, 7, 8], "attention_mask": [1, 1, 1, 1], "loss_mask": [0, 1, 1, 1]},
            {"input_ids": [5, 6, 0], "attention_mask": [1, 1, 0]}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    padded = r"rows.jsonl line 2: 'attention_mask' is 0 at 1 positions \(first 2\)"
    with pytest.raises(ValueError, match=padded):
        convert_jsonl(path, tmp_path / "padded")
    assert not (tmp_path / "padded").exists()
    rows[1]["attention_mask"] = [1, 1, 1]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store, _ = convert_jsonl(path, tmp_path / "store")
    assert store.per_token_keys == {"loss_mask"} and not (tmp_path / "store" / "attention_mask.bin").exists()
    for stored, read in zip(store, open_dataset(path), strict=True):
        assert stored.keys() == read.keys() and all((stored[k] == read[k]).all() for k in read)
