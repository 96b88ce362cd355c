"""Labels and loss masks mean next-token targets in every batch, whatever the source's convention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizer_fixture import chat_tokenizer, conversations
from torchdata.nodes import IterableWrapper

from cpdata import Documents, build_loader, closing_loader
from cpdata.nodes.loader import GraphOptions, shard_graph
from cpdata.nodes.options import DataPolicy, Delivery, StreamPlan
from cpdata.nodes.pack import Pack
from tests.flat_options import graph_options, precompute_records

PACK = dict(capacity=128, cp_size=1, layout="identity", algorithm="next_fit")


def _full_batches(docs, **kwargs) -> list[dict[str, np.ndarray]]:
    node = shard_graph(docs, graph_options(**{**PACK, **kwargs}))
    node.reset()
    return [batch.tensors() for batch in node]


def _chats() -> list[dict]:
    tok = chat_tokenizer()
    out = []
    for chat in conversations():
        row = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        out.append({"input_ids": list(row["input_ids"]), "assistant_masks": list(row["assistant_masks"])})
    return out


def _targets_by_document(batches) -> dict[int, list[tuple[int, int]]]:
    """``{slot: [(input token, target), ...]}`` of the trained positions, read off the batch tensors."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for b, t in enumerate(batches):
        ids, labels, docs = (t[k].reshape(-1) for k in ("input_ids", "labels", "document_ids"))
        for i in np.flatnonzero(labels != -100).tolist():
            out.setdefault((b, int(docs[i])), []).append((int(ids[i]), int(labels[i])))
    return {k: out[k] for k in sorted(out)}


def test_assistant_masks_from_a_chat_template_train_exactly_the_assistant_tokens():
    """apply_chat_template(return_assistant_tokens_mask=True) with a real BPE tokenizer: every assistant token
    (first one included) is a target, predicted from the token before it; nothing else is (eos -> <|user|> not)."""
    tok = chat_tokenizer()
    chats = _chats()
    (batch,) = _full_batches(chats, labels_alignment="inputs", padding_token_id=tok.pad_token_id)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    starts = np.concatenate([[0], np.cumsum(batch["seq_lens"])])
    assert len(starts) - 1 == len(chats)
    for doc, (lo, hi) in zip(chats, zip(starts[:-1], starts[1:], strict=True), strict=True):
        mask = np.asarray(doc["assistant_masks"])
        assert ids[lo:hi].tolist() == doc["input_ids"], "bfd keeps each chat whole (order of the pack)"
        expected = np.full(hi - lo, -100)
        expected[:-1] = np.where(mask[1:] == 1, doc["input_ids"][1:], -100)
        assert labels[lo:hi].tolist() == expected.tolist()
        trained_inputs = {int(i) for i in np.flatnonzero(labels[lo:hi] != -100) + 1}
        assert trained_inputs == set(np.flatnonzero(mask).tolist()), "exactly the assistant tokens are targets"
        first_reply = int(np.flatnonzero(mask)[0])
        assert labels[lo + first_reply - 1] == doc["input_ids"][first_reply], "the first assistant token is trained"
    eos, user = tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")
    nxt = np.flatnonzero(ids[:-1] == eos)
    assert nxt.size and all(labels[i] != user for i in nxt.tolist()), "eos -> <|user|> is never a target"
    assert (batch["loss_mask"][0] == (labels != -100)).all()


def test_hf_and_megatron_conventions_give_the_same_batch():
    """HF/TRL labels aligned with input_ids ("inputs") and Megatron/NeMo labels already shifted ("targets")
    describe the same targets; mixing documents with and without labels in one pack stays document-local."""
    rng = np.random.default_rng(0)
    hf, megatron = [], []
    for n in (9, 13, 5, 20, 7):
        ids = rng.integers(0, 50, n)
        prompt = int(rng.integers(1, n))
        hf_labels = np.where(np.arange(n) >= prompt, ids, -100)
        hf.append({"input_ids": ids, "labels": hf_labels})
        megatron.append({"input_ids": ids, "labels": np.append(hf_labels[1:], -100)})
    hf.append({"input_ids": rng.integers(0, 50, 6)})  # plain text: next-token labels derived
    megatron.append(hf[-1])
    a = _full_batches(hf, labels_alignment="inputs")
    b = _full_batches(megatron, labels_alignment="targets")
    assert len(a) == len(b) == 1
    for key in a[0]:
        assert np.array_equal(a[0][key], b[0][key]), key
    targets = _targets_by_document(a)
    assert sum(len(v) for v in targets.values()) == sum(int((d["labels"] != -100).sum()) for d in megatron[:-1]) + 5


