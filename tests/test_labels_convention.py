"""Labels in the other convention are refused on the first documents of a source, naming both conventions.

Real-looking data: HF/TRL labels (``labels == input_ids``, prompts -100) and
Megatron targets (``labels[i] == input_ids[i + 1]``, prompts -100). Each is
accepted under its own ``labels_alignment`` (the batch's targets then equal the
next token of every trained position: checked against a brute force) and
refused under the other one; ``unchecked_alignment`` turns the check off and
gives the batch the declared (wrong) meaning.
"""

from __future__ import annotations

import numpy as np
import pytest

from cpdata.nodes.loader import shard_graph
from cpdata.worker.targets import CONVENTION_CHECK, unchecked_alignment
from tests.flat_options import graph_options

PACK = dict(capacity=256, cp_size=1, layout="identity", algorithm="next_fit")


def _chats(convention: str, n: int = 6, seed: int = 0) -> list[dict]:
    """Chat-like rows: a prompt of -100 labels, then a trained reply, in ``convention``'s labels."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, 500, int(rng.integers(20, 40)))
        prompt = int(rng.integers(4, 10))
        if convention == "inputs":  # HF: the label of each token is the token itself
            labels = ids.copy()
            labels[:prompt] = -100
        else:  # Megatron: the label of each token is the next one
            labels = np.append(ids[1:], -100)
            labels[: prompt - 1] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _targets(docs, alignment) -> list[tuple[int, int]]:
    """(input token, its target) at every trained position of the packed batches."""
    node = shard_graph(docs, graph_options(labels_alignment=alignment, **PACK))
    node.reset()
    pairs = []
    for batch in node:
        t = batch.tensors()
        ids, labels = t["input_ids"].reshape(-1), t["labels"].reshape(-1)
        pairs += [(int(ids[i]), int(labels[i])) for i in np.flatnonzero(labels != -100)]
    return pairs


def _next_token_pairs(docs) -> list[tuple[int, int]]:
    """Brute force: every reply token's (previous token, token) pair, document by document."""
    pairs = []
    for d in docs:
        ids = d["input_ids"]
        reply_start = int(np.flatnonzero(d["labels"] != -100)[0])
        first = reply_start if d["labels"][reply_start] == ids[reply_start] else reply_start + 1  # HF or Megatron
        pairs += [(int(ids[i - 1]), int(ids[i])) for i in range(first, len(ids))]
    return pairs


@pytest.mark.parametrize("convention", ["inputs", "targets"])
def test_masked_chat_data_in_its_declared_convention_passes(convention):
    docs = _chats(convention)
    pairs = _targets(docs, convention)
    assert pairs and pairs == _next_token_pairs(docs)


@pytest.mark.parametrize(("convention", "declared", "says"), [
    ("inputs", "targets", "equal the input at the same position"),
    ("targets", "inputs", "equal the next input"),
])  # fmt: skip
def test_labels_in_the_other_convention_are_refused_with_both_names_and_the_fix(convention, declared, says):
    with pytest.raises(ValueError) as info:
        _targets(_chats(convention), declared)
    message = str(info.value)
    assert f"labels_alignment={declared!r} was declared" in message and says in message
    assert f"Pass labels_alignment={convention!r}" in message and "unchecked_alignment" in message


def test_unchecked_alignment_keeps_the_declared_meaning():
    docs = _chats("inputs")
    pairs = _targets(docs, unchecked_alignment("targets"))
    assert pairs and all(token == target for token, target in pairs)  # copies of the input, as declared


def test_only_the_first_documents_are_judged_and_short_ones_not_at_all():
    wrong = _chats("inputs", n=CONVENTION_CHECK.documents + 2)
    right = _chats("targets", n=CONVENTION_CHECK.documents, seed=1)
    assert _targets(right + wrong[-2:], "targets")  # past the checked documents: not judged
    short = [{"input_ids": np.arange(3, 3 + CONVENTION_CHECK.min_trained), "labels": np.arange(3, 3 + 8)}]
    short[0]["labels"][0] = -100  # fewer than min_trained trained labels before the last token
    assert _targets(short, "targets")


def _shares(doc) -> tuple[int, float, float]:
    """Brute force over ``labels[:-1]``: trained labels, and the share equal to the same / the next input."""
    ids, labels = doc["input_ids"], doc["labels"]
    pairs = [(int(labels[i]), int(ids[i]), int(ids[i + 1])) for i in range(len(ids) - 1) if labels[i] != -100]
    n = len(pairs)
    return n, sum(lab == same for lab, same, _ in pairs) / n, sum(lab == nxt for lab, _, nxt in pairs) / n


def test_a_document_with_exactly_min_trained_labels_is_judged():
    """HF labels declared "targets": refused from ``min_trained`` trained labels on, not below."""
    ids = np.arange(3, 3 + CONVENTION_CHECK.min_trained + 1)  # distinct tokens: no label equals the next input
    doc = {"input_ids": ids, "labels": ids.copy()}
    assert _shares(doc) == (CONVENTION_CHECK.min_trained, 1.0, 0.0)
    with pytest.raises(ValueError, match="labels_alignment='targets' was declared"):
        _targets([doc], "targets")
    fewer = {"input_ids": ids, "labels": np.where(np.arange(ids.size) == 0, -100, ids)}
    assert _shares(fewer)[0] == CONVENTION_CHECK.min_trained - 1
    assert _targets([fewer], "targets") == [(int(ids[i]), int(ids[i])) for i in range(1, ids.size)]


def test_labels_matching_the_declared_convention_at_exactly_the_unlike_share_are_accepted():
    """Repeated tokens make a label equal the same and the next input at once: at exactly ``unlike`` of them
    equal to the declared convention's token the document is not refused, and keeps the labels as declared."""
    repeats = round(CONVENTION_CHECK.unlike * 16)  # of the 16 labels before the last token
    ids = np.concatenate([np.repeat(np.arange(3, 3 + repeats), 2), np.arange(100, 100 + 17 - 2 * repeats)])
    doc = {"input_ids": ids, "labels": ids.copy()}  # label i == input i; input i == input i + 1 at half of them
    n, same, following = _shares(doc)
    assert n >= CONVENTION_CHECK.min_trained and same >= CONVENTION_CHECK.looks_like
    assert following == CONVENTION_CHECK.unlike, "the document sits on the threshold"
    expected = [(int(ids[i]), int(ids[i])) for i in range(ids.size)]  # "targets": label i is input i's target
    assert _targets([doc], "targets") == expected
    ids[1] = 99  # one repeat less: under the unlike share, refused
    assert _shares(doc)[2] < CONVENTION_CHECK.unlike
    with pytest.raises(ValueError, match="labels_alignment='targets' was declared"):
        _targets([doc], "targets")


def test_labels_equal_to_the_other_convention_at_exactly_the_looks_like_share_are_refused():
    """Nine of ten trained labels copy their own input (``looks_like`` = 0.9), none the next: refused."""
    ids = np.arange(3, 14)  # 10 labels before the last token
    labels = ids.copy()
    labels[4] = 500  # neither input 4 nor input 5
    doc = {"input_ids": ids, "labels": labels}
    assert _shares(doc) == (10, CONVENTION_CHECK.looks_like, 0.0)
    with pytest.raises(ValueError, match="90% of its 10 trained labels equal the input at the same position"):
        _targets([doc], "targets")
    labels[5] = 501  # 80%: under the share, kept as declared
    assert _targets([doc], "targets") == [(int(i), int(t)) for i, t in zip(ids, labels, strict=True)]
