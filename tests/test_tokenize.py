"""``Tokenize`` and ``RowTokenizer``: text and chat rows to documents with a BPE trained in the test."""

from __future__ import annotations

import numpy as np
import pytest
import torchdata.nodes as tn

from cpdata import Tokenize
from cpdata.nodes.options import DataPolicy, StreamPlan
from cpdata.sources.tokenizer import RowTokenizer, load_tokenizer
from tests.state_contract import run_save_load_contract
from tests.tokenizer_fixture import CHAT_TEMPLATE, CORPUS, chat_tokenizer, conversations

EOS = 1


def _rows() -> list[dict]:
    texts = [{"text": t} for t in CORPUS]
    chats = [{"messages": m} for m in conversations()]
    return [texts[0], chats[0], texts[1], texts[2], chats[1], texts[3], chats[2], texts[4], texts[5]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The fixture tokenizer saved as a folder and as a bare tokenizer.json file."""
    root = tmp_path_factory.mktemp("tok")
    tok = chat_tokenizer()
    tok.save_pretrained(root / "folder")
    tok.backend_tokenizer.save(str(root / "tokenizer.json"))
    return root


def test_text_rows_with_a_callable_append_eos_and_max_length():
    node = Tokenize([{"text": "abc"}, {"text": "hello world"}, {"text": ""}], lambda s: list(s.encode()),
                    append_eos=True, eos_token_id=256, max_length=6)  # fmt: skip
    docs = list(node)
    assert [d["input_ids"].tolist() for d in docs] == [[97, 98, 99, 256], list(b"hello "), [256]]
    assert all(d["input_ids"].dtype == np.int64 and list(d) == ["input_ids"] for d in docs)
    stats = node.stats.as_dict()
    # "hello world" + EOS is 12 tokens: max_length keeps 6, the EOS is cut, so it is not counted as appended
    assert stats == {"documents": 3, "chat": 0, "tokens": 11, "eos_appended": 2, "truncated": 1, "truncated_tokens": 6}
    assert stats["eos_appended"] == sum(d["input_ids"][-1] == 256 for d in docs)


@pytest.mark.parametrize("form", ["object", "folder", "tokenizer.json", "tokenizers.Tokenizer"])
def test_hf_tokenizer_in_every_form_gives_the_tokenizers_ids(saved, form):
    tok = chat_tokenizer()
    given = {
        "object": tok,
        "folder": saved / "folder",
        "tokenizer.json": saved / "tokenizer.json",
        "tokenizers.Tokenizer": tok.backend_tokenizer,
    }[form]
    docs = list(Tokenize([{"text": t} for t in CORPUS], given, append_eos=True, eos_token_id=EOS))
    for doc, text in zip(docs, CORPUS, strict=True):
        assert doc["input_ids"].tolist() == tok(text)["input_ids"] + [EOS]
    assert len(set(len(d["input_ids"]) for d in docs)) > 1


def test_chat_rows_carry_the_templates_assistant_mask_aligned_with_the_inputs(saved):
    tok = chat_tokenizer()
    node = Tokenize([{"messages": m} for m in conversations()], saved / "folder", assistant_only=True)
    assert node.labels_alignment == "inputs"
    docs = list(node)
    for doc, messages in zip(docs, conversations(), strict=True):
        ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert doc["input_ids"].tolist() == ref["input_ids"]
        assert doc["assistant_masks"].tolist() == ref["assistant_masks"]
        # brute force: the masked tokens decode to the assistant replies and their <eos>, nothing else
        marked = doc["input_ids"][doc["assistant_masks"] == 1].tolist()
        replies = "".join(m["content"] + "<eos>" for m in messages if m["role"] == "assistant")
        assert tok.decode(marked) == replies
        assert doc["assistant_masks"].sum() < doc["assistant_masks"].size
    plain = list(Tokenize([{"messages": conversations()[0]}], tok, append_eos=True))  # no mask, no extra EOS
    assert list(plain[0]) == ["input_ids"] and node.stats.chat == 3
    assert plain[0]["input_ids"].tolist() == tok.apply_chat_template(conversations()[0], tokenize=True,
                                                                     return_dict=True)["input_ids"]  # fmt: skip
    text = list(Tokenize([{"text": CORPUS[0]}], tok, assistant_only=True))[0]  # text rows: every token trained
    assert text["assistant_masks"].tolist() == [1] * len(text["input_ids"])


def test_max_length_cuts_chat_documents_and_their_masks_and_counts():
    tok = chat_tokenizer()
    full = list(Tokenize([{"messages": m} for m in conversations()], tok, assistant_only=True))
    cut = Tokenize([{"messages": m} for m in conversations()], tok, assistant_only=True, max_length=12)
    docs = list(cut)
    for a, b in zip(docs, full, strict=True):
        assert a["input_ids"].tolist() == b["input_ids"][:12].tolist()
        assert a["assistant_masks"].tolist() == b["assistant_masks"][:12].tolist()
    over = [len(b["input_ids"]) - 12 for b in full if len(b["input_ids"]) > 12]
    assert over and cut.stats.truncated == len(over) and cut.stats.truncated_tokens == sum(over)


@pytest.mark.parametrize("kind", ["sequence", "iterable", "node"])
def test_exact_resume(kind, saved):
    rows = _rows()

    class Rows:
        def __iter__(self):
            return iter(rows)

    def make():
        source = {"sequence": lambda: rows, "iterable": Rows, "node": lambda: tn.IterableWrapper(rows)}[kind]()
        return Tokenize(source, saved / "folder", assistant_only=True, append_eos=True, max_length=20)

    reference = run_save_load_contract(make, midpoints=[0, 1, 4, len(rows)], epochs=2)
    assert len(reference) == 2 * len(rows)
    node = make()
    for _ in range(5):
        next(node)
    restored = make()
    restored.reset(node.state_dict())
    assert restored.stats.as_dict() == node.stats.as_dict() and node.stats.truncated > 0


def test_bad_rows_and_options_are_refused_with_the_fix(saved):
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match=r"row 1 has keys \['body'\]: expected 'text' \(text\) or 'messages'"):
        list(Tokenize([{"text": "a"}, {"body": "b"}], tok))
    with pytest.raises(TypeError, match="row 0: chat rows need a transformers tokenizer"):
        list(Tokenize([{"messages": conversations()[0]}], lambda s: [1]))
    no_generation = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    with pytest.raises(ValueError, match=r"marks no assistant token; wrap the assistant content in \{% generation %\}"):
        list(Tokenize([{"messages": conversations()[0]}], tok, assistant_only=True, chat_template=no_generation))
    with pytest.raises(ValueError, match="append_eos=True needs an EOS id .* pass eos_token_id="):
        Tokenize([], lambda s: [1], append_eos=True)
    with pytest.raises(ValueError, match="^max_length must be an int >= 1 or None, got 0$"):
        Tokenize([], tok, max_length=0)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(saved / "nope")
    with pytest.raises(TypeError, match="one-shot iterator"):
        Tokenize(iter([{"text": "a"}]), tok)
    node = Tokenize(_rows(), tok, max_length=20)
    with pytest.raises(ValueError, match="Tokenize state was saved with"):
        Tokenize(_rows(), tok, max_length=21).reset(node.state_dict())


def test_row_tokenizer_pickles_by_path(saved):
    import pickle

    rt = RowTokenizer(saved / "folder", append_eos=True)
    clone = pickle.loads(pickle.dumps(rt))
    assert clone({"text": CORPUS[1]})["input_ids"].tolist() == rt({"text": CORPUS[1]})["input_ids"].tolist()
    assert len(pickle.dumps(rt)) < 2_000


def test_vocab_size_is_the_tokenizers_length_and_the_stores_default(saved, tmp_path):
    from cpdata.offline.tokenize_files import convert_jsonl

    tok = chat_tokenizer()
    assert RowTokenizer(tok).vocab_size == RowTokenizer(saved / "folder").vocab_size == len(tok) > 0
    assert RowTokenizer(lambda s: list(s.encode())).vocab_size is None  # a callable has no vocabulary to name
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(f'{{"text": "{t}"}}\n' for t in CORPUS[:3]))
    store, _ = convert_jsonl(src, tmp_path / "store", tokenizer=RowTokenizer(tok))
    assert store.manifest["vocab_size"] == len(tok)
    assert store.manifest["dtype"] == ("<u2" if len(tok) <= 1 << 16 else "<u4")
    assert [store[i]["input_ids"].tolist() for i in range(3)] == [tok(t)["input_ids"] for t in CORPUS[:3]]


def test_assistant_only_trains_only_the_replies_end_to_end():
    """Tokenize's inputs-aligned masks become next-token targets: a label is kept only where the next token is a
    reply token (brute force per document), through Documents -> Pack -> Collate -> ShardForRank."""
    from cpdata import build_loader
    from cpdata.nodes.loader import close_loader

    tok = chat_tokenizer()
    rows = [{"messages": m} for m in conversations()] + [{"text": CORPUS[0]}]
    docs = list(Tokenize(rows, tok, assistant_only=True))
    expected = []
    for d in docs:
        ids, mask = d["input_ids"], d["assistant_masks"]
        labels = np.full(ids.shape, -100, dtype=np.int64)
        labels[:-1] = np.where(mask[1:] == 1, ids[1:], -100)
        expected.append(labels)
    loader = build_loader(Tokenize(rows, tok, assistant_only=True), capacity=256, cp_size=1, cp_rank=0, layout="identity", restart_on_stop_iteration=False, plan=StreamPlan(algorithm="next_fit"))  # fmt: skip
    batches = list(loader)
    close_loader(loader)
    assert len(batches) == 1
    total = sum(d["input_ids"].size for d in docs)
    labels = batches[0]["labels"].reshape(-1)[:total].numpy()
    np.testing.assert_array_equal(labels, np.concatenate(expected))
    trained = int((labels != -100).sum())
    assert 0 < trained < total - len(CORPUS[0].split())  # prompts are not trained, the text row is
    with pytest.raises(ValueError, match="labels_alignment"):
        build_loader(Tokenize(rows, tok, assistant_only=True), capacity=256, cp_size=1, cp_rank=0, layout="identity", data=DataPolicy(labels_alignment="targets"))  # fmt: skip
