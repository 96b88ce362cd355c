"""Binary token store: write (Python, ``cpdata tokenize``, ``cpdata pack-store``, parallel), open O(1), serve."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from cpdata import PrecomputedPacks, build_loader, open_dataset, precompute
from cpdata.cli import main as cli_main
from cpdata.nodes.loader import close_loader
from cpdata.sources.tokenstore import TokenStore, write_token_store
from tests.flat_options import precompute_records, records
from tests.test_precompute import assert_batches_equal
from tests.tokenizer_fixture import CORPUS, chat_tokenizer, conversations


def _docs(n: int = 50, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        ids = rng.integers(0, 300, size=int(rng.integers(0, 40)))
        doc = {"input_ids": ids}
        if i % 3 == 0:
            doc["loss_mask"] = (rng.random(ids.size) < 0.5).astype(np.int8)
        docs.append(doc)
    return docs


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_round_trip_is_exact_with_sparse_extras_and_opens_from_the_index(tmp_path):
    docs = _docs()
    store = write_token_store(docs, tmp_path / "s", vocab_size=300)
    assert store.manifest["dtype"] == "<u2" and len(store) == len(docs)
    np.testing.assert_array_equal(store.lengths, [d["input_ids"].size for d in docs])
    opened = open_dataset(tmp_path / "s")
    assert isinstance(opened, TokenStore)
    for i, doc in enumerate(docs):
        got = opened[i]
        assert sorted(got) == sorted(doc), i
        for key in doc:
            np.testing.assert_array_equal(got[key], doc[key])
        assert got["input_ids"].dtype == np.int64
    clone = pickle.loads(pickle.dumps(opened))
    assert len(pickle.dumps(opened)) < 5_000 and clone.fingerprint() == opened.fingerprint()
    np.testing.assert_array_equal(clone[7]["input_ids"], docs[7]["input_ids"])
    assert write_token_store(_docs(), tmp_path / "t", vocab_size=300).fingerprint() == store.fingerprint()  # deterministic
    wide = write_token_store([{"input_ids": [70_000, 1]}], tmp_path / "w")
    assert wide.manifest["dtype"] == "<u4" and wide[0]["input_ids"].tolist() == [70_000, 1]


def test_open_does_not_read_the_tokens(tmp_path, monkeypatch):
    import cpdata.sources.chunksums as chunksums

    write_token_store(_docs(), tmp_path / "s")
    hashed = []
    digest = chunksums._digest

    def counting(data):
        hashed.append(len(data))
        return digest(data)

    monkeypatch.setattr(chunksums, "_digest", counting)
    store = TokenStore(tmp_path / "s")
    assert isinstance(store._tokens, np.memmap) and isinstance(store._offsets, np.memmap)
    assert store.fingerprint() == f"token_store:{store.manifest['manifest_sha256']}"
    store.check_token_ids(300)  # from the manifest's max id
    assert hashed == []  # the open read no file content
    store[0]  # the first read checks the chunks it touches: offsets, tokens, the extra's flags and data
    assert len(hashed) == 4 and sum(hashed) == sum(e["bytes"] for e in store.manifest["files"].values())
    store[1]
    assert len(hashed) == 4  # each chunk once per process
    hashed.clear()
    TokenStore(tmp_path / "s", verify=True)
    assert sum(hashed) == sum(e["bytes"] for e in store.manifest["files"].values())


def test_bad_input_and_damage_are_refused(tmp_path):
    with pytest.raises(ValueError, match="document 1 has token id 300 at position 1, >= vocab_size=300"):
        write_token_store([{"input_ids": [1]}, {"input_ids": [2, 300]}], tmp_path / "bad", vocab_size=300)
    with pytest.raises(ValueError, match="document 0 has token id -1"):
        write_token_store([{"input_ids": [-1]}], tmp_path / "bad")
    with pytest.raises(ValueError, match="'loss_mask' has 1 entries but input_ids has 2"):
        write_token_store([{"input_ids": [1, 2], "loss_mask": [1]}], tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())  # nothing half-written
    write_token_store(_docs(), tmp_path / "s")
    with pytest.raises(ValueError, match="already exists"):
        write_token_store(_docs(), tmp_path / "s")
    tokens = tmp_path / "s" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[3] ^= 0xFF
    tokens.write_bytes(bytes(data))
    TokenStore(tmp_path / "s")  # sizes match: the O(1) open does not see a flipped byte ...
    with pytest.raises(ValueError, match=r"tokens.bin bytes 0\.\.\d+ \(chunk 0 of 1\) do not match"):
        TokenStore(tmp_path / "s", verify=True)  # ... verification does
    tokens.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="has .* bytes, the manifest records"):
        TokenStore(tmp_path / "s")


def test_a_store_plans_and_serves_like_the_online_pipeline(tmp_path):
    docs = [d for d in _docs(80) if d["input_ids"].size]
    docs = [{"input_ids": d["input_ids"]} for d in docs]
    store = write_token_store(docs, tmp_path / "s")
    kw = {"capacity": 64, "cp_size": 2, "layout": "thd", "overflow": "split"}
    precompute(store, tmp_path / "plan", **precompute_records(**kw))
    from cpdata import Collate, ShardForRank

    served = list(ShardForRank(Collate(PrecomputedPacks(tmp_path / "plan", open_dataset(tmp_path / "s"))),
                               cp_size=2, cp_rank=1, layout="thd"))  # fmt: skip
    loader = build_loader(docs, **records(cp_rank=1, restart_on_stop_iteration=False, **kw))
    online = list(loader)
    close_loader(loader)
    assert len(served) == len(online) > 3
    for a, e in zip(served, online, strict=True):
        assert_batches_equal(a, e)
    from_store = build_loader(store, **records(cp_rank=1, restart_on_stop_iteration=False, **kw))
    for a, e in zip(from_store, online, strict=True):
        assert_batches_equal(a, e)
    close_loader(from_store)


def test_pack_store_cli_parallel_output_equals_serial(tmp_path, capsys):
    docs = _docs(1300)  # more than two chunks of lines
    src = _jsonl(tmp_path / "d.jsonl", [{k: v.tolist() for k, v in d.items()} for d in docs])
    assert cli_main(["pack-store", str(src), "--out", str(tmp_path / "one"), "--quiet", "--vocab-size", "300"]) == 0
    assert "1300 documents" in capsys.readouterr().out
    assert cli_main(["pack-store", str(src), "--out", str(tmp_path / "two"), "--quiet", "--vocab-size", "300",
                     "--workers", "2"]) == 0  # fmt: skip
    one, two = TokenStore(tmp_path / "one", verify=True), TokenStore(tmp_path / "two", verify=True)
    assert one.fingerprint() == two.fingerprint()
    for i in (0, 3, 650, 1299):
        for key in docs[i]:
            np.testing.assert_array_equal(two[i][key], docs[i][key])
    assert open_dataset(src).lengths.tolist() == two.lengths.tolist()
    bad = _jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1]}, {"input_ids": [1.5]}])
    assert cli_main(["pack-store", str(bad), "--out", str(tmp_path / "bad"), "--quiet"]) == 1
    assert "bad.jsonl line 2:" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_tokenize_cli_and_precompute_with_a_tokenizer(tmp_path, capsys):
    tok = chat_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"text": t} for t in CORPUS] + [{"messages": m} for m in conversations()]
    src = _jsonl(tmp_path / "rows.jsonl", rows)
    args = ["tokenize", str(src), "--tokenizer", str(tmp_path / "tok"), "--append-eos", "--assistant-only",
            "--max-length", "12", "--out", str(tmp_path / "tokens"), "--quiet"]  # fmt: skip
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    # every text row is longer than 12 tokens with its EOS: --max-length cuts the EOS of each, none is counted
    assert "9 documents" in out and "3 chat rows, EOS appended 0, truncated 9" in out
    store = TokenStore(tmp_path / "tokens")
    assert store.manifest["dtype"] == "<u2" and store.labels_alignment == "inputs"
    for i, text in enumerate(CORPUS):
        assert store[i]["input_ids"].tolist() == (tok(text)["input_ids"] + [tok.eos_token_id])[:12]
        assert len(tok(text)["input_ids"]) >= 12 and store[i]["input_ids"][-1] != tok.eos_token_id
        assert store[i]["assistant_masks"].tolist() == [1] * min(12, len(tok(text)["input_ids"]) + 1)
    ref = tok.apply_chat_template(conversations()[1], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert store[7]["assistant_masks"].tolist() == ref["assistant_masks"][:12]
    assert cli_main([*args[:-3], "--out", str(tmp_path / "tokens2"), "--workers", "2", "--quiet"]) == 0
    assert TokenStore(tmp_path / "tokens2").fingerprint() == store.fingerprint()

    plan = tmp_path / "plan"
    assert cli_main(["precompute", str(src), "--tokenizer", str(tmp_path / "tok"), "--append-eos", "--capacity", "32",
                     "--overflow", "split", "--cp-size", "2", "--layout", "thd", "--out", str(plan), "--quiet"]) == 0  # fmt: skip
    assert (tmp_path / "plan.tokens" / "tokens.bin").is_file()
    served = list(PrecomputedPacks(plan, open_dataset(tmp_path / "plan.tokens")))
    assert sum(p.pieces[k].arrays["input_ids"].size for p in served for k in range(len(p.pieces))) == sum(
        len(tok(t)["input_ids"]) + 1 for t in CORPUS) + sum(
        len(tok.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) for m in conversations())  # fmt: skip
    capsys.readouterr()
    assert cli_main(["precompute", str(src), "--append-eos", "--capacity", "32", "--cp-size", "2", "--layout", "thd",
                     "--out", str(tmp_path / "p2")]) == 1  # fmt: skip
    assert "need --tokenizer PATH" in capsys.readouterr().err


def test_resume_onto_another_store_and_a_rewritten_store_are_refused(tmp_path):
    docs = [{"input_ids": d["input_ids"]} for d in _docs(40) if d["input_ids"].size]
    a = write_token_store(docs, tmp_path / "a")
    b = write_token_store([{"input_ids": d["input_ids"][::-1].copy()} for d in docs], tmp_path / "b")
    kw = {"capacity": 64, "cp_size": 1, "cp_rank": 0, "layout": "identity", "overflow": "split"}
    loader = build_loader(a, **records(**kw))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    close_loader(loader)
    other = build_loader(b, **records(**kw))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="fingerprint token_store:"):
        next(iter(other))
    close_loader(other)
    write_token_store(docs[:-1], tmp_path / "a", overwrite=True)
    with pytest.raises(ValueError, match="was rewritten since it was opened"):
        a.check_unchanged()


def test_a_file_resized_or_removed_under_an_open_store_is_refused_at_the_check(tmp_path):
    """The manifest untouched, a data file grown, cut or removed since opening: ``check_unchanged`` (each
    epoch's start) names the file and what happened, before any read meets the bytes."""
    docs = _docs(20)
    store = write_token_store(docs, tmp_path / "s", vocab_size=300)
    store.check_unchanged()  # as written: nothing to report
    tokens = tmp_path / "s" / "tokens.bin"
    size = tokens.stat().st_size
    with open(tokens, "ab") as f:
        f.write(b"\0\0")  # bytes appended past the last document: no read would ever check them
    with pytest.raises(ValueError, match=rf"tokens.bin has {size + 2} bytes, the manifest records {size}"):
        store.check_unchanged()
    with open(tokens, "r+b") as f:
        f.truncate(size)
    store.check_unchanged()  # the same bytes again
    (tmp_path / "s" / "loss_mask.bin").unlink()
    with pytest.raises(ValueError, match=r"loss_mask.bin was removed since the store was opened"):
        store.check_unchanged()