@pytest.mark.parametrize("key", ["labels", "loss_mask", "assistant_masks", "completion_mask"])
def test_labels_or_a_mask_without_an_alignment_is_refused(key):
    docs = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6], key: [1, 1, 0]}]
    node = shard_graph(docs, graph_options(**PACK))
    node.reset()
    with pytest.raises(ValueError) as err:
        list(node)
    message = str(err.value)
    for part in ("document 1", key, "labels_alignment='inputs'", "labels_alignment='targets'",
                 "Hugging Face", "TRL", "torchtune", "Megatron", "NeMo"):
        assert part in message, part
    with pytest.raises(ValueError, match="unknown labels_alignment 'hf'"):
        Documents(docs, labels_alignment="hf")


def test_given_labels_win_over_a_mask():
    ids = np.array([5, 6, 7, 8, 9])
    doc = {"input_ids": ids, "labels": [-100, -100, 7, 8, 9], "completion_mask": [0, 0, 0, 0, 1]}
    (batch,) = _full_batches([doc], labels_alignment="inputs")
    assert batch["labels"][0, :5].tolist() == [-100, 7, 8, 9, -100]
    assert batch["loss_mask"][0, :5].tolist() == [0, 1, 1, 1, 0]


def test_split_pieces_keep_the_target_at_the_cut():
    """A document longer than the pack is split; the target of a piece's last token is the next piece's first
    token (its shifted label), for "inputs" labels and masks alike."""
    ids = np.arange(1, 41)
    doc = {"input_ids": ids, "labels": ids.copy()}
    batches = _full_batches([doc], labels_alignment="inputs", capacity=16, overflow="split")
    labels = np.concatenate([b["labels"][0][: int(b["seq_lens"][0])] for b in batches])
    assert labels.tolist() == ids[1:].tolist() + [-100]
    masked = {"input_ids": ids, "loss_mask": (ids > 16).astype(np.int64)}
    batches = _full_batches([masked], labels_alignment="inputs", capacity=16, overflow="split")
    first = batches[0]["labels"][0]
    assert first[:15].tolist() == [-100] * 15 and first[15] == 17, "token 16's target (17) sits at the cut"


def test_fully_masked_and_truncated_documents_are_dropped_and_counted():
    ids = np.arange(1, 21)
    docs = [
        {"input_ids": ids[:6], "loss_mask": np.zeros(6)},  # nothing trained
        {"input_ids": ids, "loss_mask": (np.arange(20) >= 17).astype(np.float32)},  # only after the cut
        {"input_ids": ids, "loss_mask": (np.arange(20) >= 16).astype(np.float32)},  # only the cut-off target
        {"input_ids": ids, "loss_mask": (np.arange(20) >= 15).astype(np.float32)},  # one target survives
        {"input_ids": ids[:4], "loss_mask": np.ones(4)},
    ]
    node = shard_graph(docs, GraphOptions(capacity=16, cp_size=1, layout="identity", plan=StreamPlan(overflow="truncate"), data=DataPolicy(labels_alignment="inputs")))  # fmt: skip
    node.reset()
    collated = list(node)
    batches = [b.tensors() for b in collated]
    assert sorted(p.index for b in collated for plan in b.plans for p in plan.pieces) == [3, 4]
    stats = node.source.stats
    assert stats.untrained == 3 and stats.untrained_tokens == 6 + 20 + 20
    assert stats.truncated == 1 and stats.truncated_tokens == 4
    assert stats.tokens + stats.truncated_tokens + stats.untrained_tokens == 6 + 20 * 3 + 4
    labels = np.concatenate([b["labels"].reshape(-1) for b in batches])
    assert int((labels != -100).sum()) == 1 + 3, "doc 3: position 14 -> token 16; doc 4: three targets"
    assert labels[14] == 16 and labels[15] == -100, "the truncated document's last kept token has no target"
    total = sum(int(b["loss_mask"].sum()) for b in batches)
    assert total == 4


@pytest.mark.parametrize("value", [None, "abc", [[1, 2], [3]], [1, None, 2], ["a", "b", "c"]])
@pytest.mark.parametrize("kind", ["sequence", "iterable", "node"])
def test_malformed_labels_are_refused_with_the_document_index(value, kind):
    docs = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]} for _ in range(4)]
    docs[2] = {"input_ids": [1, 2, 3], "labels": value}

    class Reiterable:
        def __iter__(self):
            return iter(docs)

    source = {"sequence": docs, "iterable": Reiterable(), "node": IterableWrapper(docs)}[kind]
    node = Pack(Documents(source, labels_alignment="inputs"), capacity=16, layout="identity", cp_size=1)
    node.reset()
    with pytest.raises((TypeError, ValueError), match="document 2: 'labels'"):
        list(node)


def test_labels_outside_the_vocabulary_are_refused():
    docs = [{"input_ids": [1, 2, 3], "labels": [1, -5, 3]}]
    with pytest.raises(ValueError, match=r"document 0: labels\[1\]=-5 is neither -100"):
        list(Documents(docs, labels_alignment="targets"))
    with pytest.raises(ValueError, match=r"labels\[2\]=30 .* below vocab_size=10"):
        list(Documents([{"input_ids": [1, 2, 3], "labels": [1, 2, 30]}], labels_alignment="targets", vocab_size=10))
    with pytest.raises(ValueError, match=r"labels\[2\]=10 .* below vocab_size=10"):  # the first id past the vocabulary
        list(Documents([{"input_ids": [1, 2, 3], "labels": [1, 2, 10]}], labels_alignment="targets", vocab_size=10))
    (last_id,) = Documents([{"input_ids": [1, 2, 3], "labels": [1, 2, 9]}], labels_alignment="targets", vocab_size=10)
    assert last_id.arrays["labels"].tolist() == [1, 2, 9], "the last id of the vocabulary is a target like any"
    with pytest.raises(ValueError, match="'loss_mask' must hold 0/1 values.*0.5 at position 1"):
        list(Documents([{"input_ids": [1, 2, 3], "loss_mask": [1, 0.5, 1]}], labels_alignment="inputs"))


def test_cp_shards_carry_the_shifted_targets():
    """The shift happens before sharding: each CP rank's labels are the full pack's at its positions."""
    chats = _chats()
    (full,) = _full_batches(chats, labels_alignment="inputs", capacity=128, layout="thd", cp_size=2)
    got = np.full(128, -7)
    for r in range(2):
        loader = build_loader(chats, capacity=128, cp_size=2, cp_rank=r, layout="thd", data=DataPolicy(labels_alignment="inputs"), delivery=Delivery(prefetch=0))  # fmt: skip
        with closing_loader(loader):
            (batch,) = list(loader)
        got[batch.layout.local_token_global_indices.numpy()] = batch["labels"].numpy().reshape(-1)
    assert got.tolist() == full["labels"].reshape(-1).tolist()


def test_hf_model_loss_on_the_packed_batch_equals_the_loss_on_each_document_alone():
    """A Hugging Face causal LM: the loss of cpdata's packed batch (labels as shift_labels, document mask) equals
    the token-weighted loss of each chat run alone with its HF labels (input_ids, -100 outside the replies)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = chat_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(cfg).double().eval()
    chats = _chats()
    (batch,) = _full_batches(chats, labels_alignment="inputs", padding_token_id=tok.eos_token_id)
    t = {k: torch.from_numpy(v) for k, v in batch.items()}
    doc, n = t["document_ids"][0], t["input_ids"].shape[1]
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    with torch.no_grad():
        packed = model(input_ids=t["input_ids"], position_ids=t["position_ids"], attention_mask=mask,
                       labels=t["labels"], shift_labels=t["labels"]).loss  # fmt: skip
        total, count = 0.0, 0
        for d in chats:
            ids = torch.tensor([d["input_ids"]])
            hf_labels = torch.where(torch.tensor([d["assistant_masks"]]) == 1, ids, -100)
            k = int((hf_labels[0, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=hf_labels).loss) * k
            count += k
    assert count == int((t["labels"] != -100).sum()) > 0
    assert abs(float(packed) - total / count) < 1e-6  # HF computes the loss in float32


def test_precompute_records_the_alignment_and_plans_like_the_online_pipeline(tmp_path):
    """A plan of HF-style rows (one fully masked) leaves out what the online Pack leaves out, records
    labels_alignment in its manifest, and a reader with the other alignment (or none) is refused."""
    import json

    from cpdata import PrecomputedPacks, open_dataset, precompute

    rng = np.random.default_rng(3)
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(30):
            ids = rng.integers(0, 50, int(rng.integers(2, 40))).tolist()
            mask = [0] * len(ids) if i % 7 == 3 else [int(j >= len(ids) // 2) for j in range(len(ids))]
            f.write(json.dumps({"input_ids": ids, "assistant_masks": mask}) + "\n")
    opts = dict(capacity=64, layout="thd", cp_size=2)
    with pytest.raises(ValueError, match="labels_alignment='inputs'.*labels_alignment='targets'"):
        precompute(path, tmp_path / "refused", **precompute_records(**opts))
    store = precompute(path, tmp_path / "plan", **precompute_records(**opts, labels_alignment="inputs"))
    assert store.config["labels_alignment"] == "inputs"
    assert store.manifest["stats"]["untrained"] == 4
    data = open_dataset(path)
    offline = list(PrecomputedPacks(tmp_path / "plan", data, data=DataPolicy(labels_alignment="inputs")))
    online = list(Pack(Documents(data, labels_alignment="inputs"), **opts))
    assert [[(p.index, p.start, p.length) for p in plan.pieces] for plan in offline] == \
        [[(p.index, p.start, p.length) for p in plan.pieces] for plan in online]
    for a, b in zip(offline, online, strict=True):
        for x, y in zip(a.pieces, b.pieces, strict=True):
            assert np.array_equal(x.arrays["labels"], y.arrays["labels"])
    assert not {p.index for plan in offline for p in plan.pieces} & {3, 10, 17, 24}
    for other in ("targets", None):
        with pytest.raises(ValueError, match="precomputed for labels_alignment='inputs'"):
            PrecomputedPacks(tmp_path / "plan", data, data=DataPolicy(labels_alignment=other))


class _Unreadable:
    """A sequence that must not be read (configuration errors come first)."""

    def __len__(self):
        return 3

    def __getitem__(self, i):
        raise AssertionError("the source was read before the configuration was checked")


@pytest.mark.parametrize(
    ("pad", "exc", "pattern"),
    [
        (None, TypeError, "padding_token_id is None .*no pad token.*eos_token_id"),
        (-100, ValueError, "padding_token_id=-100 is negative.*-100 belongs in labels.*eos_token_id"),
        (300, ValueError, "padding_token_id=300 is >= vocab_size=300.*eos_token_id"),
        (1.0, TypeError, "padding_token_id must be an int, got float"),
    ],
)
def test_padding_token_id_is_checked_when_the_pipeline_is_built(pad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        build_loader(_Unreadable(), capacity=16, cp_size=1, cp_rank=0, layout="identity", padding_token_id=pad, data=DataPolicy(vocab_size=300))  # fmt: skip


def test_precompute_checks_its_configuration_before_reading_the_input(tmp_path, monkeypatch):
    import importlib

    pre = importlib.import_module("cpdata.offline.precompute_plan")

    def unreadable(*args, **kwargs):
        raise AssertionError("the input was read before the configuration was checked")

    monkeypatch.setattr(pre, "open_dataset", unreadable)
    path = tmp_path / "big.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n')
    with pytest.raises(ValueError, match="capacity=30 is not a multiple of 4"):
        pre.precompute(path, tmp_path / "plan", capacity=30, cp_size=2, layout="thd")
    with pytest.raises(ValueError, match="unknown StreamPlan.overflow 'cut'"):
        StreamPlan(overflow="cut")  # refused where it is written, before precompute is called
